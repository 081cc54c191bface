"""Guards that a transformers model trains under FPDT as its own forward computes, found from its behaviour.

``HFCausalLM`` computes two things differently from a transformers model's own forward, and either would be
silently wrong for a family that does something the FPDT path does not reproduce. Both are checked from
what the model does, not from a list of family names, so families nobody has tried are covered too:

- **The context must arrive** (:func:`check_context_arrived`). Each attention layer gets the
  sequence-parallel context as forward keywords, or delivered on the layer itself where a family's
  decoder layers call their attention without passing their keywords on
  (:func:`lightning_fpdt.hf.attention.delivered_to`). The attention function records every layer
  that ran with it; a layer that did not (its attention never calls the registered function, or calls it
  with another module and no keywords) attended only to this rank's tokens, and the step is refused.
- **The head's transform** (:func:`~lightning_fpdt.hf.head_transform.find_head_transform`, its own module).
  The loss is computed in token tiles from the base model's hidden states and the output embedding, so whatever
  a family's forward does to the logits after the output embedding must be applied by the loss too; it is
  fitted to what the model's own forward does, and a head no fitted function reproduces is refused by name.

A third guard reads the config: a RoPE schedule whose frequencies follow the largest position id of a forward
(``dynamic``, ``longrope``) is refused when bound to more than one rank (:func:`check_static_rope`).
"""

from __future__ import annotations

from transformers import PretrainedConfig, PreTrainedModel

from lightning_fpdt.errors import Unsupported
from lightning_fpdt.hf.attention import LayerRecords, attention_layers
from lightning_fpdt.parallel.binding import SequenceParallelContext
from lightning_fpdt.parallel.packed_documents import PackedDocuments


def check_context_arrived(
    model: PreTrainedModel,
    context: SequenceParallelContext,
    bound: bool,
    documents: PackedDocuments | None,
    records: LayerRecords,
) -> None:
    """Refuse, right after a forward, the attention layers that ran without the FPDT context.

    The attention function leaves a record under the layer's ``layer_idx`` whenever it runs with the
    context (by keyword or delivered on the layer); a layer without one attended by other means: only to
    this rank's tokens, across documents, or unchunked. Checked whenever the strategy has bound a context
    (the same on every rank, so every rank raises together, before any gradient is reduced) or the batch
    holds packed documents.

    Args:
        model: the transformers model that just ran its forward.
        context: the bound context.
        bound: whether a strategy bound ``context`` (``FPDTStrategy`` always does).
        documents: the batch's packed documents (``None``: one per sample).
        records: the records the forward's attention calls left, by ``layer_idx``.

    Raises:
        NotImplementedError: naming the model class, the layer and what it did not receive.
    """
    if not bound and documents is None:
        return
    missed = [(name, m) for name, m in attention_layers(model) if m.layer_idx not in records]
    if not missed:
        return
    features = ([f"sequence parallelism over {context.size} ranks"] if context.size > 1 else []) + (
        [f"FPDT chunks (chunk_size={context.chunk_size})"] if context.chunk_size is not None else []) + (
        ["packed documents"] if documents is not None else []) or ["the FPDT attention pipeline"]
    name, layer = missed[0]
    raise Unsupported(
        f"HFCausalLM: attention layer model.{name} ({type(layer).__name__}) of {type(model).__name__} ran without"
        f" the FPDT context ({', '.join(features)}; {len(missed)} of {len(attention_layers(model))} layers):"
        " its attention does not call the attention function transformers registers for the model"
        " (ALL_ATTENTION_FUNCTIONS[config._attn_implementation]) with the layer itself, so it attended only to"
        " this rank's tokens and training would be silently wrong. This model family is not supported; its"
        " attention must call the registered function as transformers' own families do."
    )


def check_static_rope(config: PretrainedConfig) -> None:
    """Refuse RoPE types whose frequencies follow the batch's largest position id (``dynamic``, ``longrope``):
    transformers reads it from the ``position_ids`` its rotary embedding is given, which under sequence
    parallelism are one rank's shard, so ranks would rotate with different frequencies.

    Raises:
        NotImplementedError: such a type, named with the layer type it is set for.
    """
    parameters = getattr(config.get_text_config(), "rope_parameters", None) or {}
    nested = config.get_text_config().nested_rope_parameter_keys(parameters)
    for layer_type, entry in ({t: parameters[t] for t in nested} if nested else {"all": parameters}).items():
        rope_type = (entry or {}).get("rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise Unsupported(
                f"HFCausalLM: RoPE type {rope_type!r} (layers: {layer_type}) picks its frequencies from the largest"
                " position id of each forward, which under sequence parallelism is one rank's shard; set a fixed"
                " schedule with config_overrides={'rope_parameters': {'rope_type': 'yarn', 'factor': ...}}"
                " (docs/context-extension.md)."
            )

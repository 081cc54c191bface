"""Which modules of a transformers model are its attention layers, and which of those the FPDT pipeline refuses
because they choose their keys themselves.

An attention layer is a module whose class name ends in ``Attention``, that knows its ``layer_idx`` (the transformers
convention for the layer that calls the attention function) and that is not a linear-attention recurrence (Kimi
Linear's ``KimiLinearDeltaAttention`` and MiniMax's ``MiniMaxLightningAttention`` are named so but run a recurrence:
:mod:`lightning_fpdt.hf.recurrent` makes them sequence-parallel, and no attention function is called by them).
"""

from __future__ import annotations

import functools

from torch import nn
from transformers import PreTrainedModel

from lightning_fpdt.errors import Unsupported
from lightning_fpdt.hf.kernel_binding import reached_kernels
from lightning_fpdt.hf.lightning_attention import is_lightning_class
from lightning_fpdt.hf.recurrent_heads import DELTA_RULE, KDA, SCAN, SELECTIVE_SCAN


def is_attention_layer(module: nn.Module) -> bool:
    """A transformers self-attention layer (the module docstring)."""
    return type(module).__name__.endswith("Attention") and hasattr(module, "layer_idx") and not _recurrence(
        type(module)) and not is_lightning_class(type(module))


@functools.cache
def _recurrence(cls: type) -> bool:
    """Whether ``cls``'s forward reaches a delta-rule or scan kernel (a linear attention named ``*Attention``)."""
    forward = getattr(cls, "forward", None)
    try:
        return bool({DELTA_RULE, KDA, SCAN, SELECTIVE_SCAN} & set(reached_kernels(forward)))
    except (TypeError, AttributeError):  # a forward without Python code
        return False


def attention_layers(model: PreTrainedModel) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every self-attention layer of a transformers decoder (:func:`is_attention_layer`), in
    module order."""
    return [(name, m) for name, m in model.named_modules() if is_attention_layer(m)]


# attention layers whose keys are not those of their mask: a submodule of this role picks or makes them
_SELECTED_KEYS = {
    "Indexer": "sparse attention: a lightning indexer scores every earlier key for each query, and the query attends"
               " only to its top-k keys",
    "Compressor": "compressed attention: a compressor pools every few tokens' keys and values into one entry, and"
                  " the queries attend to those entries beside a window of plain keys",
}


def refuse_selected_keys(model: PreTrainedModel, name: str, layer: nn.Module) -> None:
    """Refuse an attention layer that selects its keys (DeepSeek-V3.2's indexer) or adds keys of its own
    (DeepSeek-V4's compressors): the FPDT pipeline attends each query to every key its mask allows, chunk by chunk
    and across the ranks, so a layer's top-k choice over all earlier keys, or keys pooled from other ranks' tokens,
    is not computed; before this check such a model failed inside its first forward (an ``AttributeError`` in the
    mask probe, a shape error)."""
    for sub_name, sub in layer.named_modules():
        role = next((r for r in _SELECTED_KEYS if type(sub).__name__.endswith(r)), None)
        if role is not None:
            raise Unsupported(
                f"HFCausalLM: layer {name} ({type(layer).__name__}) of {type(model).__name__} uses"
                f" {_SELECTED_KEYS[role]} ({type(sub).__name__} at {name}.{sub_name}); the FPDT pipeline attends each"
                " query to every key its mask allows, chunk by chunk across the ranks, so the keys this layer"
                " selects or pools are not computed. This family is not supported."
            )

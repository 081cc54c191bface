"""A Hugging Face attention function that runs through the FPDT pipeline, and the checks that a model fits it.

transformers (5.x) calls the function registered under a model's ``config._attn_implementation`` with
q, k, v after projection and RoPE, ``[batch, heads, seq, head_dim]``; here ``seq`` is this rank's shard in
the FPDT layout and RoPE has used the global ``position_ids`` the strategy made. The function is
registered once under :data:`ATTN_IMPLEMENTATION` (a name no other model uses) and selected per model
(:func:`install`), so other models in the process keep their own attention.

The sequence-parallel context and the batch's documents reach the function as forward keyword arguments
(``fpdt_context``, ``documents``, ``fpdt_records``) where a family passes a model's ``**kwargs`` down to
its attention layers. Where its decoder layers call their attention without them (StableLM), they are
delivered on the attention layers themselves for the duration of the call that carries them
(:func:`delivered_to`: around the base model's forward, and around each decoder layer's forward and its
recomputation in backward, :func:`delivering`), and cleared after: nothing global, and a model used
outside ``HFCausalLM`` never sees them. ``lightning_fpdt.hf.guards`` refuses a layer they still miss.

Mask creation: transformers builds no mask for an implementation missing from its
``AttentionMaskInterface`` (``masking_utils._preprocess_mask_arguments`` returns early), which is what we
want: a ``[seq, seq]`` mask over sharded lengths would be wrong and large; causality and documents are the
pipeline's. So are sliding windows: a sliding layer's window arrives as the ``sliding_window``
argument of its call (``lightning_fpdt.hf.masks`` refuses a layer whose mask has a window its call does
not pass). A chunked layer's attention chunk size (Llama-4) reaches no call: the mask probe records it on the
layer. Llama-4's temperature-tuned NoPE layers scale q at local positions; ``lightning_fpdt.hf.temperature``
rescales it to the tokens' own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel

from lightning_fpdt.attention import attention_options, fpdt_attention
from lightning_fpdt.errors import FPDTError, Unsupported
from lightning_fpdt.hf.attention_layers import attention_layers, is_attention_layer, refuse_selected_keys
from lightning_fpdt.hf.masks import attention_chunk_size, check_mask_windows
from lightning_fpdt.hf.temperature import tuned_queries, tunes_temperature
from lightning_fpdt.layers.layer_stream import active_stream
from lightning_fpdt.parallel.binding import AttentionRecord, SequenceParallelContext
from lightning_fpdt.parallel.packed_documents import PackedDocuments

ATTN_IMPLEMENTATION = "lightning_fpdt"

_ONE_PROCESS = SequenceParallelContext()

# ---- context delivery (hf_guards checks that it arrived) -------------------------------------------------

FPDT_KEYWORDS = ("fpdt_context", "documents", "fpdt_records")


class LayerRecords:
    """Where each attention call leaves its :class:`~lightning_fpdt.parallel.binding.AttentionRecord`, by ``layer_idx``.

    Not a dict (nor a dataclass) on purpose: FSDP2 rebuilds dict and dataclass keyword arguments when it casts
    a layer's forward inputs (mixed precision), and records left in such a copy would never reach the model.
    """

    def __init__(self) -> None:
        self.by_layer: dict[int, AttentionRecord] = {}

    def leave(self, module: nn.Module, record: AttentionRecord) -> None:
        """Keep ``record`` as the latest call of attention layer ``module``."""
        self.by_layer[getattr(module, "layer_idx", len(self.by_layer))] = record

    def clear(self) -> None:
        self.by_layer.clear()

    def __contains__(self, layer_idx: object) -> bool:
        return layer_idx in self.by_layer

    def in_layer_order(self) -> list[AttentionRecord]:
        """The records, by increasing ``layer_idx``."""
        return [self.by_layer[index] for index in sorted(self.by_layer)]
_DELIVERED = "_fpdt_delivered"  # an attention layer's attribute while a call that carries the keywords runs


@contextmanager
def delivered_to(modules: Iterable[nn.Module], keywords: dict[str, Any]) -> Iterator[None]:
    """Deliver the FPDT keywords of ``keywords`` (``fpdt_context``, ``documents``, ``fpdt_records``) on each
    attention layer of ``modules`` until the block ends, for layers that are called without them; nothing
    when ``keywords`` carries no ``fpdt_context``. Nested deliveries restore the outer one."""
    if "fpdt_context" not in keywords:
        yield
        return
    values = {k: keywords.get(k) for k in FPDT_KEYWORDS}
    saved = [(m, m.__dict__.get(_DELIVERED)) for m in modules]
    for m, _ in saved:
        m.__dict__[_DELIVERED] = values
    try:
        yield
    finally:
        for m, outer in saved:
            if outer is None:
                m.__dict__.pop(_DELIVERED, None)
            else:
                m.__dict__[_DELIVERED] = outer


def delivering(layer: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` of decoder layer ``layer``, delivering the FPDT keywords of each call to ``layer``'s attention
    layers (and recurrences: :func:`receives_keywords`) while it runs: so a recomputation in backward (activation
    checkpointing), which calls it with the keywords its forward had, delivers them again after the base model's
    own delivery has ended. The receivers are looked up at each call: a recurrence installed once the weights are
    in is one too."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with delivered_to([m for m in layer.modules() if receives_keywords(m)], kwargs):
            return forward(*args, **kwargs)

    return run


def delivered_keywords(module: Any) -> dict[str, Any]:
    """The FPDT keywords delivered on ``module`` while a call that carries them runs (:func:`delivered_to`), or
    ``{}``."""
    return getattr(module, "__dict__", {}).get(_DELIVERED) or {}


def receives_keywords(module: nn.Module) -> bool:
    """An attention layer, or a module whose installed forward reads the FPDT keywords (``fpdt_keywords``: the
    recurrences of :mod:`lightning_fpdt.hf.recurrent`): where :func:`delivered_to` delivers them."""
    return is_attention_layer(module) or getattr(module.__dict__.get("forward"), "fpdt_keywords", False)


def kernel_dtype(*tensors: Tensor) -> torch.dtype:
    """The one dtype q, k and v go into the pipeline's kernels in: autocast's where it is on for their device (as
    transformers' own attention functions get them: a rotary embedding in float32 promotes q and k, not v), else
    their common type (float64 oracles stay float64)."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


def fpdt_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    fpdt_context: SequenceParallelContext | None = None,
    documents: PackedDocuments | None = None,
    fpdt_records: LayerRecords | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention of one Hugging Face attention layer through :func:`lightning_fpdt.attention.fpdt_attention`.

    Args:
        module: the transformers attention layer (read for ``is_causal`` and its name in errors).
        query: ``[batch, n_heads, s_local, head_dim]``, this rank's tokens (FPDT layout), RoPE applied.
        key: ``[batch, n_kv_heads, s_local, head_dim]``; ``n_kv_heads`` may be below the SP size.
        value: ``[batch, n_kv_heads, s_local, v_head_dim]``; ``v_head_dim`` may differ from ``head_dim``
            (multi-head latent attention: DeepSeek-V2/V3, MiniCPM3 pass v narrower than q and k).
        attention_mask: must be ``None``: causality and packed documents are handled by the pipeline.
        scaling: the layer's softmax scale (``query_pre_attn_scalar`` etc. already folded in).
        dropout: attention dropout probability; only 0 is supported.
        fpdt_context: the bound sequence-parallel context; ``None``: one process, plain Ulysses options.
        documents: the batch's packed documents (``None``: one per sample).
        fpdt_records: where this call leaves its :class:`~lightning_fpdt.parallel.binding.AttentionRecord`
            (chunks, offload statistics), under the layer's ``layer_idx``, for ``FPDTMonitor``; ``None``: nowhere.
        **kwargs: other transformers arguments. Read: ``sliding_window`` (the layer's window, which
            transformers passes only to sliding layers: a query at position ``i`` sees keys ``i - W + 1 .. i``,
            as its ``sliding_window_overlay`` mask counts it), ``softcap`` (attention-logit softcapping) and
            ``s_aux`` (attention sinks ``[n_heads]``; else the layer's own ``sinks`` parameter, which
            transformers' eager attention reads). Refused: ``is_causal=False`` and a ``position_bias``.

    Returns:
        ``([batch, s_local, n_heads, v_head_dim], None)``: the output and no attention weights.

    Raises:
        NotImplementedError: a feature the pipeline does not compute (see :func:`check_supported`).
        ValueError: an explicit attention mask.
    """
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    _refuse_call_features(where, module, dropout, kwargs)
    if key.shape[2] != query.shape[2] or value.shape[2] != query.shape[2]:
        raise Unsupported(
            f"HFCausalLM: {where} attends with {key.shape[2]} keys to {query.shape[2]} queries of this rank's"
            " tokens (keys compressed along the sequence, or kept from elsewhere): the FPDT pipeline attends each"
            " token's query to the keys of the same tokens, exchanged between ranks chunk by chunk, so this layer's"
            " attention cannot be computed under FPDT; this model is not supported."
        )
    if attention_mask is not None:
        raise FPDTError(
            f"HFCausalLM: {where} received an attention mask {tuple(attention_mask.shape)}; under FPDT, padding"
            " and packed documents travel as 'attention_mask' / 'position_ids' in the batch dict, which the"
            " strategy turns into documents. Do not pass a mask to the model yourself."
        )
    if fpdt_context is None:  # a layer that does not pass its keywords on: delivered on the layer (delivered_to)
        delivered = delivered_keywords(module)
        fpdt_context, documents, fpdt_records = (delivered.get(k) for k in FPDT_KEYWORDS)
    ctx = fpdt_context or _ONE_PROCESS
    # [b, h, s_local, d] -> [b, s_local, h, d]: the pipeline's layout (s_local = S // sp)
    stream = active_stream(module)
    if tunes_temperature(module):  # Llama-4's NoPE layers scaled q at local positions: at the tokens' own instead
        query = tuned_queries(module, query, ctx, documents, *(() if stream is None else (stream.lo, stream.s_local)))
    dtype = kernel_dtype(query, key, value)
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (query, key, value))
    options = dict(
        group=ctx.attention_group, ring_group=ctx.ring_group, chunk_size=ctx.chunk_size, causal=True,
        backend=ctx.attention_backend, scale=scaling, offload=ctx.offload, documents=documents,
        window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"),
        attention_chunk_size=attention_chunk_size(module),  # chunked layers: read from their mask (hf.masks)
    )

    def new_record(s_local: int) -> AttentionRecord:
        record = AttentionRecord.for_call(s_local, ctx)
        if fpdt_records is not None:
            fpdt_records.leave(module, record)
        return record

    if stream is not None:  # its decoder layer streams (lightning_fpdt.hf.streamed): this chunk, from the stream
        return stream.attend(q, k, v, lambda: attention_options(q, stats_sink=new_record(stream.s_local).sink,
                                                                **options), sinks=_sinks(module, kwargs)), None
    out = fpdt_attention(q, k, v, stats_sink=new_record(q.shape[1]).sink, sinks=_sinks(module, kwargs), **options)
    return out, None  # [b, s_local, h, d], as transformers' own functions return it


AttentionInterface.register(ATTN_IMPLEMENTATION, fpdt_attention_forward)


def _refuse_call_features(where: str, module: nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    # what transformers' own attention functions would compute and the pipeline does not, read from this call
    # (a config may have been changed after construction, and a layer may pass is_causal per call)
    causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if causal is None else causal):
        raise Unsupported(
            f"HFCausalLM: {where} is bidirectional (is_causal=False), which the FPDT pipeline does not compute:"
            " it is causal only (each rank's later chunks are never sent to earlier queries)."
        )
    if kwargs.get("position_bias") is not None:
        raise Unsupported(
            f"HFCausalLM: {where} adds a position bias ({_short(kwargs['position_bias'])}) to its attention"
            " logits, which the FPDT pipeline does not compute: a [heads, seq, seq] bias over the whole sequence"
            " is what chunking avoids. Use a family with rotary positions."
        )
    if dropout > 0:
        raise Unsupported(
            f"HFCausalLM: {where} uses attention dropout {dropout} in training, which the FPDT pipeline does not"
            " compute; set the config's attention dropout to 0."
        )


def _sinks(module: nn.Module, kwargs: dict[str, Any]) -> Tensor | None:
    """The layer's attention sinks: ``s_aux`` (what transformers passes flash kernels), else ``module.sinks``
    (what its eager attention reads)."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    return sinks if isinstance(sinks, Tensor) else None


def _short(value: Any) -> str:
    return f"tensor{tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)


def head_widths(config: Any) -> tuple[int, int]:
    """``(q/k head width, v head width)`` of a transformers text config's attention layers.

    Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, MiniCPM3, GLM-MoE-DSA, ...) attends with q and k of
    ``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim`` and v of ``v_head_dim`` (its ``head_dim`` is the rotary
    part only); other configs ``head_dim`` (or ``hidden_size / heads``), v the same unless they have their own
    ``v_head_dim`` (MiMo-V2-Flash).
    """
    qk = getattr(config, "qk_head_dim", None)
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    if not isinstance(qk, int):
        qk = nope + rope if isinstance(nope, int) and isinstance(rope, int) else None
    if qk is None:
        qk = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    v = getattr(config, "v_head_dim", None)
    return qk, v if isinstance(v, int) else qk


def layer_head_widths(layer: nn.Module, config: Any) -> tuple[int, int]:
    """``(q/k head width, v head width)`` of attention layer ``layer``: its own ``qk_head_dim``/``head_dim`` and
    ``v_head_dim`` where it has them (Gemma-4's full layers are wider than its sliding ones), else the config's
    (:func:`head_widths`)."""
    qk = next((w for name in ("qk_head_dim", "head_dim") if isinstance(w := getattr(layer, name, None), int)), None)
    if qk is None:
        return head_widths(config)
    v = getattr(layer, "v_head_dim", None)
    return qk, v if isinstance(v, int) else qk


def check_supported(model: PreTrainedModel) -> bool:
    """Refuse, naming the feature and the layer, what a layer computes and the FPDT pipeline cannot; return
    whether the mask probe ran (``False``: a meta-device model to probe again once its weights are in).

    Read from each attention layer (what its forward passes to the attention function), not from config
    fields a layer may ignore (a Llama config's ``sliding_window``). Sliding windows, attention-logit
    softcapping and attention sinks are computed (:func:`fpdt_attention_forward`); refused are bidirectional
    layers (FPDT is causal) and attention dropout (the pipeline draws no dropout mask). Called at
    construction, so every rank raises before any collective.

    Raises:
        NotImplementedError: a bidirectional (``is_causal=False``) layer, attention dropout > 0, or a layer
            whose transformers mask has a window its attention call does not pass
            (:func:`~lightning_fpdt.hf.masks.check_mask_windows`).
        ValueError: a model without recognisable attention layers.
    """
    layers = attention_layers(model)
    if not layers:
        raise FPDTError(
            f"HFCausalLM: found no attention layers in {type(model).__name__} (modules named '*Attention' with"
            " a 'layer_idx'); this model family is not supported."
        )
    for name, m in layers:
        refuse_selected_keys(model, name, m)
        problems = []
        if not getattr(m, "is_causal", True):
            problems.append(("bidirectional attention (is_causal=False), where every token sees later ones",
                             "the FPDT pipeline is causal only; use causal layers (e.g."
                             " use_bidirectional_attention=False)"))
        drop = getattr(m, "attention_dropout", 0.0)
        if isinstance(drop, float) and drop > 0:
            problems.append((f"attention dropout {drop} in training",
                             "the FPDT pipeline draws no dropout mask over its blocks; set attention_dropout=0.0"
                             " in the config"))
        if problems:
            feature, fix = problems[0]
            raise Unsupported(
                f"HFCausalLM: layer {name} ({type(m).__name__}) uses {feature}, which the FPDT attention pipeline"
                f" does not compute: {fix}."
            )
    return check_mask_windows(model, layers)  # a window the mask has and the call does not pass


def install(model: PreTrainedModel) -> None:
    """Route ``model``'s attention (and only its) through :func:`fpdt_attention_forward`."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)

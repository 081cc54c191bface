"""Which keys each attention layer of a transformers model lets a query see, read from the model itself.

Under FPDT transformers builds no attention mask (the registered implementation has no mask function), so a
sliding layer's window reaches the pipeline only as the ``sliding_window`` argument of its attention call.
Most families pass it; a few build a sliding-window mask for a layer whose call carries no window (PhiMoE,
Qwen2-MoE, Doge, BLT in transformers 5.24), and would silently attend to the whole causal context. A probe
finds them: the model runs two tokens with an attention implementation whose mask function does not build a
mask but reads the rule transformers' mask function encodes (causal, and the window: the first distance a
query far into the sequence no longer sees), and whose attention function records each layer's call. A
layer whose call disagrees with its own mask is refused, naming both.

Chunked attention (Llama-4's ``attention_chunk_size``: a query sees the earlier keys of its own chunk of that many
tokens) reaches no layer's call at all: the probe reads the chunk size from the layer's mask and records it on the
layer (:func:`attention_chunk_size`), where the FPDT attention function reads it at each call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel

from lightning_fpdt.errors import Unsupported, described

_PROBE = "lightning_fpdt_mask_probe"
_FAR = 1 << 40  # a query position beyond any window: the rule read there holds for every position
_CHUNK = "_fpdt_attention_chunk_size"  # an attention layer's attribute: its chunked attention's chunk size


@dataclass(frozen=True)
class MaskRule:
    """The keys a query at position ``i`` sees under a layer's transformers mask: ``i - window + 1 .. i`` (causal,
    ``window=None``: ``0 .. i``); with ``chunk``, those of ``0 .. i`` in the query's attention chunk (``k // chunk
    == i // chunk``: transformers' ``chunked_overlay``); or ``pattern=False`` when the mask is none of these."""

    causal: bool
    window: int | None
    pattern: bool = True
    chunk: int | None = None

    def __getitem__(self, rows: Any) -> MaskRule:
        """The rule of some of the mask's rows: the same rule (a family may slice its masks, as Gemma-4 does for
        the query positions of its KV-shared layers; the probe keeps every position)."""
        return self


def read_mask_rule(mask_function: Any) -> MaskRule:
    """The rule of a transformers mask function ``(batch, head, q_idx, kv_idx) -> bool``, from its values at
    positions far into the sequence (binary search for the window, then checked at other positions)."""

    def sees(q: int, kv: int) -> bool:
        zero = torch.tensor(0)
        return bool(mask_function(zero, zero, torch.tensor(q), torch.tensor(kv)))

    causal = not sees(_FAR, _FAR + 1)
    window = None
    if not sees(_FAR, 0):
        lo, hi = 1, _FAR  # sees distance lo - 1, not distance hi
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if sees(_FAR, _FAR - mid) else (lo, mid)
        window = lo
    rule = MaskRule(causal=causal, window=window)
    if all(sees(q, q - d) == (window is None or d < window) for q, d in _checks(window)):
        return rule  # the same rule at other positions
    # chunked: the first query that no longer sees key 0 starts the second chunk
    lo, hi = 1, _FAR  # query lo - 1 sees key 0, query hi does not
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if sees(mid, 0) else (lo, mid)
    if all(sees(q, q - d) == (d <= q % lo) for q, d in _checks(lo, (lo, 2 * lo - 1, 2 * lo, 5 * lo + 1))):
        return MaskRule(causal=causal, window=None, chunk=lo)
    return MaskRule(causal=causal, window=window, pattern=False)


def _checks(size: int | None, extra: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """(query, distance) pairs where a window or chunk of ``size`` shows: near its edges, far in and near the start."""
    out = []
    for q in (_FAR + 7, 3 * _FAR // 2 + 1, *extra):
        edges = () if size is None else (size - 1, size, size + 1, q % size, q % size + 1)
        out += [(q, d) for d in {0, 1, 2, *edges} if 0 <= d <= q]
    return out


def _probe_mask(*args: Any, mask_function: Any = None, **kwargs: Any) -> MaskRule:
    return read_mask_rule(mask_function)


def _probe_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                     **kwargs: Any) -> tuple[Tensor, None]:
    module.__dict__["_fpdt_probed"] = (attention_mask, kwargs.get("sliding_window"))
    # [b, h, s, d] -> [b, s, h, d] of the value's width, as attention functions return it
    return torch.zeros_like(value[:, :1]).expand(-1, query.shape[1], -1, -1).transpose(1, 2).contiguous(), None


AttentionInterface.register(_PROBE, _probe_attention)
AttentionMaskInterface.register(_PROBE, _probe_mask)


def attention_chunk_size(module: nn.Module) -> int | None:
    """The attention chunk size the mask probe read from attention layer ``module``'s transformers mask (chunked
    attention, which its call does not carry), or ``None``."""
    return module.__dict__.get(_CHUNK)


def check_mask_windows(model: PreTrainedModel, layers: list[tuple[str, nn.Module]]) -> bool:
    """Refuse a layer whose transformers mask has a window (or another pattern) its attention call does not pass;
    record on each chunked layer its attention chunk size (:func:`attention_chunk_size`).

    Runs ``model`` on two tokens with the probe implementation, then restores its implementation. On the meta
    device (a model whose weights load later) the two tokens come with an all-ones ``attention_mask``, so
    transformers does not look at their values to detect packed sequences; a forward that still needs values
    there (a mixture of experts routes by them) is not probed, and the caller probes again once the weights
    are in. Nothing is checked where transformers makes no mask for the probe.

    Returns:
        Whether the probe ran (``False``: on the meta device, a forward that needs real tensors).

    Raises:
        NotImplementedError: a layer whose mask and call disagree, naming both.
    """
    param = next(model.parameters(), None)
    if param is None:
        return True
    on_meta = param.device.type == "meta"
    inputs = {"input_ids": torch.zeros(1, 2, dtype=torch.long, device=param.device)}
    if on_meta:
        inputs["attention_mask"] = torch.ones(1, 2, dtype=torch.long, device=param.device)
    before = model.config._attn_implementation
    model.set_attn_implementation(_PROBE)
    try:
        with torch.no_grad():
            model.base_model(**inputs, use_cache=False)
        probed = {name: m.__dict__.pop("_fpdt_probed", None) for name, m in layers}
    except (RuntimeError, NotImplementedError, AttributeError, TypeError, IndexError, ValueError) as error:
        for _, m in layers:
            m.__dict__.pop("_fpdt_probed", None)
        if on_meta and isinstance(error, (RuntimeError, NotImplementedError)):
            return False  # a value-dependent step on the meta device: probed once the weights are in
        if isinstance(error, Unsupported):
            raise  # a refusal of ours, raised inside the forward
        raise Unsupported(
            f"HFCausalLM: the mask probe could not run {type(model).__name__}'s base model on two tokens"
            f" ({described(error)}): its forward computes with transformers' attention mask outside the"
            " attention function (as a tensor: a sparse-attention indexer such as DeepSeek-V3.2's, a gate), or its"
            " mask depends on the inputs (image or token-type overlays). Under FPDT no mask is built, so whether each"
            " layer attends as the pipeline computes cannot be checked; this model is not supported."
        ) from error
    finally:
        model.set_attn_implementation(before)
    for name, m in layers:
        rule, window = probed[name] if probed[name] is not None else (None, None)
        m.__dict__.pop(_CHUNK, None)
        if not isinstance(rule, MaskRule) or not rule.causal:  # no mask made, or bidirectional (refused by is_causal)
            continue
        if rule.chunk is not None and window is None:  # chunked: no call carries it, the layer keeps it
            m.__dict__[_CHUNK] = rule.chunk
            continue
        if not rule.pattern or rule.window != window:
            mask = f"a sliding window of {rule.window}" if rule.pattern and rule.window else (
                f"chunked attention of {rule.chunk} tokens" if rule.chunk else "full causal attention"
                if rule.pattern else "a pattern that is neither a sliding window nor chunked attention")
            raise Unsupported(
                f"HFCausalLM: layer {name} ({type(m).__name__}): transformers' mask for this layer has {mask}, but"
                f" its attention call passes sliding_window={window}. Under FPDT no mask is built and the pipeline"
                " computes what the call says, so it would attend differently from the model; this family is not"
                " supported (a layer that passes its window to the attention call is)."
            )
    return True

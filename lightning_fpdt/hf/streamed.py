"""A transformers decoder layer that streams chunk by chunk (:mod:`lightning_fpdt.layers.streaming`).

The layer's own forward runs on one chunk of tokens at a time: its hidden states and every per-token argument
(position ids, the rotary ``(cos, sin)``, ``cache_position``) are sliced to the chunk, and its attention call
(:func:`lightning_fpdt.hf.attention.fpdt_attention_forward`) finds the layer's
:class:`~lightning_fpdt.layers.layer_stream.LayerStream` on the attention module and answers from it: this chunk's
q/k/v, projected by the layer itself (q/k norms, partial rotary, gates and all), against the keys and values of every
earlier chunk. No whole-sequence q/k/v exists.

A layer streams when everything it computes besides its one attention layer is per token. Refused to streaming
(recomputed whole instead, exactly as before): layers without attention or with another token mixer (a gated
delta-net, Mamba-2, a short convolution: they carry state along the sequence), Llama-4's temperature-tuned NoPE
layers (their query scale reads positions outside the chunk), layers whose router statistics feed an auxiliary
loss, layers with extra inputs that need a gradient or a mapping they write into (Gemma-4), and layers given a
tensor argument that is not per token in a recognisable layout. :func:`stream_refusal` says which.

The final norm is left to the tiled loss (:func:`norm_skipped`), as the own models leave theirs
(:func:`lightning_fpdt.models.contract.output_norm`), so the loss keeps one hidden vector per token, not three.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from lightning_fpdt.hf.attention import is_attention_layer, receives_keywords
from lightning_fpdt.hf.temperature import tunes_temperature
from lightning_fpdt.layers.layer_stream import LayerStream, streaming_into


def stream_refusal(layer: nn.Module, hidden: Tensor, args: tuple, kwargs: dict[str, Any], extras: bool,
                   router_loss: bool) -> str | None:
    """Why decoder layer ``layer`` cannot stream on ``hidden`` ``[batch, s_local, hidden]`` with these arguments, or
    ``None`` when it can (module docstring). ``extras``: it has tensor arguments needing a gradient;
    ``router_loss``: its router statistics feed an auxiliary loss."""
    attention = [m for m in layer.modules() if is_attention_layer(m)]
    if len(attention) != 1:
        return f"it holds {len(attention)} attention layers"
    if any(receives_keywords(m) and not is_attention_layer(m) for m in layer.modules()):
        return "it holds a token mixer besides attention"
    if tunes_temperature(attention[0]):
        return "its queries are scaled by position (Llama-4 temperature tuning)"
    if router_loss:
        return "its router statistics feed the auxiliary loss"
    if extras:
        return "it takes extra inputs that need a gradient"
    b, s = hidden.shape[:2]
    for value in [*args, *kwargs.values()]:
        if isinstance(value, MutableMapping):
            return "it takes a mapping it may write into"
        if not _sliceable(value, b, s):
            return "it takes a tensor argument that is not per token"
    return None


def _token_dim(t: Tensor, b: int, s: int) -> int | None:
    """The dimension of a per-token tensor ``t`` that runs over the ``s`` local tokens: 1 for ``[b, s, ...]``, 0 for
    ``[s]`` (``cache_position``); ``None`` for any other layout."""
    if t.dim() >= 2 and tuple(t.shape[:2]) == (b, s):
        return 1
    return 0 if t.dim() == 1 and t.shape[0] == s else None


def _sliceable(value: Any, b: int, s: int) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_sliceable(v, b, s) for v in value)
    # a tensor sized by the local length in another layout cannot be cut
    return not isinstance(value, Tensor) or _token_dim(value, b, s) is not None or s not in value.shape


def _slice(value: Any, b: int, s: int, lo: int, hi: int) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_slice(v, b, s, lo, hi) for v in value)
    dim = _token_dim(value, b, s) if isinstance(value, Tensor) else None
    return value if dim is None else value.narrow(dim, lo, hi - lo)


def chunked_layer(layer: nn.Module, run: Callable[..., Any], hidden: Tensor, args: tuple, kwargs: dict[str, Any]
                  ) -> Callable[[Tensor, int, int, LayerStream], Tensor]:
    """``run_chunk`` of :func:`~lightning_fpdt.layers.streaming.streamed_layer_call` for a transformers decoder layer:
    ``run(x_c, *args, **kwargs)`` with every per-token argument cut to the chunk, its attention layer answering from
    the stream."""
    attention = [m for m in layer.modules() if is_attention_layer(m)]
    b, s = hidden.shape[:2]

    def run_chunk(x: Tensor, lo: int, hi: int, stream: LayerStream) -> Tensor:
        with streaming_into(attention, stream):
            out = run(x, *_slice(args, b, s, lo, hi), **{k: _slice(v, b, s, lo, hi) for k, v in kwargs.items()})
        if not isinstance(out, Tensor):
            raise NotImplementedError(
                f"HFCausalLM: decoder layer {type(layer).__name__} returns {type(out).__name__}, not one"
                " hidden-states tensor; a streamed layer supports layers that return their hidden states only."
            )
        return out

    return run_chunk


def final_norm(model: nn.Module) -> nn.Module | None:
    """The base model's final norm (``model.base_model.norm``, transformers' name for it), or ``None``."""
    norm = getattr(getattr(model, "base_model", model), "norm", None)
    return norm if isinstance(norm, nn.Module) else None


@contextmanager
def norm_skipped(norm: nn.Module) -> Iterator[list[Tensor]]:
    """Inside the block ``norm`` returns its input unchanged (the tiled loss applies it tile by tile:
    :func:`~lightning_fpdt.layers.loss.tiled_cross_entropy_sum`); the list receives each input it was given, so the
    caller can check that the model's output is that input, untouched by anything after the norm."""
    seen: list[Tensor] = []

    def passthrough(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        seen.append(x)
        return x

    own = norm.__dict__.get("forward")
    norm.forward = passthrough
    try:
        yield seen
    finally:
        if own is None:
            del norm.forward
        else:
            norm.forward = own

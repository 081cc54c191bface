"""A transformers decoder layer that streams chunk by chunk (:mod:`lightning_fpdt.layers.streaming`).

The layer's own forward runs on one chunk of tokens at a time: its hidden states and every per-token argument
(position ids, the rotary ``(cos, sin)``, ``cache_position``) are sliced to the chunk, and its attention call
(:func:`lightning_fpdt.hf.attention.fpdt_attention_forward`) finds the layer's
:class:`~lightning_fpdt.layers.layer_stream.LayerStream` on the attention module and answers from it: this chunk's
q/k/v, projected by the layer itself (q/k norms, partial rotary, gates and all), against the keys and values of every
earlier chunk. No whole-sequence q/k/v exists.

A layer streams when everything it computes besides its one attention layer is per token, or a sum over tokens:
- a router whose statistics feed the auxiliary loss weighs the chunk's tokens (``RouterLoss.tokens``), and the
  chunk's probability sums leave the streamed call as its token sums, which carry the loss's gradient back to each
  chunk's router in backward (:func:`chunked_layer`);
- an extra input with a gradient (Gemma-4's per-layer input, ``[batch, s_local, width]``) is cut to the chunk and
  gets its gradient chunk by chunk;
- Llama-4's temperature-tuned NoPE layers scale each chunk's queries at the chunk's own tokens' positions
  (:func:`lightning_fpdt.hf.temperature.tuned_queries` reads the chunk's place from the stream);
- Gemma-4's ``shared_kv_states`` mapping is passed through untouched by layers that do not share keys and values.
A layer whose token mixers carry state along the sequence (a gated delta-net, Mamba-2, a short convolution) and that
holds no attention streams too, its mixers' state carried from chunk to chunk (:mod:`lightning_fpdt.layers.carried`).
Refused to streaming (recomputed whole instead, exactly as before) by :func:`stream_refusal`, naming why: layers with
attention and a token mixer side by side (Falcon-H1, Zamba2's hybrid layers), mixers running their family's own
forward, layers whose keys and values are shared with others (Gemma-4 ``num_kv_shared_layers``), and layers given a
mapping of unknown use or a tensor argument that is not per token in a recognisable layout.

The final norm is left to the tiled loss (:func:`norm_skipped`), as the own models leave theirs
(:func:`lightning_fpdt.models.contract.output_norm`), so the loss keeps one hidden vector per token, not three.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, NoReturn

from torch import Tensor, nn

from lightning_fpdt.errors import Unsupported
from lightning_fpdt.hf.attention import is_attention_layer, receives_keywords
from lightning_fpdt.hf.experts import ExpertsForward
from lightning_fpdt.hf.recurrent import SequenceParallelRecurrence
from lightning_fpdt.hf.recurrent_memory import mixer_memory
from lightning_fpdt.hf.router_loss import RouterLoss
from lightning_fpdt.hf.short_conv import SequenceParallelShortConv
from lightning_fpdt.layers.layer_stream import LayerStream, streaming_into


def stream_refusal(layer: nn.Module, hidden: Tensor, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why decoder layer ``layer`` cannot stream on ``hidden`` ``[batch, s_local, hidden]`` with these arguments, or
    ``None`` when it can (module docstring)."""
    refusal = layer_refusal(layer)
    if refusal is not None:
        return refusal
    b, s = hidden.shape[:2]
    for value in [*args, *kwargs.values()]:
        # a mapping only Gemma-4's key/value sharing writes into: known untouched where that is off
        if isinstance(value, MutableMapping) and not _known_sharing(layer):
            return "it takes a mapping it may write into"
        if not _sliceable(value, b, s):
            return "it takes a tensor argument that is not per token"
    return None


def _known_sharing(layer: nn.Module) -> bool:
    return any(hasattr(m, "store_full_length_kv") for m in layer.modules() if is_attention_layer(m))


def layer_refusal(layer: nn.Module) -> str | None:
    """Why decoder layer ``layer`` cannot stream whatever its arguments (what it holds), or ``None``: it holds one
    attention layer, or token mixers that carry their state from chunk to chunk
    (:mod:`lightning_fpdt.layers.carried`) and no attention."""
    attention = [m for m in layer.modules() if is_attention_layer(m)]
    mixers = token_mixers(layer)
    if mixers:
        kind = type(mixers[0]).__name__
        if attention:
            return (f"it holds attention and a {kind} token mixer both, whose backwards run their chunks in opposite"
                    " orders")
        unready = [m for m in mixers if not carries_state(m) and not _installed_with_weights(m)]
        if unready:
            return (f"it holds a {type(unready[0]).__name__} token mixer that runs as its family wrote it (not"
                    " sequence-parallel here), over the whole sequence")
        return None
    if len(attention) != 1:
        return f"it holds {len(attention)} attention layers"
    if shares_keys_and_values(attention[0]):
        return "its keys and values are shared with other layers (Gemma-4 num_kv_shared_layers)"
    return None


def token_mixers(layer: nn.Module) -> list[nn.Module]:
    """The modules of ``layer`` that mix tokens besides attention: a gated delta-net, a Mamba-2 mixer or a short
    convolution (sequence-parallel or not), or any other module that reads the FPDT keywords."""
    return [m for m in layer.modules() if not is_attention_layer(m)
            and (receives_keywords(m) or carries_state(m) or mixer_memory(m) is not None)]


def carries_state(module: nn.Module) -> bool:
    """Whether ``module`` runs a sequence-parallel forward that carries its state from chunk to chunk of a streamed
    layer (:class:`~lightning_fpdt.hf.recurrent.SequenceParallelRecurrence`,
    :class:`~lightning_fpdt.hf.short_conv.SequenceParallelShortConv`)."""
    return isinstance(module.__dict__.get("forward"), (SequenceParallelRecurrence, SequenceParallelShortConv))


def _installed_with_weights(module: nn.Module) -> bool:
    """A mixer on the meta device that gets its sequence-parallel forward once its weights are in (what the memory
    model sizes before they are)."""
    param = next(module.parameters(), None)
    memory = mixer_memory(module)
    return param is not None and param.device.type == "meta" and memory is not None and memory.chunked


def shares_keys_and_values(attention: nn.Module) -> bool:
    """Whether attention module ``attention`` attends with an earlier layer's keys and values, or leaves its own for
    a later layer that does (Gemma-4's ``is_kv_shared_layer``, and ``store_full_length_kv`` where
    ``num_kv_shared_layers`` is set: without it the last layer of each type stores them for nobody)."""
    if getattr(attention, "is_kv_shared_layer", False):
        return True
    readers = getattr(getattr(attention, "config", None), "num_kv_shared_layers", 0) or 0
    return bool(getattr(attention, "store_full_length_kv", False)) and readers > 0


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


def chunked_layer(layer: nn.Module, run: Callable[..., Any], hidden: Tensor, args: tuple, kwargs: dict[str, Any],
                  extra_keys: Sequence[int | str] = (), router_loss: RouterLoss | None = None, name: str = "layer"
                  ) -> Callable[..., Any]:
    """``run_chunk`` of :func:`~lightning_fpdt.layers.streaming.streamed_layer_call` for a transformers decoder layer:
    ``run(x_c, *args, **kwargs)`` with every per-token argument cut to the chunk, the arguments at ``extra_keys``
    (positions or keywords) replaced by the chunk's extra inputs, its attention layer answering from the stream.
    With ``router_loss``, the chunk's MoE blocks weigh the chunk's tokens and ``run_chunk`` returns ``(y_c, sums)``
    (:meth:`~lightning_fpdt.hf.router_loss.RouterLoss.chunk_sums`)."""
    attention = [m for m in layer.modules() if is_attention_layer(m)]
    answering = attention + [m for m in token_mixers(layer) if carries_state(m)]  # what reads the stream
    b, s = hidden.shape[:2]
    moe_calls = sum(isinstance(m.__dict__.get("forward"), ExpertsForward) for m in layer.modules())
    args = tuple(_Untouched(v, name) if isinstance(v, MutableMapping) else v for v in args)
    kwargs = {k: _Untouched(v, name) if isinstance(v, MutableMapping) else v for k, v in kwargs.items()}

    def run_chunk(x: Tensor, lo: int, hi: int, stream: LayerStream, *extras: Tensor) -> Any:
        call_args = list(_slice(args, b, s, lo, hi))
        call_kwargs = {k: _slice(v, b, s, lo, hi) for k, v in kwargs.items()}
        for key, extra in zip(extra_keys, extras):
            if isinstance(key, int):
                call_args[key] = extra
            else:
                call_kwargs[key] = extra
        with ExitStack() as scope:
            scope.enter_context(streaming_into(answering, stream))
            if router_loss is not None:
                scope.enter_context(router_loss.tokens(lo, hi))
                captured = scope.enter_context(router_loss.capture())
            out = run(x, *call_args, **call_kwargs)
        if not isinstance(out, Tensor):
            raise Unsupported(
                f"HFCausalLM: decoder layer {type(layer).__name__} returns {type(out).__name__}, not one"
                " hidden-states tensor; a streamed layer supports layers that return their hidden states only."
            )
        if router_loss is None:
            return out
        return out, router_loss.chunk_sums(captured, moe_calls, out)

    return run_chunk


class _Untouched(MutableMapping):
    """A mapping argument of a streamed layer (Gemma-4's ``shared_kv_states``) that no layer reads from: a chunk would
    read one chunk's tensors where the whole sequence's are meant (layers that share keys and values do not stream:
    :func:`layer_refusal`). What a layer leaves there for nobody (Gemma-4 without ``num_kv_shared_layers``) is
    dropped: one chunk's keys and values kept for no reader."""

    def __init__(self, mapping: MutableMapping, layer_name: str) -> None:
        self.mapping, self.layer_name = mapping, layer_name

    def _refuse(self, key: Any) -> NoReturn:
        raise Unsupported(
            f"HFCausalLM: streamed decoder layer model.{self.layer_name} reads {key!r} of a mapping it shares with"
            " other layers; a streamed layer runs one chunk of tokens at a time, so it would read one chunk's tensors"
            " (a layer that shares keys and values should not have streamed: please report this model)."
        )

    def __getitem__(self, key: Any) -> Any:
        self._refuse(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        pass  # every read is refused: nobody can miss it

    def __delitem__(self, key: Any) -> None:
        self._refuse(key)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.mapping)

    def __len__(self) -> int:
        return len(self.mapping)


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

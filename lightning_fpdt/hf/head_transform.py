"""The head's transform: whatever a transformers family's forward does to the logits after the output embedding,
found from its behaviour, so that the tiled loss (which computes logits from the hidden states and the output
embedding itself) applies it too.

Granite divides the logits by ``logits_scaling``, Cohere multiplies them by ``logit_scale``, Gemma-2 soft-caps them.
At construction the model's own forward runs on chosen logits (its base model and output embedding stood in for, so
no layer runs and no weight is read) in float64, and a per-logit function ``c * tanh(a * logits / c)`` is fitted to
what it returns (:func:`find_head_transform`); its constants are taken exactly from the config where they match one.
A head whose logits no such function reproduces is refused by name. :func:`stood_in` is the stand-in both this fit
and the router-loss probe (:mod:`lightning_fpdt.hf.router_loss`) run the model's forward with.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from lightning_fpdt.errors import FPDTError, Unsupported, described

# A forward that casts its logits to float32 (some families do) is reproduced to float32 rounding per logit;
# any real transform (a scale, a cap, a bias) differs by far more.
_TOLERANCE = 1e-6
_PROBE_TOKENS = 13  # logits of magnitude 1e-3 ... 1e3, one token per half decade
_SATURATED = 0.9  # logits above this fraction of a cap are too flat to invert the cap on


@dataclass(frozen=True)
class HeadTransform:
    """A per-logit function between the output embedding and a model's logits: ``logits * multiplier`` or
    ``logits / divisor``, then ``softcap * tanh(logits / softcap)``; all ``None``: the identity.

    Attributes:
        multiplier: the scale a family multiplies its logits by (Cohere's ``logit_scale``).
        divisor: the scale a family divides its logits by (Granite's ``logits_scaling``).
        softcap: the final-logit cap (Gemma-2's ``final_logit_softcapping``).
    """

    multiplier: float | None = None
    divisor: float | None = None
    softcap: float | None = None

    @property
    def is_identity(self) -> bool:
        """No transform: the loss may use the output embedding's weight directly."""
        return self.multiplier is None and self.divisor is None and self.softcap is None

    def __call__(self, logits: Tensor) -> Tensor:
        """``logits`` ``[..., vocab]`` transformed, in the family's own order of operations."""
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits


def head_name_of(model: PreTrainedModel) -> str:
    """The attribute path of ``model``'s output embedding.

    Raises:
        ValueError: the model has no output embedding module of its own.
    """
    head = model.get_output_embeddings()
    head_name = next((name for name, m in model.named_modules() if m is head and name), None)
    if head_name is None:
        raise FPDTError(f"HFCausalLM: {type(model).__name__} has no output embedding module of its own"
                        " (get_output_embeddings()), from which the loss computes the logits.")
    return head_name


def find_head_transform(model: PreTrainedModel) -> HeadTransform:
    """The per-logit transform ``model``'s forward applies after its output embedding, found by running
    the forward on chosen logits (float64, no layer runs).

    Raises:
        NotImplementedError: the forward's logits are no per-logit function of the output embedding's that
            the tiled loss can apply (naming the model class, the head module and the difference), or the
            model has parameters outside its base model and output embedding, which the loss never uses.
        ValueError: the model has no output embedding.
    """
    head = model.get_output_embeddings()
    head_name = head_name_of(model)
    where = f"{type(model).__name__}'s head model.{head_name} ({type(head).__name__})"
    _refuse_unused_parameters(model, head, where)
    raw = _probe_logits(model, head)
    try:
        logits, hidden, seen = _forward_on(model, head_name, raw)
    except Exception as error:  # any failure of the stood-in forward: refused, never guessed
        raise Unsupported(
            f"HFCausalLM: could not check {where}: {type(model).__name__}.forward failed on a stood-in base model"
            f" and output embedding ({described(error)}), so what it does to the logits after the"
            " output embedding is unknown and the loss could silently differ; this model is not supported."
        ) from error
    if not isinstance(logits, Tensor) or logits.shape != raw.shape:
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise Unsupported(
            f"HFCausalLM: {where}: {type(model).__name__}.forward returns logits {shape} for output-embedding"
            f" logits {tuple(raw.shape)}; the loss computes them per token from the output embedding, so it would"
            " silently differ from the model's own. This model is not supported."
        )
    transform = _fit(raw, logits.to(raw.dtype), _constants(model))
    # hidden states scaled before the output embedding: its logits scaled alike (it is linear), before the rest
    hidden_scale = _hidden_scale(model, head, hidden, seen, where)
    if transform is not None and hidden_scale != 1.0:
        transform = HeadTransform(hidden_scale * (transform.multiplier or 1.0), transform.divisor, transform.softcap)
    if transform is None:
        worst = ((logits - raw).abs() / raw.abs().clamp_min(1e-12)).max().item()
        raise Unsupported(
            f"HFCausalLM: {where} is followed in {type(model).__name__}.forward by a transform of the logits that"
            f" the FPDT loss cannot reproduce: its logits differ from the output embedding's by up to {worst:.3g}"
            " (relative), and no per-logit function (a scale, then a softcap c * tanh(logits / c)) matches them."
            " The loss, computed in token tiles from the hidden states and the output embedding, would silently"
            " differ from the model's own; this model is not supported."
        )
    return transform


def _refuse_unused_parameters(model: PreTrainedModel, head: nn.Module, where: str) -> None:
    used = {id(p) for p in model.base_model.parameters()} | {id(p) for p in head.parameters()}
    unused = [name for name, p in model.named_parameters() if id(p) not in used]
    if unused:
        raise Unsupported(
            f"HFCausalLM: {type(model).__name__} has parameters outside its base model and {where}"
            f" ({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}); the loss is computed from the base"
            " model's hidden states and the output embedding, so they would silently never be trained."
        )


def _probe_logits(model: PreTrainedModel, head: nn.Module) -> Tensor:
    """``[1, tokens, vocab]`` float64 logits, token ``t`` of magnitude ``10 ** (t / 2 - 3)``."""
    weight = getattr(head, "weight", None)
    vocab = weight.shape[0] if isinstance(weight, Tensor) else model.config.get_text_config().vocab_size
    device = weight.device if isinstance(weight, Tensor) and weight.device.type != "meta" else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    # on the CPU first (a meta default device sizes a model without weights; the probe needs values)
    magnitudes = torch.logspace(-3, 3, _PROBE_TOKENS, dtype=torch.float64, device="cpu")
    raw = torch.randn(_PROBE_TOKENS, vocab, generator=g, dtype=torch.float64, device="cpu") * magnitudes[:, None]
    return raw[None].to(device)


class _StoodInOutput(BaseModelOutputWithPast):
    """The stood-in base model's output: its hidden states, and ``None`` for whatever else a family's forward
    reads from it (router logits, auxiliary losses)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return None


class _StandIn(nn.Module):
    """An output embedding that returns the chosen logits, whatever the hidden states, keeping the hidden states
    it was given (``seen``)."""

    def __init__(self, logits: Tensor) -> None:
        super().__init__()
        self.logits = logits
        self.seen: Tensor | None = None

    def forward(self, hidden: Tensor) -> Tensor:
        self.seen = hidden
        return self.logits


@contextmanager
def stood_in(model: PreTrainedModel, head_name: str, logits: Tensor, **outputs: Any) -> Iterator[tuple[Tensor, Any]]:
    """``model``'s base model returns random hidden states (and ``outputs``, e.g. ``router_logits``) and its output
    embedding ``logits`` ``[batch, tokens, vocab]``, in training mode (dropout after the output embedding would
    show), until the block ends: the model's own forward runs on chosen values and no layer runs. Yields the hidden
    states and the stand-in output embedding (whose ``seen`` are the hidden states the forward gave it)."""
    base = model.base_model
    parent_name, _, attribute = head_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    head = getattr(parent, attribute)
    modes = [(m, m.training) for m in model.modules()]
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(*logits.shape[:2], model.config.get_text_config().hidden_size, generator=g,
                         dtype=logits.dtype, device="cpu").to(logits.device)  # on the CPU first: a meta default
    own_forward = base.__dict__.get("forward")
    stood_in_output = _StoodInOutput(last_hidden_state=hidden)
    for name, value in outputs.items():  # not dataclass fields of the output: plain attributes
        setattr(stood_in_output, name, value)
    base.forward = lambda *args, **kwargs: stood_in_output
    stand_in = _StandIn(logits)
    setattr(parent, attribute, stand_in)
    model.train()
    try:
        yield hidden, stand_in
    finally:
        setattr(parent, attribute, head)
        if own_forward is None:
            del base.forward
        else:
            base.forward = own_forward
        for m, training in modes:
            m.training = training


def _forward_on(model: PreTrainedModel, head_name: str, raw: Tensor) -> tuple[Any, Tensor, Tensor | None]:
    """The forward's logits on the stood-in model, the base model's hidden states and what the output embedding
    was given."""
    ids = torch.zeros(raw.shape[:2], dtype=torch.long, device=raw.device)
    with stood_in(model, head_name, raw) as (hidden, stand_in), torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits, hidden, stand_in.seen


def _hidden_scale(model: PreTrainedModel, head: nn.Module, hidden: Tensor, seen: Tensor | None,
                  where: str) -> float:
    """The scale ``a`` the forward multiplies the hidden states by before its output embedding (MiniCPM3 divides
    them by ``hidden_size / dim_model_base``): 1 when it gives them unchanged.

    Raises:
        NotImplementedError: hidden states changed otherwise than by one scale, or scaled before an output
            embedding with a bias (the scale would not carry over to the logits).
    """
    if seen is None or seen.shape != hidden.shape:
        shape = None if seen is None else tuple(seen.shape)
        raise Unsupported(
            f"HFCausalLM: {where} is given hidden states {shape} by {type(model).__name__}.forward where the base"
            f" model returns {tuple(hidden.shape)}; the loss applies the output embedding to every token's hidden"
            " state, so it would silently differ from the model's own. This model is not supported."
        )
    seen = seen.to(hidden.dtype)
    # seen on the meta device: computed by the model's own layers from the stood-in hidden states (a model read from
    # a directory is probed before its weights are): no scale of them that a value could show
    scale = None if seen.device != hidden.device else _scale(hidden, seen)
    if scale is None or not bool(((scale * hidden - seen).abs() <= _TOLERANCE * seen.abs() + 1e-300).all()):
        raise Unsupported(
            f"HFCausalLM: {type(model).__name__}.forward transforms the base model's hidden states before {where}"
            " otherwise than by one scale; the loss applies the output embedding to the hidden states themselves,"
            " so it would silently differ from the model's own. This model is not supported."
        )
    if _close(scale, 1.0):
        return 1.0
    if getattr(head, "bias", None) is not None:
        raise Unsupported(
            f"HFCausalLM: {type(model).__name__}.forward scales the hidden states by {scale:.6g} before {where},"
            " which has a bias, so the scale is no scale of the logits the loss could apply. This model is not"
            " supported."
        )
    return scale


def _constants(model: PreTrainedModel) -> list[float]:
    """Every number in the model's configs and on the model module: where a transform's constant comes from."""
    sources = [vars(model.config), vars(model.config.get_text_config()), vars(model)]
    found = {float(v) for source in sources for k, v in source.items()
             if not k.startswith("_") and isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0}
    return sorted(found)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _TOLERANCE * abs(b)


def _scale(raw: Tensor, logits: Tensor) -> float | None:
    """The least-squares ``a`` of ``logits = a * raw``, or ``None`` where ``raw`` carries no signal."""
    denominator = (raw * raw).sum().item()
    return None if denominator == 0 else (raw * logits).sum().item() / denominator


def _snapped(scale: float, constants: list[float]) -> HeadTransform:
    """``scale`` as a multiplier or divisor the config holds, when one matches (exact constants)."""
    if _close(scale, 1.0):
        return HeadTransform()
    for v in constants:
        if _close(v, scale):
            return HeadTransform(multiplier=v)
        if _close(1 / v, scale):
            return HeadTransform(divisor=v)
    return HeadTransform(multiplier=scale)


def _matches(transform: HeadTransform, raw: Tensor, logits: Tensor) -> bool:
    return bool(((transform(raw) - logits).abs() <= _TOLERANCE * logits.abs() + 1e-300).all())


def _fit(raw: Tensor, logits: Tensor, constants: list[float]) -> HeadTransform | None:
    """The :class:`HeadTransform` that maps ``raw`` onto ``logits`` logit by logit, or ``None``."""
    scale = _scale(raw, logits)
    if scale is not None and _matches(transform := _snapped(scale, constants), raw, logits):
        return transform
    top = logits.abs().max().item()
    # a cap c bounds every logit: c * tanh(u / c) is inverted on the logits it has not flattened
    for cap in [v for v in constants if v >= top * (1 - _TOLERANCE)] + [_cap_of(raw, logits)]:
        keep = logits.abs() < _SATURATED * cap
        scale = _scale(raw[keep], cap * torch.atanh(logits[keep] / cap)) if keep.any() else None
        if scale is None:
            continue
        scaled = _snapped(scale, constants)
        transform = HeadTransform(scaled.multiplier, scaled.divisor, cap)
        if _matches(transform, raw, logits):
            return transform
    return None


def _cap_of(raw: Tensor, logits: Tensor) -> float:
    """The ``c`` of ``c * tanh(raw / c)`` through the largest raw logit (bisection: increasing in ``c``)."""
    i = raw.abs().argmax()
    r, target = abs(raw.flatten()[i].item()), abs(logits.flatten()[i].item())
    low, high = math.log(max(target, 1e-300)), math.log(max(target, 1e-300)) + 30.0
    for _ in range(200):
        mid = (low + high) / 2
        c = math.exp(mid)
        low, high = (mid, high) if c * math.tanh(r / c) < target else (low, mid)
    return math.exp(high)

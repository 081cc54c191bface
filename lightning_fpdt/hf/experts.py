"""Mixture-of-experts decoder layers of transformers models under FPDT: the experts as transformers runs
them, and the router's auxiliary load-balancing loss over every token of the global batch.

The loss reproduced is transformers' ``load_balancing_loss_func`` (Switch Transformer, eqs. 4-6), which the
MoE causal LMs (Mixtral, Qwen3-MoE, OLMoE, gpt-oss) add to their loss as ``router_aux_loss_coef * aux`` when
``config.output_router_logits`` is set. Over the router calls of every layer and the tokens ``t`` it counts
(``attention_mask`` 1; every token without a mask):

    aux = E * sum_e (C_e / R) * (S_e / R)

with ``E`` experts, ``C_e`` the top-k assignments of tokens to expert ``e``, ``S_e`` the sum of the tokens'
router probabilities ``softmax(logits_t)_e`` and ``R`` the count of (layer, token) rows. ``C`` and ``R`` carry
no gradient, so ``aux`` is linear in the ``S`` of each rank: each rank sums its own tokens' statistics, one
all-reduce over the world adds them up (every sequence shard and every data-parallel sample: the batch one
process would see), and each rank back-propagates its share ``E * C . S_rank / R**2``.

What is kept: per layer, the ``[E]`` sums; the per-token probabilities ``[tokens, E]`` live only inside the
MoE block's call. The block's output carries them out of a recomputed call (the tiled MLP, a checkpointed
layer) as ``E`` extra columns, so their gradient reaches the router in the recomputation's backward.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.models.mixtral import modeling_mixtral

from lightning_fpdt.hf.feed_forward import feed_forward
from lightning_fpdt.tiling import mlp_tile_tokens, tiled_call

_MOE_CONFIG_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_MOE_CLASS_WORDS = ("moe", "expert", "router")
REFERENCE_LOSS = modeling_mixtral.load_balancing_loss_func  # the loss every supported family calls


def router_class(model: PreTrainedModel) -> tuple[type[nn.Module], int] | None:
    """``(router class, index of the logits in its output)`` as the model declares them for its
    ``router_logits`` output (transformers' ``_can_record_outputs``); ``None`` for a dense model."""
    recorder = getattr(type(model.base_model), "_can_record_outputs", None) or {}
    recorder = recorder.get("router_logits")
    target = getattr(recorder, "target_class", None)
    return None if target is None else (target, recorder.index)


def check_experts(model: PreTrainedModel, layers: list[tuple[str, nn.Module]]) -> None:
    """Refuse experts whose routing or auxiliary loss FPDT would not reproduce, naming the layer.

    Raises:
        NotImplementedError: experts without a declared router, a router outside the layer's ``mlp``, a
            family whose auxiliary loss is not transformers' ``load_balancing_loss_func``, router jitter noise.
    """
    found = router_class(model)
    name = type(model).__name__
    for layer_name, layer in layers:
        moe = [f"{sub}: {type(m).__name__}" for sub, m in layer.named_modules()
               if any(word in type(m).__name__.lower() for word in _MOE_CLASS_WORDS)]
        routers = [] if found is None else [m for m in layer.modules() if isinstance(m, found[0])]
        if moe and found is None:
            raise NotImplementedError(
                f"HFCausalLM: layer model.{layer_name} ({type(layer).__name__}) has experts ({moe[0]}) but {name}"
                " declares no router_logits output, so its routing and auxiliary loss cannot be reproduced. Mixtral,"
                " Qwen3-MoE, OLMoE and gpt-oss are supported (docs/hf-support.md#mixture-of-experts)."
            )
        mlp = feed_forward(layer)
        if len(routers) > 1 or (routers and (mlp is None or not any(m is routers[0] for m in mlp.modules()))):
            raise NotImplementedError(
                f"HFCausalLM: layer model.{layer_name} has {len(routers)} router(s) of {name} outside one 'mlp' module;"
                " the auxiliary loss is collected from one router inside each decoder layer's mlp."
            )
    if found is None:
        config = model.config.get_text_config()
        experts = {k: getattr(config, k) for k in _MOE_CONFIG_FIELDS if getattr(config, k, None)}
        if experts:
            settings = ", ".join(f"{k}={v}" for k, v in experts.items())
            raise NotImplementedError(
                f"HFCausalLM: {name}'s config has experts ({settings}) but the model declares no router; its"
                " routing cannot be reproduced. Mixtral, Qwen3-MoE, OLMoE and gpt-oss are supported."
            )
        return
    if not any(isinstance(m, found[0]) for m in model.modules()):  # a dense form of an MoE family: no router runs
        return
    loss = getattr(inspect.getmodule(type(model)), "load_balancing_loss_func", None)
    # a family that adds no auxiliary loss (LFM2-MoE, Kimi Linear) routes per token: nothing to reproduce
    top_k = model.config.get_text_config().num_experts_per_tok
    if adds_router_loss(model) and (loss is None or not _same_loss(loss, top_k)):
        raise NotImplementedError(
            f"HFCausalLM: {name}'s auxiliary router loss is not transformers' load_balancing_loss_func as Mixtral,"
            " Qwen3-MoE, OLMoE and gpt-oss compute it, so it cannot be reproduced under sequence parallelism."
        )
    jitter = getattr(model.config.get_text_config(), "router_jitter_noise", 0.0) or 0.0
    if jitter > 0:
        raise NotImplementedError(
            f"HFCausalLM: {name} has router_jitter_noise={jitter}: the router multiplies its input by fresh random"
            " noise in training, which a recomputation (tiled MLP, checkpointing) would draw again and one"
            " process would draw for other tokens. Set router_jitter_noise=0.0."
        )


def adds_router_loss(model: PreTrainedModel) -> bool:
    """Whether the family's causal LM adds an auxiliary router loss to its loss: its forward computes an
    ``aux_loss`` (Mixtral, Qwen3-MoE, ...); LFM2-MoE's and Kimi Linear's do not. Where the source cannot be read,
    assumed to (and then checked like one)."""
    try:
        return "aux_loss" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return True


def _same_loss(loss: Any, top_k: int) -> bool:
    """Whether ``loss`` computes what :data:`REFERENCE_LOSS` does on random router logits (a probe: the family's
    own function, whatever its source)."""
    g = torch.Generator().manual_seed(0)
    e = top_k + 3
    logits = tuple(torch.randn(6, e, generator=g) for _ in range(2))  # two layers, 2 x 3 tokens
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return all(torch.allclose(torch.as_tensor(loss(logits, e, top_k, m), dtype=torch.float64),
                              torch.as_tensor(REFERENCE_LOSS(logits, e, top_k, m), dtype=torch.float64), rtol=1e-5)
               for m in (None, mask))


class RouterLoss:
    """The router statistics of one forward pass, and this rank's share of the auxiliary loss.

    :meth:`start` opens a pass (from the batch's token weights); every router call adds its top-k counts and
    row count (:meth:`probabilities`, once per token: not when recomputed in backward) and its weighted
    probabilities (:meth:`push`); :meth:`add_to` closes the pass.

    Args:
        num_experts: ``E``.
        top_k: experts per token.
        coefficient: ``router_aux_loss_coef``.
    """

    def __init__(self, num_experts: int, top_k: int, coefficient: float) -> None:
        self.num_experts, self.top_k, self.coefficient = num_experts, top_k, coefficient
        self.open = False
        self.weights: Tensor | None = None
        self.counts: list[Tensor] = []  # [E] per router call, no gradient
        self.rows: list[Tensor] = []
        self.sums: list[Tensor] = []  # [E] per MoE block call, with gradient
        self._captures: list[list[Tensor]] = []

    def start(self, weights: Tensor) -> None:
        """Open a forward pass whose tokens count with ``weights`` ``[batch, s_local]`` (1 counts, 0 is padding)."""
        self.open, self.weights = True, weights
        self.counts, self.rows, self.sums = [], [], []

    def token_weights(self, x: Tensor) -> Tensor:
        """The weights ``[batch, seq]`` of the tokens of ``x`` ``[batch, seq, hidden]``, in its dtype."""
        if self.weights is None:
            return x.new_ones(x.shape[:2])
        if tuple(self.weights.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"HFCausalLM: an MoE block received hidden states {tuple(x.shape)} but the batch's token weights are"
                f" {tuple(self.weights.shape)}; keep 'attention_mask' in the strategy's sequence_keys."
            )
        return self.weights.to(x.dtype)

    def probabilities(self, logits: Tensor, weights: Tensor) -> Tensor:
        """``softmax(logits) * weights`` ``[rows, E]`` of one router call (``logits`` ``[rows, E]``, ``weights``
        ``[rows]``), counting its top-k assignments while the pass is open."""
        probs = torch.softmax(logits, dim=-1)  # the logits' dtype, as load_balancing_loss_func
        if self.open:
            acc = torch.promote_types(logits.dtype, torch.float32)
            chosen = torch.topk(probs.detach(), self.top_k, dim=-1).indices  # [rows, top_k]
            w = weights.detach().to(acc)
            counts = torch.zeros(self.num_experts, dtype=acc, device=logits.device)
            self.counts.append(counts.scatter_add_(0, chosen.reshape(-1), w.repeat_interleave(self.top_k)))
            self.rows.append(w.sum())
        return probs * weights.unsqueeze(-1)

    def push(self, probs: Tensor) -> None:
        """The weighted probabilities ``[batch, seq, E]`` of one MoE block call: to the innermost
        :meth:`capture`, or summed over tokens into the pass."""
        if self._captures:
            self._captures[-1].append(probs)
        elif self.open:
            self.sums.append(probs.sum(dim=(0, 1), dtype=torch.promote_types(probs.dtype, torch.float32)))

    @contextmanager
    def capture(self) -> Iterator[list[Tensor]]:
        """Collect the :meth:`push` es of a recomputed call, to be returned from it (see the module docstring)."""
        captured: list[Tensor] = []
        self._captures.append(captured)
        try:
            yield captured
        finally:
            self._captures.pop()

    def add_to(self, loss_sum: Tensor, num_tokens: Tensor) -> Tensor:
        """``loss_sum + coefficient * aux_rank * N`` (``N``: the world's count of target tokens), which
        :func:`~lightning_fpdt.loss.token_weighted_loss` turns into the mean cross-entropy plus
        ``coefficient * aux``; closes the pass. A collective over the world when it has more than one rank."""
        self.open = False
        if not self.sums:  # no router ran (no pass opened): nothing to add
            return loss_sum
        acc = self.sums[0].dtype
        local = torch.stack(self.sums).sum(0)  # [E]
        counts, rows = torch.stack(self.counts).sum(0), torch.stack(self.rows).sum()
        totals = torch.cat([counts, local.detach(), rows.reshape(1), num_tokens.to(acc).reshape(1)])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
        e = self.num_experts
        counts, rows, tokens = totals[:e], totals[2 * e].clamp_min(1), totals[2 * e + 1].clamp_min(1)
        aux_rank = e * (counts * local).sum() / rows**2
        self.sums = []
        return loss_sum + (self.coefficient * tokens) * aux_rank.to(loss_sum.dtype)


def router_loss_for(model: PreTrainedModel) -> RouterLoss | None:
    """The :class:`RouterLoss` of a model whose loss includes the auxiliary loss (``output_router_logits``)."""
    config = model.config.get_text_config()
    if router_class(model) is None or not getattr(config, "output_router_logits", False) or not adds_router_loss(model):
        return None
    experts = next(getattr(config, k) for k in _MOE_CONFIG_FIELDS if getattr(config, k, None))
    return RouterLoss(experts, config.num_experts_per_tok, float(config.router_aux_loss_coef))


class RouterTap:
    """A router instance's ``forward``: its class's, keeping the latest logits for the MoE block's call."""

    def __init__(self, router: nn.Module, index: int) -> None:
        self.router, self.index, self.latest = router, index, None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = type(self.router).forward(self.router, *args, **kwargs)
        self.latest = out[self.index]
        return out


class ExpertsForward:
    """An MoE block instance's ``forward``: its class's forward, in sequence tiles (each recomputed in
    backward) unless ``num_tiles`` is 1, returning the router's weighted probabilities beside its output.

    The block is a per-token function (each token's top-k experts and weights depend on that token alone),
    so tiles give the same output. A block that returns ``(hidden, router_scores)`` (gpt-oss, whose layer
    discards the scores) returns ``(hidden, None)``.
    """

    def __init__(self, block: nn.Module, tap: RouterTap, num_tiles: int | None, loss: RouterLoss | None) -> None:
        self.block, self.tap, self.num_tiles, self.loss = block, tap, num_tiles, loss
        self.returns_tuple = False

    def _run(self, x: Tensor) -> Tensor:
        out = type(self.block).forward(self.block, x.contiguous())  # a tile is a strided slice; blocks .view() it
        self.returns_tuple = isinstance(out, tuple)
        return out[0] if self.returns_tuple else out

    def _with_probabilities(self, x: Tensor, weights: Tensor) -> Tensor:  # [b, tile, h], [b, tile] -> [b, tile, h+E]
        assert self.loss is not None
        out = self._run(x)
        probs = self.loss.probabilities(self.tap.latest, weights.reshape(-1))  # rows = b * tile
        self.tap.latest = None
        return torch.cat([out, probs.reshape(*out.shape[:-1], -1).to(out.dtype)], dim=-1)

    def __call__(self, x: Tensor) -> Any:
        h = x.shape[-1]
        tiles = dict(num_tiles=self.num_tiles, params=self.block, tile_tokens=mlp_tile_tokens(h), name="mlp_tile")
        if self.loss is None:
            out = tiled_call(self._run, x, **tiles)
        else:
            y = tiled_call(self._with_probabilities, x, self.loss.token_weights(x), **tiles)
            out = y[..., :h]
            self.loss.push(y[..., h:])
        return (out, None) if self.returns_tuple else out


def install_experts(model: PreTrainedModel, layers: list[tuple[str, nn.Module]], mlp_tiles: int | None,
                    loss: RouterLoss | None) -> list[nn.Module]:
    """Give each decoder layer's MoE ``mlp`` an :class:`ExpertsForward` and its router a :class:`RouterTap`;
    returns the MoE blocks."""
    found = router_class(model)
    if found is None:
        return []
    blocks = []
    for _, layer in layers:
        mlp = feed_forward(layer)
        routers = [] if mlp is None else [m for m in mlp.modules() if isinstance(m, found[0])]
        if routers:
            tap = RouterTap(routers[0], found[1])
            routers[0].forward = tap
            mlp.forward = ExpertsForward(mlp, tap, mlp_tiles, loss)
            blocks.append(mlp)
    return blocks


def split_captured(y: Tensor, hidden: int, widths: list[int], loss: RouterLoss) -> Tensor:
    """The hidden states ``y[..., :hidden]`` of a recomputed layer's output, pushing the probabilities that
    follow them (``widths`` columns each) to ``loss``."""
    start = hidden
    for width in widths:
        loss.push(y[..., start:start + width])
        start += width
    return y[..., :hidden]


"""Mixture-of-experts decoder layers of transformers models under FPDT: the experts as the family runs them.

Routing as the 2026 families release it is a function of each token alone: softmax or sigmoid scores, a
score-correction bias, group-limited top-k, shared experts beside the routed ones, dense first layers
(``first_k_dense_replace``, ``mlp_only_layers``), a router inside the layer's feed-forward (Mixtral,
DeepSeek-V3), beside it (Granite's ``block_sparse_moe``) or called by the decoder layer itself (Gemma-4). So
a sequence shard routes its tokens as one process would, and nothing of it is refused: the experts run as the
family wrote them. Refused: router jitter (fresh noise per call, drawn again by a recomputation) and experts
whose family declares no router (their routing cannot be checked).

Where the experts sit in a block of their own inside the decoder layer (:func:`moe_block`), that block runs
through :class:`ExpertsForward`: in sequence tiles like a dense MLP, and carrying its router's probabilities
out of recomputed calls for the auxiliary loss (:mod:`lightning_fpdt.hf.router_loss`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_fpdt.errors import Unsupported
from lightning_fpdt.hf.attention import is_attention_layer
from lightning_fpdt.hf.feed_forward import feed_forward
from lightning_fpdt.hf.router_loss import EXPERT_COUNT_FIELDS, RouterLoss
from lightning_fpdt.offload.tiling import mlp_tile_tokens, tiled_call

_MOE_CLASS_WORDS = ("moe", "expert", "router")


def router_class(model: PreTrainedModel) -> tuple[type[nn.Module], int] | None:
    """``(router class, index of the logits in its output)`` as the model declares them for its
    ``router_logits`` output (transformers' ``_can_record_outputs``); ``None`` for a dense model."""
    recorder = getattr(type(model.base_model), "_can_record_outputs", None) or {}
    recorder = recorder.get("router_logits")
    target = getattr(recorder, "target_class", None)
    return None if target is None else (target, recorder.index)


def routers_of(model: PreTrainedModel) -> list[nn.Module]:
    """Every router module of ``model`` (instances of the class its ``router_logits`` output records)."""
    found = router_class(model)
    return [] if found is None else [m for m in model.modules() if isinstance(m, found[0])]


def _takes_hidden_only(block: nn.Module) -> bool:
    """Whether ``block``'s forward takes the hidden states alone (ZAYA's also takes the router state the layer
    before left, and returns the next: not a per-token function to tile)."""
    params = [p for p in inspect.signature(type(block).forward).parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return len(params) == 2  # self and the hidden states


def moe_block(layer: nn.Module, router: nn.Module) -> nn.Module | None:
    """The block of decoder layer ``layer`` that holds ``router`` and its experts and is called on the hidden
    states as a per-token function: the layer's feed-forward (:func:`~lightning_fpdt.hf.feed_forward.feed_forward`)
    or a child named for its experts (Granite's ``block_sparse_moe``); ``None`` where the layer calls the router
    itself (Gemma-4) or it sits inside the attention (JetMoE's mixture of attention heads)."""
    ffn = feed_forward(layer)
    if ffn is not None and any(m is router for m in ffn.modules()):
        return ffn if _takes_hidden_only(ffn) else None
    for child in layer.children():
        if child is router or not any(m is router for m in child.modules()):
            continue
        named = any(word in type(child).__name__.lower() for word in ("moe", "expert", "sparse"))
        separate = named and _takes_hidden_only(child) and not any(is_attention_layer(m) for m in child.modules())
        return child if separate else None
    return None


def check_experts(model: PreTrainedModel, layers: list[tuple[str, nn.Module]]) -> None:
    """Refuse experts whose routing FPDT would not reproduce, naming the layer or the setting.

    Raises:
        NotImplementedError: experts whose family declares no router (``router_logits`` output), router jitter.
    """
    found = router_class(model)
    name = type(model).__name__
    for layer_name, layer in layers:
        moe = [f"{sub}: {type(m).__name__}" for sub, m in layer.named_modules()
               if any(word in type(m).__name__.lower() for word in _MOE_CLASS_WORDS)]
        if moe and found is None:
            raise Unsupported(
                f"HFCausalLM: layer model.{layer_name} ({type(layer).__name__}) has experts ({moe[0]}) but {name}"
                " declares no router_logits output, so its routing cannot be checked to be per token"
                " (docs/hf-support.md#mixture-of-experts)."
            )
    if found is None:
        config = model.config.get_text_config()
        experts = {k: getattr(config, k) for k in EXPERT_COUNT_FIELDS if getattr(config, k, None)}
        if experts and any(word in type(m).__name__.lower() for m in model.modules() for word in ("expert", "moe")):
            settings = ", ".join(f"{k}={v}" for k, v in experts.items())
            raise Unsupported(
                f"HFCausalLM: {name}'s config has experts ({settings}) but the model declares no router; its"
                " routing cannot be checked to be per token (docs/hf-support.md#mixture-of-experts)."
            )
        return
    config = model.config.get_text_config()
    if not routers_of(model):
        return
    drawn = "which a recomputation (tiled MLP, checkpointing) would draw again and one process would draw for other"
    for field in ("router_jitter_noise", "input_jitter_noise"):
        jitter = getattr(config, field, 0.0) or 0.0
        if jitter <= 0:
            continue
        if field == "router_jitter_noise" and hasattr(config, "input_jitter_noise"):  # PhiMoE's sparse mixer
            raise Unsupported(
                f"HFCausalLM: {name} has router_jitter_noise={jitter}, the threshold of its sparse mixer: in training"
                f" it samples each token's experts at random among those within 2 x {jitter} of the best (Gumbel"
                f" noise) and draws a step of Heun's method for the gradient, {drawn} tokens. Set"
                " router_jitter_noise=0.0: each token then takes its best experts, exactly."
            )
        raise Unsupported(
            f"HFCausalLM: {name} has {field}={jitter}: the mixture-of-experts block multiplies the router's input by"
            f" fresh random noise in training, {drawn} tokens. Set {field}=0.0."
        )


class RouterTap:
    """A router instance's ``forward``: its class's, keeping the latest logits for the MoE block's call."""

    def __init__(self, router: nn.Module, index: int) -> None:
        self.router, self.index, self.latest = router, index, None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = type(self.router).forward(self.router, *args, **kwargs)
        # a router that returns its logits alone (DBRX's) is recorded whole, as transformers' OutputRecorder does
        self.latest = out[self.index] if isinstance(out, tuple) else out
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
        out = out[0] if self.returns_tuple else out
        # a block may return its tokens flattened, [batch * seq, hidden] (Llama-4's): the tile's shape again
        return out.reshape(*x.shape[:-1], out.shape[-1])

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


def expert_blocks(model: PreTrainedModel, layers: list[tuple[str, nn.Module]]) -> list[tuple[nn.Module, nn.Module]]:
    """``(block, router)`` of every :func:`moe_block` that holds exactly one router, in layer order."""
    found = router_class(model)
    if found is None:
        return []
    pairs = []
    for _, layer in layers:
        for router in [m for m in layer.modules() if isinstance(m, found[0])]:
            block = moe_block(layer, router)
            if block is not None and sum(isinstance(m, found[0]) for m in block.modules()) == 1:
                pairs.append((block, router))
    return pairs


def install_experts(model: PreTrainedModel, layers: list[tuple[str, nn.Module]], mlp_tiles: int | None,
                    loss: RouterLoss | None) -> list[nn.Module]:
    """Give each :func:`expert_blocks` block an :class:`ExpertsForward` and its router a :class:`RouterTap`;
    returns the blocks."""
    found = router_class(model)
    blocks = []
    for block, router in expert_blocks(model, layers):
        assert found is not None
        tap = RouterTap(router, found[1])
        router.forward = tap
        block.forward = ExpertsForward(block, tap, mlp_tiles, loss)
        blocks.append(block)
    return blocks

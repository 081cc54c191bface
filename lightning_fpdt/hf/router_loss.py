"""The router's auxiliary load-balancing loss of a mixture of experts, over every token of the global batch.

Whether a family's loss holds one, and which, is read from the family's own forward (:func:`router_loss_for`):
its base model is stood in for, returning chosen router logits, and the loss it returns is compared for two
draws of them. A forward whose loss does not move adds nothing (DeepSeek-V3, GLM-4.5-MoE, Gemma-4, Llama-4,
LFM2-MoE as released, or any family with ``output_router_logits=False``): nothing to reproduce. One that moves
by ``router_aux_loss_coef`` times the change of

    aux = E * sum_e (C_e / R) * (S_e / R)

(transformers' ``load_balancing_loss_func``, Switch Transformer eqs. 4-6, which Mixtral, Qwen3-MoE, OLMoE,
gpt-oss and Granite-MoE add) is reproduced here; any other is refused by name. Over the router calls of every
layer and the tokens ``t`` it counts (``attention_mask`` 1; every token without a mask): ``E`` experts, ``C_e``
the top-k assignments of tokens to expert ``e``, ``S_e`` the sum of the tokens' router probabilities
``softmax(logits_t)_e`` and ``R`` the count of (layer, token) rows. ``C`` and ``R`` carry no gradient, so
``aux`` is linear in the ``S`` of each rank: each rank sums its own tokens' statistics, one all-reduce over the
world adds them up (every sequence shard and every data-parallel sample: the batch one process would see), and
each rank back-propagates its share ``E * C . S_rank / R**2``.

What is kept: per layer, the ``[E]`` sums; the per-token probabilities ``[tokens, E]`` live only inside the
MoE block's call. The block's output carries them out of a recomputed call (the tiled MLP, a checkpointed
layer) as ``E`` extra columns, so their gradient reaches the router in the recomputation's backward
(:class:`~lightning_fpdt.hf.experts.ExpertsForward`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_fpdt.errors import FPDTError, Unsupported, described
from lightning_fpdt.hf.head_transform import head_name_of, stood_in

# The family's loss against the formula on probe logits: float32 steps inside a family's loss function move it by
# ~1e-7 relative; another form of the loss (another normalisation, a sequence-level term) by far more.
_FORM_TOLERANCE = 1e-5
_PROBE_BATCH, _PROBE_TOKENS = 2, 5


def load_balancing_aux(logits: tuple[Tensor, ...], num_experts: int, top_k: int, weights: Tensor | None) -> Tensor:
    """``aux`` of the module docstring in one process: ``logits`` ``[batch * seq, E]`` per router layer,
    ``weights`` ``[batch, seq]`` (1 counts, 0 is padding; ``None``: every token)."""
    rows = torch.cat(logits)  # [layers * batch * seq, E]
    w = torch.ones(rows.shape[0], dtype=rows.dtype, device=rows.device) if weights is None else \
        weights.reshape(-1).to(rows.dtype).repeat(len(logits))
    probs = torch.softmax(rows, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    counts = torch.zeros(num_experts, dtype=rows.dtype, device=rows.device)
    counts.scatter_add_(0, chosen.reshape(-1), w.repeat_interleave(top_k))
    return num_experts * (counts * (probs * w[:, None]).sum(0)).sum() / w.sum() ** 2


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
        self._window: tuple[int, int] | None = None  # the tokens of a streamed chunk (tokens())

    def start(self, weights: Tensor) -> None:
        """Open a forward pass whose tokens count with ``weights`` ``[batch, s_local]`` (1 counts, 0 is padding)."""
        self.open, self.weights = True, weights
        self.counts, self.rows, self.sums = [], [], []

    def token_weights(self, x: Tensor) -> Tensor:
        """The weights ``[batch, seq]`` of the tokens of ``x`` ``[batch, seq, hidden]``, in its dtype."""
        if self.weights is None:
            return x.new_ones(x.shape[:2])
        weights = self.weights if self._window is None else self.weights[:, self._window[0]:self._window[1]]
        if tuple(weights.shape) != tuple(x.shape[:2]):
            raise FPDTError(
                f"HFCausalLM: an MoE block received hidden states {tuple(x.shape)} but the batch's token weights are"
                f" {tuple(weights.shape)}; keep 'attention_mask' in the strategy's sequence_keys."
            )
        return weights.to(x.dtype)

    @contextmanager
    def tokens(self, lo: int, hi: int) -> Iterator[None]:
        """Inside the block, MoE blocks run on the local tokens ``lo:hi`` only (a streamed layer's chunk)."""
        before, self._window = self._window, (lo, hi)
        try:
            yield
        finally:
            self._window = before

    def chunk_sums(self, captured: list[Tensor], num_calls: int, like: Tensor) -> Tensor:
        """``[num_calls, E]``: the token sums of a streamed chunk's :meth:`capture` d probabilities ``[b, n, E]``
        each (zero rows for a layer without an MoE block, ``num_calls`` 0; on ``like``'s device)."""
        if len(captured) != num_calls:
            raise RuntimeError(f"HFCausalLM: a streamed layer's chunk ran {len(captured)} MoE block calls, its layer"
                               f" has {num_calls}")
        if not captured:
            return torch.zeros(0, self.num_experts, device=like.device)
        return torch.stack([p.sum(dim=(0, 1), dtype=torch.promote_types(p.dtype, torch.float32)) for p in captured])

    def add_sums(self, sums: Tensor) -> None:
        """A streamed layer's token sums ``[calls, E]`` (:meth:`chunk_sums`, summed over its chunks), into the pass
        as :meth:`push` puts a block call's."""
        if self._captures:
            raise RuntimeError("HFCausalLM: a streamed layer ran inside a recomputed call that collects router"
                               " probabilities")
        if self.open:
            self.sums.extend(sums.unbind(0))

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
        :func:`~lightning_fpdt.layers.loss.token_weighted_loss` turns into the mean cross-entropy plus
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


def split_captured(y: Tensor, hidden: int, widths: list[int], loss: RouterLoss) -> Tensor:
    """The hidden states ``y[..., :hidden]`` of a recomputed layer's output, pushing the probabilities that
    follow them (``widths`` columns each) to ``loss``."""
    start = hidden
    for width in widths:
        loss.push(y[..., start:start + width])
        start += width
    return y[..., :hidden]



def config_number(config: object, names: tuple[str, ...], kinds: tuple[type, ...] = (int,)) -> int | float | None:
    """The first of the config fields ``names`` that holds a number of ``kinds`` (an int unless asked; families name
    expert counts differently), in the config or its feed-forward sub-config (DBRX's ``ffn_config``)."""
    for where in (config, getattr(config, "ffn_config", None)):
        found = next((v for k in names if isinstance(v := getattr(where, k, None), kinds) and not isinstance(v, bool)),
                     None)
        if found is not None:
            return found
    return None


EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "top_k_experts", "moe_topk", "moe_k", "moe_top_k")
COEFFICIENT_FIELDS = ("router_aux_loss_coef", "moe_loss_weight")  # DBRX: ffn_config.moe_loss_weight


def router_loss_for(model: PreTrainedModel, routers: list[nn.Module], wrapped: list[nn.Module]) -> RouterLoss | None:
    """The :class:`RouterLoss` of a model whose own forward adds an auxiliary router loss, or ``None`` when it adds
    none, found from the forward's behaviour (the module docstring).

    Args:
        model: the transformers causal LM.
        routers: every router module of the model (the class its ``router_logits`` output records).
        wrapped: the routers inside an MoE block that :func:`~lightning_fpdt.hf.experts.install_experts` runs
            (the statistics are collected there).

    Raises:
        NotImplementedError: a forward whose loss follows the router logits otherwise than ``router_aux_loss_coef``
            times the load-balancing loss (naming both changes), or a router outside a block that can collect its
            statistics (naming it).
    """
    if not routers:
        return None
    name = type(model).__name__
    config = model.config.get_text_config()
    experts, top_k = config_number(config, EXPERT_COUNT_FIELDS), config_number(config, TOP_K_FIELDS)
    g = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    shape = (_PROBE_BATCH, _PROBE_TOKENS)
    ids = torch.randint(0, vocab, shape, generator=g, device="cpu")  # on the CPU: a meta default device sizes
    # each next token far ahead in its logits: a cross-entropy of 0, so the loss (float32 in most families) is the
    # auxiliary term alone, to float32's relative precision
    raw = torch.zeros(*shape, vocab, dtype=torch.float64, device="cpu")
    raw[:, :-1].scatter_(-1, ids[:, 1:, None], 1e4)
    mask = torch.ones(shape, dtype=torch.long, device="cpu")
    mask[1, -2:] = 0  # padding: the family's loss counts only the tokens its mask holds
    width = experts or top_k or 2
    draws = [tuple(torch.randn(shape[0] * shape[1], width, generator=g, dtype=torch.float64, device="cpu")
                   for _ in routers)
             for _ in range(2)]
    try:
        losses = []
        for router_logits in draws:
            with stood_in(model, head_name_of(model), raw, router_logits=router_logits), torch.no_grad():
                out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
            losses.append(out.loss.to(torch.float64))
    except Exception as error:  # the forward could not run on stood-in router logits: its loss is unknown
        raise Unsupported(
            f"HFCausalLM: could not check whether {name}'s loss adds an auxiliary router loss: its forward failed on"
            f" stood-in router logits [{shape[0] * shape[1]}, {width}] x {len(routers)} routers"
            f" ({described(error)}); set output_router_logits=False if the family's config has it, or"
            " this model is not supported."
        ) from error
    moved = (losses[0] - losses[1]).item()
    if moved == 0.0:
        return None
    coefficient = float(config_number(config, COEFFICIENT_FIELDS, (int, float)) or 0.0)
    expected = None if experts is None or top_k is None else coefficient * (
        load_balancing_aux(draws[0], experts, top_k, mask) - load_balancing_aux(draws[1], experts, top_k, mask)).item()
    if expected is None or abs(moved - expected) > _FORM_TOLERANCE * abs(expected):
        raise Unsupported(
            f"HFCausalLM: {name}'s forward adds an auxiliary router loss that is not router_aux_loss_coef x the"
            f" load-balancing loss of Mixtral and Qwen3-MoE: on two draws of stood-in router logits its loss moves by"
            f" {moved:.6g}, where router_aux_loss_coef={coefficient} x load_balancing_loss_func (experts={experts},"
            f" top_k={top_k}) moves by {expected if expected is None else format(expected, '.6g')}. FPDT cannot"
            " reproduce it over sequence shards; set output_router_logits=False to train without it."
        )
    outside = [r for r in routers if not any(r is w for w in wrapped)]
    if outside:
        where = next(n for n, m in model.named_modules() if m is outside[0])
        raise Unsupported(
            f"HFCausalLM: {name}'s router model.{where} ({type(outside[0]).__name__}) is called outside a"
            " mixture-of-experts block of its decoder layer's feed-forward (by the layer itself or inside its"
            " attention), so its share of the auxiliary loss cannot be collected through a recomputed layer. Set"
            " output_router_logits=False to train without the auxiliary loss."
        )
    return RouterLoss(experts, top_k, coefficient)

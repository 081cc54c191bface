"""Never silently wrong: what a family's own forward does that the FPDT path would not reproduce is reproduced
(the context delivered, the head's logit transform applied) or refused before any optimizer step.

StableLM's decoder layers call their attention without the forward's keywords: the context is delivered on
the attention layers (in the forward and in the checkpointed recomputation) and StableLM trains exactly.
Granite divides its logits by ``logits_scaling`` after the output embedding: the transform is found from the
model's forward and applied in the tiled loss, and Granite trains exactly. Both against plain transformers in
one process, with the oracle of ``tests/hf/test_hf_causal_lm.py`` (float64, sdpa, loss and every gradient within
1e-10). Families that cannot be reproduced (an attention that computes itself or calls the registered
function with another module and no keywords; a head whose logits are no per-logit function of the output
embedding's) are refused with the guard's message.
"""

from __future__ import annotations

import copy
import re
import types
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import (
    CohereConfig,
    Gemma2Config,
    GraniteConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    StableLmConfig,
)
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.cohere.modeling_cohere import CohereLayerNorm
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb, repeat_kv

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.hf.attention import _DELIVERED
from lightning_fpdt.hf.head_transform import HeadTransform
from lightning_fpdt.models import HFCausalLM
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext
from lightning_fpdt.testing import run_on_ranks
from tests.helpers import TokenDataset, assert_same_step, dataloader
from tests.hf.test_hf_causal_lm import (
    SEQ,
    SIZES,
    VOCAB,
    Case,
    Packed,
    _fit,
    _max_error,
    _mean_ce,
    _plain,
    _redraw,
    each_sample_alone,
    gemma_norms_in_float64,  # noqa: F401 (an autouse fixture: Gemma's norms in float64 here too)
    one_process_step,
)

GQA = dict(SIZES, num_key_value_heads=1)
FAMILIES = {
    # its decoder layers drop the keywords; partial rotary, q/k layer norms and qkv biases on, so nothing hides
    "stablelm": lambda: StableLmConfig(partial_rotary_factor=0.5, qk_layernorm=True, use_qkv_bias=True, **GQA),
    # its head divides the logits; its other multipliers on too
    "granite": lambda: GraniteConfig(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                                     attention_multiplier=0.2, **GQA),
}
CASES = [  # (case, packed batches)
    (Case("stablelm", sp=2, chunk_size=8, kv_heads=1, offload="emulate"), False),
    # recomputed decoder layers: the delivery must reach the attention in backward too, documents included
    (Case("stablelm", sp=2, chunk_size=8, kv_heads=1, offload="emulate", stack=True), True),
    (Case("granite", sp=2, chunk_size=8, kv_heads=1), False),
    (Case("granite", sp=2, chunk_size=8, kv_heads=1, offload="emulate", stack=True), False),  # transform in tiles
]


def _module(family: str, stack: bool, seed: int) -> HFCausalLM:
    tiles = dict(mlp_tiles=3, loss_tiles=5) if stack else dict(mlp_tiles=1, loss_tiles=1)
    module = HFCausalLM(FAMILIES[family](), learning_rate=1e-3, warmup_steps=1, **tiles)
    _redraw(module.model, seed)
    return module


@pytest.mark.distributed
@pytest.mark.parametrize(("case", "packed"), CASES, ids=[c.name + ("-packed" if p else "") for c, p in CASES])
def test_fit_step_equals_plain_transformers(case: Case, packed: bool, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    module = _module(case.family, case.stack, fresh_seed)
    ref = _plain(module)
    data = Packed(fresh_seed) if packed else TokenDataset(2, SEQ, VOCAB, fresh_seed)
    results = _fit(module, data, case, tmp_path)
    samples = data.documents() if packed else [(data.ids[i:i + 1], data.labels[i:i + 1]) for i in range(len(data))]
    ref_loss, ref_grads = _mean_ce(ref, samples)
    label = f"{'packed ' if packed else ''}{case.name} seed={fresh_seed}"
    print(f"{label}: max rel. error {_max_error(results, ref_loss, ref_grads):.2e}")
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=label)
    if case.stack:  # each decoder layer was checkpointed, so its attention ran again in backward
        assert all(r["layer_input_bytes"] > 0 for r in results)


# ---- the context: delivered where the keywords do not arrive, refused where it cannot be ---------------------


class SelfComputedAttention(LlamaAttention):
    """Computes its attention itself: the registered attention function is never called."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        q, k, v = self._qkv(hidden_states, position_embeddings)
        k, v = repeat_kv(k, self.num_key_value_groups), repeat_kv(v, self.num_key_value_groups)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)  # [b, h, s, d]
        return self.o_proj(out.transpose(1, 2).flatten(2)), None

    def _qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        shape = (*x.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return (*apply_rotary_pos_emb(q, k, *rope), v)


class ForeignModuleAttention(SelfComputedAttention):
    """Calls the registered function, but with a stand-in for the layer and none of the forward's keywords."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        q, k, v = self._qkv(hidden_states, position_embeddings)
        attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, _ = attention(types.SimpleNamespace(is_causal=True), q, k, v, None, scaling=self.scaling)
        return self.o_proj(out.flatten(2)), None


def _with_attention(cls: type[nn.Module], layer: int = 1) -> HFCausalLM:
    model = LlamaForCausalLM(LlamaConfig(**dict(SIZES, num_key_value_heads=2)))
    model.model.layers[layer].self_attn.__class__ = cls
    return HFCausalLM(model, mlp_tiles=1, loss_tiles=1)


GUARD = (r"attention layer model\.model\.layers\.1\.self_attn \({cls}\) of LlamaForCausalLM ran without the FPDT"
         r" context \({features}; 1 of 2 layers\): its attention does not call the attention function")


@pytest.mark.parametrize("cls", [SelfComputedAttention, ForeignModuleAttention], ids=lambda c: c.__name__)
def test_an_attention_the_context_cannot_reach_is_refused_when_it_matters(cls: type[nn.Module], fresh_seed) -> None:
    torch.manual_seed(fresh_seed)
    module = _with_attention(cls)
    data = TokenDataset(2, SEQ, VOCAB, fresh_seed)
    module.loss_terms(data.full_batch())  # one process, unbound, one document per sample: nothing to miss
    packed = Packed(fresh_seed)
    batch = {"input_ids": packed.ids, "position_ids": packed.pos}
    with pytest.raises(NotImplementedError, match=GUARD.format(cls=cls.__name__, features="packed documents")):
        module.loss_terms(batch)
    module.bind_sequence_parallel(SequenceParallelContext(chunk_size=8, attention_backend="math"))
    features = r"FPDT chunks \(chunk_size=8\)"
    with pytest.raises(NotImplementedError, match=GUARD.format(cls=cls.__name__, features=features)):
        module.loss_terms(data.full_batch())


class StepMarker(L.Callback):
    """Leaves a file for each rank that reaches an optimizer step."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        (Path(self.out_dir) / f"step{trainer.global_rank}").touch()


def _guard_on_rank(rank: int, world: int, seed: int, cls: type[nn.Module]) -> str:
    """This rank's error when its shard of a batch runs through a model whose layer 1 is ``cls``."""
    torch.manual_seed(seed)
    module = _with_attention(cls)
    try:
        module.bind_sequence_parallel(SequenceParallelContext(group=dist.group.WORLD, chunk_size=8,
                                                              attention_backend="math"))
        batch = shard_batch(TokenDataset(2, SEQ, VOCAB, seed).full_batch(), world, rank, chunk_size=8)
        module.loss_terms(batch)
    except NotImplementedError as error:
        return str(error)
    return "no error"


# a layer computing its own attention mixes tokens outside the pipeline: refused when bound (hf/mixing.py); one
# that calls the registered function without the forward's keywords is position-wise to that probe, and is
# refused when it runs without the context (hf/guards.py)
GUARDS = {
    SelfComputedAttention: r"HFCausalLM: layer model\.model\.layers\.1: model\.model\.layers\.1\.self_attn"
                           r" \(SelfComputedAttention\) mixes tokens outside attention.*sequence_parallel_size=2",
    ForeignModuleAttention: GUARD.format(cls="ForeignModuleAttention",
                                         features=r"sequence parallelism over 2 ranks, FPDT chunks"
                                                  r" \(chunk_size=8\)"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("cls", list(GUARDS), ids=lambda c: c.__name__)
def test_an_attention_without_the_context_is_refused_on_every_rank_before_any_optimizer_step(
        tmp_path, fresh_seed, cls: type[nn.Module]) -> None:
    guard = GUARDS[cls]
    for rank, error in enumerate(run_on_ranks(_guard_on_rank, 2, fresh_seed, cls)):
        assert re.search(guard, error), f"rank {rank}: {error}"
    torch.manual_seed(fresh_seed)
    module = _with_attention(cls)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[StepMarker(str(tmp_path))],
                        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size=8, attention_backend="math",
                                              start_method="fork"))
    with pytest.raises(Exception, match=guard):
        trainer.fit(module, dataloader(TokenDataset(2, SEQ, VOCAB, fresh_seed), 2))
    assert not list(tmp_path.glob("step*"))  # no rank reached an optimizer step


def test_the_delivery_ends_with_the_call(fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    module = HFCausalLM(FAMILIES["stablelm"](), mlp_tiles=1, loss_tiles=1)
    module.bind_sequence_parallel(SequenceParallelContext(chunk_size=8, attention_backend="math"))
    module.loss_terms(TokenDataset(2, SEQ, VOCAB, fresh_seed).full_batch())
    assert sorted(module.records.by_layer) == [0, 1]  # both layers ran with the context, which only the delivery brings
    assert not any(_DELIVERED in m.__dict__ for m in module.modules())


# ---- the head: each family's transform applied in the tiles, the unreproducible refused ----------------------


class ScaledCappedLM(LlamaForCausalLM):
    """Scales its logits by a config field, then caps them with a constant that is in no config."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.logits = 7.5 * torch.tanh(out.logits * self.config.head_scale / 7.5)
        return out


class SoftmaxHeadLM(LlamaForCausalLM):
    """Returns probabilities over the vocabulary: not a per-logit function."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits.softmax(-1)
        return out


class PositionBiasLM(LlamaForCausalLM):
    """Adds a bias that grows with the position: not the same function at every token."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits + 0.01 * torch.arange(out.logits.shape[1], dtype=out.logits.dtype)[:, None]
        return out


class LearntScaleLM(LlamaForCausalLM):
    """Multiplies its logits by a learnt parameter that is neither in the base model nor in the head."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.logit_gain = nn.Parameter(torch.ones(()))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.logit_gain
        return out


class ShiftedHiddenLM(LlamaForCausalLM):
    """Adds a constant to the hidden states before the output embedding: no scale of them."""

    def forward(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        kwargs.pop("labels", None)
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden + 0.5))


LLAMA = dict(SIZES, num_key_value_heads=2)
HEADS = {  # family -> (model, the transform expected)
    "llama": (lambda: LlamaForCausalLM(LlamaConfig(**LLAMA)), HeadTransform()),
    "granite": (lambda: FAMILIES["granite"](), HeadTransform(divisor=4.0)),
    "cohere": (lambda: CohereConfig(logit_scale=0.125, **LLAMA), HeadTransform(multiplier=0.125)),
    "gemma2": (lambda: Gemma2Config(head_dim=8, final_logit_softcapping=3.0, attn_logit_softcapping=None,
                                    layer_types=["full_attention"] * 2, **LLAMA), HeadTransform(softcap=3.0)),
    "scaled-capped": (lambda: ScaledCappedLM(LlamaConfig(head_scale=0.75, **LLAMA)),
                      HeadTransform(multiplier=0.75, softcap=7.5)),
}


def _cohere_norm_in_input_dtype(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    centred = x - x.mean(-1, keepdim=True)
    return self.weight * centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


@pytest.mark.parametrize("loss_tiles", [1, 3])
@pytest.mark.parametrize("family", list(HEADS))
def test_the_head_transform_is_found_and_the_loss_equals_the_models_own(family: str, loss_tiles: int,
                                                                       monkeypatch, fresh_seed: int) -> None:
    # Cohere's LayerNorm multiplies by its weight in float32: its weight gradient, a float32 sum over tokens,
    # moves by ~1e-8 with any other grouping of the tokens (a property of the model): its maths in float64 here
    monkeypatch.setattr(CohereLayerNorm, "forward", _cohere_norm_in_input_dtype)
    torch.manual_seed(fresh_seed)
    build, expected = HEADS[family]
    module = HFCausalLM(build(), mlp_tiles=1, loss_tiles=loss_tiles).double()
    found = module.head_transform
    assert (found.multiplier, found.divisor) == (expected.multiplier, expected.divisor), found
    assert (found.softcap is None) == (expected.softcap is None), found
    if expected.softcap is not None:  # a cap in no config is fitted: to float64 rounding
        assert abs(found.softcap - expected.softcap) <= 1e-12 * expected.softcap, found
    _redraw(module.model, fresh_seed)
    ref = copy.deepcopy(module.model)  # the model's own forward, its logits transformed as the family does
    data = TokenDataset(2, SEQ, VOCAB, fresh_seed)
    result = one_process_step(module, data)
    ref_loss, ref_grads = each_sample_alone(ref, data)
    assert_same_step([result], ref_loss, ref_grads, tol=1e-10, label=f"{family} tiles={loss_tiles} seed={fresh_seed}")


REFUSED_HEADS = {
    "softmax": (SoftmaxHeadLM, r"SoftmaxHeadLM's head model\.lm_head \(Linear\) is followed in SoftmaxHeadLM\.forward"
                               r" by a transform of the logits that the FPDT loss cannot reproduce: its logits differ"
                               r" from the output embedding's by up to [\d.e+]+ \(relative\)"),
    "position bias": (PositionBiasLM, r"PositionBiasLM's head model\.lm_head \(Linear\) is followed in"
                                      r" PositionBiasLM\.forward by a transform .* no per-logit function"),
    "shifted hidden": (ShiftedHiddenLM, r"ShiftedHiddenLM\.forward transforms the base model's hidden states before"
                                        r" ShiftedHiddenLM's head model\.lm_head \(Linear\) otherwise than by one"
                                        r" scale"),
    "learnt scale": (LearntScaleLM, r"LearntScaleLM has parameters outside its base model and LearntScaleLM's head"
                                    r" model\.lm_head \(Linear\) \(logit_gain\); .* would silently never be trained"),
}


@pytest.mark.parametrize("case", list(REFUSED_HEADS))
def test_a_head_the_loss_cannot_reproduce_is_refused_at_construction(case: str) -> None:
    cls, message = REFUSED_HEADS[case]
    with pytest.raises(NotImplementedError, match=message):
        HFCausalLM(cls(LlamaConfig(**LLAMA)))


def _fit_one_step(module: HFCausalLM, seed: int) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size=8, attention_backend="math",
                                              start_method="fork"))
    trainer.fit(module, dataloader(TokenDataset(2, SEQ, VOCAB, seed), 2))
    return trainer


@pytest.mark.distributed
def test_a_trainable_parameter_the_forward_never_uses_is_refused_before_the_optimizer_step(fresh_seed: int) -> None:
    """A tower the forward never calls (Fuyu's and Phi-4-multimodal's vision and audio towers in text-only training)
    leaves its DDP bucket unreduced: every rank would step with its own gradients (~1 off against one process).
    Refused after the backward, before the optimizer step, naming the parameters; frozen, the model trains."""
    torch.manual_seed(fresh_seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    model.model.vision_tower = nn.Linear(8, 8)  # inside the base model, never called
    module = HFCausalLM(model)
    with pytest.raises(Exception, match=r"FPDTStrategy: 2 trainable parameter\(s\) got no gradient in step 0"
                                        r" \(model\.model\.vision_tower\.weight, model\.model\.vision_tower\.bias\):"
                                        r" the forward does not use them.*requires_grad_\(False\)"):
        _fit_one_step(module, fresh_seed)
    module.model.model.vision_tower.requires_grad_(False)
    assert _fit_one_step(module, fresh_seed).state.finished  # the step ran on both ranks, nothing raised

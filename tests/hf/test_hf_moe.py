"""Mixture-of-experts transformers models trained under FPDT equal plain transformers in one process on the
whole batch, the router's auxiliary load-balancing loss included where the family's forward adds one.

Families: Mixtral, Qwen3-MoE, OLMoE (softmax routers in the layer's ``mlp``, the auxiliary loss added);
Granite-MoE (its router in ``block_sparse_moe``, beside the layer's feed-forward, the loss added); and the
DeepSeek-V3-style routers of GLM-4.5-MoE, EXAONE-MoE and dots1 (sigmoid scores, a score-correction bias,
group-limited top-k, shared experts, dense first layers), whose forwards add no auxiliary loss even with
``output_router_logits=True`` and a coefficient: none is added here either. Their routers compute in float32
whatever their input: in float64 here, on both sides (their own source, one dtype changed).

The oracle: the plain model (float64, sdpa) on the whole global batch in one forward with
``output_router_logits=True``; its loss is the float64 mean cross-entropy over the same targets plus
``router_aux_loss_coef * aux_loss``, which is what the family's own forward adds. Two float32 steps of the
families run in float64 on both sides (the forked workers inherit the patches): the routers' softmax
(``_router_in_input_dtype``, the families' maths without the cast) and ``load_balancing_loss_func`` (its own
source with float32 read as float64). Packed batches go to the oracle as they are (transformers finds the
documents from ``position_ids``), padded ones with their ``attention_mask``, so the auxiliary loss counts the
tokens one process counts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from transformers import (
    DbrxConfig,
    DeepseekV3Config,
    Dots1Config,
    ExaoneMoeConfig,
    Glm4MoeConfig,
    GraniteMoeConfig,
    MixtralConfig,
    OlmoeConfig,
    PhimoeConfig,
    PretrainedConfig,
    Qwen3MoeConfig,
)
from transformers.models.dbrx import modeling_dbrx
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.dots1 import modeling_dots1
from transformers.models.exaone_moe import modeling_exaone_moe
from transformers.models.glm4_moe import modeling_glm4_moe
from transformers.models.granitemoe import modeling_granitemoe
from transformers.models.mixtral import modeling_mixtral
from transformers.models.olmoe import modeling_olmoe
from transformers.models.qwen3_moe import modeling_qwen3_moe

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.models import HFCausalLM
from lightning_fpdt.parallel.binding import SequenceParallelContext
from tests.helpers import TokenDataset, assert_same_step, dataloader, float32_classes, in_float64, step_errors
from tests.hf.test_hf_causal_lm import HEADS, SEQ, SIZES, VOCAB, CaptureStack, Packed, _plain, _redraw

COEF = 0.3  # large enough that a wrong auxiliary loss or gradient shows far above 1e-10
MOE = dict(output_router_logits=True, router_aux_loss_coef=COEF, num_experts_per_tok=2)
FAMILIES = {
    "mixtral": lambda kv: MixtralConfig(num_local_experts=4, sliding_window=None, **MOE,
                                        **dict(SIZES, num_key_value_heads=kv)),
    # layer 1 dense (mlp_only_layers): the auxiliary loss counts the routed layer only
    "qwen3_moe": lambda kv: Qwen3MoeConfig(num_experts=4, moe_intermediate_size=16, head_dim=8, mlp_only_layers=[1],
                                           **MOE, **dict(SIZES, num_key_value_heads=kv)),
    "olmoe": lambda kv: OlmoeConfig(num_experts=4, **MOE, **dict(SIZES, num_key_value_heads=kv)),
    # the router in block_sparse_moe, beside the feed-forward; Granite's own load-balancing function
    "granitemoe": lambda kv: GraniteMoeConfig(num_local_experts=4, **MOE, **dict(SIZES, num_key_value_heads=kv)),
    # layer 0 dense (first_k_dense_replace), layer 1: sigmoid scores + correction bias, 2 groups of which 1 is
    # chosen, one shared expert; partial rotary
    "glm4_moe": lambda kv: Glm4MoeConfig(n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
                                         first_k_dense_replace=1, moe_intermediate_size=16, head_dim=8,
                                         routed_scaling_factor=2.5, **MOE, **dict(SIZES, num_key_value_heads=kv)),
    # sliding then full layer (window shorter than the sequence), dense first layer, grouped sigmoid routing
    "exaone_moe": lambda kv: ExaoneMoeConfig(num_experts=4, n_group=2, topk_group=1, moe_intermediate_size=16,
                                             head_dim=8, sliding_window=7, layer_types=["sliding_attention",
                                                                                        "full_attention"],
                                             mlp_layer_types=["dense", "sparse"], num_shared_experts=1, **MOE,
                                             **dict(SIZES, num_key_value_heads=kv)),
    # multi-head latent attention (v narrower than q and k, q LoRA) and the experts of layer 1: grouped sigmoid
    # routing with a correction bias, a shared expert; its k/v heads are all query heads (kv unused)
    "deepseek_v3": lambda kv: DeepseekV3Config(n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
                                               first_k_dense_replace=1, moe_intermediate_size=16, kv_lora_rank=8,
                                               q_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                                               **MOE, **dict(SIZES, num_key_value_heads=SIZES["num_attention_heads"])),
    # every layer routed, one shared expert, unnormalised top-k weights
    "dots1": lambda kv: Dots1Config(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=0,
                                    moe_intermediate_size=16, head_dim=8, **MOE, **dict(SIZES, num_key_value_heads=kv)),
}
MODULES = (modeling_mixtral, modeling_qwen3_moe, modeling_olmoe)
FLOAT32_MODULES = (modeling_dbrx, modeling_deepseek_v3, modeling_granitemoe, modeling_glm4_moe, modeling_exaone_moe,
                   modeling_dots1)
ADDS_AUX_LOSS = {"mixtral", "qwen3_moe", "olmoe", "granitemoe"}  # the others' forwards add none


def _config(family: str, kv_heads: int) -> PretrainedConfig:
    config = FAMILIES[family](kv_heads)
    config._experts_implementation = "eager"  # the per-expert loop; grouped_mm has no float64 kernel
    return config


def _router_in_input_dtype(self: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Mixtral's, Qwen3-MoE's and OLMoE's router without its float32 softmax."""
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, index


def _float64_source(function: Any) -> Any:
    """``function`` compiled again from its own source with every float32 read as float64."""
    source = inspect.getsource(function).replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    namespace: dict[str, Any] = {}
    exec(source, function.__globals__, namespace)  # transformers' own source, one dtype changed
    return namespace[function.__name__]


@pytest.fixture(autouse=True)
def routers_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in MODULES:
        router = next(c for n, c in vars(module).items() if n.endswith("TopKRouter"))
        monkeypatch.setattr(router, "forward", _router_in_input_dtype)
        monkeypatch.setattr(module, "load_balancing_loss_func", _float64_source(module.load_balancing_loss_func))
    for module in FLOAT32_MODULES:  # routers (and norms) that compute in float32 whatever their input
        for layer in float32_classes(module):
            monkeypatch.setattr(layer, "forward", in_float64(layer.forward))
        if hasattr(module, "load_balancing_loss_func"):
            monkeypatch.setattr(module, "load_balancing_loss_func", in_float64(module.load_balancing_loss_func))


class Padded(Dataset):
    """Right-padded samples with an ``attention_mask`` (the second one has 7 padding tokens)."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        self.mask = torch.ones_like(self.ids)
        self.mask[1, -7:] = 0

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "index": i}


Data = Literal["plain", "packed", "padded"]


def _dataset(data: Data, seed: int) -> Dataset:
    return {"plain": lambda: TokenDataset(2, SEQ, VOCAB, seed), "packed": lambda: Packed(seed),
            "padded": lambda: Padded(seed)}[data]()


def _oracle(module: HFCausalLM, data: Data, dataset: Any) -> tuple[torch.Tensor, dict]:
    """One process on the whole batch: mean cross-entropy + coefficient * aux, and the gradients."""
    ref = _plain(module)
    ids = dataset.ids
    kwargs: dict[str, Any] = {}
    targets = ids[:, 1:].clone()
    if data == "plain":
        targets = dataset.labels[:, 1:]
    elif data == "packed":
        kwargs["position_ids"] = dataset.pos
        targets[dataset.pos[:, 1:] == 0] = -100  # no target across a document boundary
    else:
        kwargs["attention_mask"] = dataset.mask
        targets[dataset.mask[:, 1:] == 0] = -100
    out = ref(input_ids=ids, output_router_logits=True, use_cache=False, **kwargs)
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="mean")
    loss = ce if out.aux_loss is None else ce + ref.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    return loss.detach(), {f"model.{n}": p.grad.detach().clone() for n, p in ref.named_parameters()}


@dataclass(frozen=True)
class Case:
    family: str
    data: Data
    sp: int = 2
    world: int = 2
    chunk_size: int | None = 8
    kv_heads: int = 1
    stack: bool = False  # tiled MLP and loss, checkpointing with offload emulation, FSDP2 per decoder layer

    @property
    def name(self) -> str:
        return "-".join([self.family, self.data, f"dp{self.world // self.sp}", f"sp{self.sp}", f"C{self.chunk_size}",
                         f"kv{self.kv_heads}"] + (["stack"] if self.stack else []))


CASES = [
    *[Case(f, d) for f in FAMILIES for d in ("plain", "packed")],  # sp=2, 4 chunks, kv heads below sp
    Case("olmoe", "padded", world=4),  # dp=2 x sp=2: the auxiliary loss over both data-parallel samples
    Case("mixtral", "plain", sp=4, world=4, chunk_size=16, kv_heads=2, stack=True),
    Case("glm4_moe", "packed", sp=4, world=4, chunk_size=16, kv_heads=2, stack=True),
    Case("granitemoe", "plain", stack=True),  # the router's probabilities out of checkpointed layers
]


def _fit(module: HFCausalLM, dataset: Dataset, case: Case, tmp_path) -> list[dict]:
    stack = dict(activation_checkpointing=True, offload_checkpoints="emulate", shard_parameters=True) if case.stack \
        else {}
    trainer = L.Trainer(
        accelerator="cpu", devices=case.world, precision="64-true", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[CaptureStack(str(tmp_path))],
        strategy=FPDTStrategy(sequence_parallel_size=case.sp, chunk_size=case.chunk_size, attention_backend="math",
                              start_method="fork", **stack),
    )
    trainer.fit(module, dataloader(dataset, len(dataset) * case.sp // case.world))
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(case.world)]


def _redraw_score_bias(model: torch.nn.Module, seed: int) -> None:
    """The routers' score-correction biases (buffers, zero at construction) drawn, so that they decide routing."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=g, dtype=torch.float64))


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_moe_fit_step_equals_plain_transformers(case: Case, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    tiles = dict(mlp_tiles=3, loss_tiles=5) if case.stack else dict(mlp_tiles=1, loss_tiles=1)
    module = HFCausalLM(_config(case.family, case.kv_heads), learning_rate=1e-3, warmup_steps=1, **tiles)
    _redraw(module.model, fresh_seed)
    _redraw_score_bias(module.model, fresh_seed)
    assert (module.router_loss is not None) == (case.family in ADDS_AUX_LOSS), module.router_loss
    dataset = _dataset(case.data, fresh_seed)
    ref_loss, ref_grads = _oracle(module, case.data, dataset)
    results = _fit(module, dataset, case, tmp_path)
    print(f"{case.name}: max rel. error {max(e for _, _, e in step_errors(results, ref_loss, ref_grads)):.2e}")
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"{case.name} seed={fresh_seed}")
    if case.world > case.sp:  # each data-parallel rank saw one sample, the loss covers both
        assert sorted({i for r in results for i in r["indices"]}) == [0, 1]
    if case.stack:
        assert all(r["sharded_layers"] == [True, True] and r["layer_input_bytes"] > 0 for r in results)


def test_aux_loss_changes_the_loss_and_tiles_and_checkpointing_keep_it(fresh_seed: int) -> None:
    """One process: the auxiliary loss is in the loss (without it the result is off), and the tiled MoE block
    and a checkpointed layer give the same loss and gradients as the plain forward."""
    torch.manual_seed(fresh_seed)
    dataset = TokenDataset(2, SEQ, VOCAB, fresh_seed)
    for tiles, checkpointing in [(1, False), (3, False), (3, True)]:
        module = HFCausalLM(_config("mixtral", 2), mlp_tiles=tiles, loss_tiles=1).double()
        _redraw(module.model, fresh_seed)
        if checkpointing:
            module.bind_sequence_parallel(SequenceParallelContext(chunk_size=8, attention_backend="math",
                                                                  activation_checkpointing=True))
        ref_loss, ref_grads = _oracle(module, "plain", dataset)
        loss_sum, count = module.loss_terms(dataset.full_batch())
        (loss_sum / count).backward()
        result = {"loss": (loss_sum / count).detach(), "grads": {n: p.grad for n, p in module.named_parameters()}}
        assert_same_step([result], ref_loss, ref_grads, tol=1e-10, label=f"tiles={tiles} ckpt={checkpointing}")
        module.router_loss.coefficient = 0.0  # the same step without the auxiliary loss is far off
        loss_sum, count = module.loss_terms(dataset.full_batch())
        assert abs((loss_sum / count).item() - ref_loss.item()) > 1e-3


def test_an_auxiliary_loss_of_another_form_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss is read from the family's forward, not from the function it calls: a forward whose auxiliary term is
    not the load-balancing loss (here its square) is refused with both changes of the loss, before any step."""
    balance = modeling_mixtral.load_balancing_loss_func
    monkeypatch.setattr(modeling_mixtral, "load_balancing_loss_func", lambda *args: balance(*args) ** 2)
    with pytest.raises(NotImplementedError, match=r"MixtralForCausalLM's forward adds an auxiliary router loss that"
                                                  r" is not router_aux_loss_coef x the load-balancing loss.*moves by"
                                                  r" [-0-9.e]+, where router_aux_loss_coef=0\.3 x load_balancing_loss_"
                                                  r"func \(experts=4, top_k=2\) moves by [-0-9.e]+\..*set"
                                                  r" output_router_logits=False"):
        HFCausalLM(_config("mixtral", 2))


def test_a_config_transformers_cannot_build_names_its_unset_sizes() -> None:
    """dots1's defaults leave its expert counts unset, and transformers' own constructor fails on them: the error
    names the config and the unset fields, not a raw ``TypeError`` from inside transformers."""
    sizes = dict(SIZES, num_key_value_heads=2, moe_intermediate_size=16)
    with pytest.raises(ValueError, match=r"transformers could not build Dots1Config's causal LM from this config"
                                         r" \(TypeError: .*\); the config leaves .*n_routed_experts.* unset"):
        HFCausalLM(Dots1Config(**sizes))


def test_a_constructor_error_of_several_lines_is_quoted_in_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's argument errors list every overload on lines of their own (torch 2.11 answers dots1's unset sizes so,
    where 2.13 says it in one line): the refusal quotes the error's first line and stays one line."""
    sizes = dict(SIZES, num_key_value_heads=2, moe_intermediate_size=16)
    overloads = "empty() received an invalid combination of arguments:\n * (tuple of ints size)\n * (int size)\n"

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise TypeError(overloads)

    monkeypatch.setattr(modeling_dots1.Dots1ForCausalLM, "__init__", refuse)
    with pytest.raises(ValueError) as refusal:
        HFCausalLM(Dots1Config(**sizes))
    message = str(refusal.value)
    assert "\n" not in message, message
    assert "(TypeError: empty() received an invalid combination of arguments); the config leaves" in message, message


def test_moe_refusals_name_the_feature() -> None:
    config = _config("mixtral", 2)
    config.router_jitter_noise = 0.1
    with pytest.raises(NotImplementedError, match=r"MixtralForCausalLM has router_jitter_noise=0\.1: the mixture-of-"
                                                  r"experts block multiplies the router's input by fresh random noise"):
        HFCausalLM(config)
    phimoe = PhimoeConfig(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.01,
                          input_jitter_noise=0.0, **dict(SIZES, num_key_value_heads=2))
    with pytest.raises(NotImplementedError, match=r"PhimoeForCausalLM has router_jitter_noise=0\.01, the threshold"
                                                  r" of its sparse mixer: in training it samples each token's"
                                                  r" experts at random"):
        HFCausalLM(phimoe)
    phimoe.router_jitter_noise, phimoe.input_jitter_noise = 0.0, 0.1  # PhiMoE's own input noise
    with pytest.raises(NotImplementedError, match=r"PhimoeForCausalLM has input_jitter_noise=0\.1: the mixture-of-"
                                                  r"experts block multiplies the router's input"):
        HFCausalLM(phimoe)
    dense = _config("mixtral", 2)
    dense.output_router_logits = False  # the family's own switch: no auxiliary loss in its loss, none here
    assert HFCausalLM(dense).router_loss is None



@pytest.mark.distributed
def test_dbrx_with_its_auxiliary_loss_equals_plain_transformers(tmp_path, fresh_seed: int) -> None:
    """DBRX keeps its expert count, top-k and loss weight in ``ffn_config`` and its router returns the logits alone:
    sp=2, 4 chunks, one KV head, with ``moe_loss_weight`` on, equal to its own forward's loss (the cross-entropy in
    float64) and every gradient. (Its router's logits used to be read as the first token's row.)"""
    torch.manual_seed(fresh_seed)
    config = DbrxConfig(d_model=SIZES["hidden_size"], n_heads=HEADS, n_layers=2, max_seq_len=64, vocab_size=VOCAB,
                        attn_config={"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
                        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2,
                                    "moe_loss_weight": COEF}, output_router_logits=True)
    config._experts_implementation = "eager"
    module = HFCausalLM(config, learning_rate=1e-3, warmup_steps=1, mlp_tiles=1, loss_tiles=1)
    _redraw(module.model, fresh_seed)
    assert (module.router_loss.num_experts, module.router_loss.top_k, module.router_loss.coefficient) == (4, 2, COEF)
    dataset = TokenDataset(2, SEQ, VOCAB, fresh_seed)
    ref = _plain(module)
    out = ref(input_ids=dataset.ids, output_router_logits=True, use_cache=False)
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), dataset.labels[:, 1:].flatten(), reduction="mean")
    ref_loss = ce + COEF * out.aux_loss
    ref_loss.backward()
    ref_grads = {f"model.{n}": p.grad.detach().clone() for n, p in ref.named_parameters()}
    results = _fit(module, dataset, Case("dbrx", "plain"), tmp_path)
    assert_same_step(results, ref_loss.detach(), ref_grads, tol=1e-10, label=f"dbrx seed={fresh_seed}")

"""Gated delta-net and Mamba-2 layers sequence-parallel and exact (lightning_fpdt/hf/recurrent.py): the family's own
forward with its convolution and its delta-rule or scan kernel bound to sequence-parallel ones, the recurrent state
carried chunk to chunk (across ranks by the all-to-all) and restarting at every document start.

One ``Trainer.fit`` step at sp=2 (4 chunks per rank) equals plain transformers in one process (float64, loss and
every gradient, 1e-10) for Qwen3.5, Qwen3-Next (with its auxiliary loss over every layer's routers), Nemotron-H and
Granite-4.0-H (dense), OLMo-hybrid, Bamba, Falcon-H1 and Zamba2; on packed batches each document against itself
alone; at sp=4 with key heads or ``B``/``C`` groups replicated; and with the memory stack (tiled MLP and loss,
checkpointing with offload emulated, FSDP2). The kernels' own float32 steps run in float64 on both sides
(:func:`kernels_in_float64`). In one process: chunked equals whole, and equals the family's forward over each
document alone; each of these fails when the state is not carried or not reset.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig  # noqa: E402
from transformers.models.bamba import modeling_bamba  # noqa: E402
from transformers.models.falcon_h1 import modeling_falcon_h1  # noqa: E402
from transformers.models.granitemoehybrid import modeling_granitemoehybrid  # noqa: E402
from transformers.models.jamba import modeling_jamba  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear  # noqa: E402
from transformers.models.minimax import modeling_minimax  # noqa: E402
from transformers.models.nemotron_h import modeling_nemotron_h  # noqa: E402
from transformers.models.olmo_hybrid import modeling_olmo_hybrid  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402
from transformers.models.zamba2 import modeling_zamba2  # noqa: E402

from lightning_fpdt.hf import recurrent  # noqa: E402
from lightning_fpdt.hf.recurrent import (  # noqa: E402
    DELTA_RULE,
    KDA,
    SCAN,
    SELECTIVE_SCAN,
    SequenceParallelRecurrence,
    delta_rule_split,
    scan_split,
)
from lightning_fpdt.memory.shape import ModelShape  # noqa: E402
from lightning_fpdt.models import HFCausalLM  # noqa: E402
from lightning_fpdt.offload.chunk_store import ChunkStore  # noqa: E402
from lightning_fpdt.offload.copy_engine import release_copy_engines  # noqa: E402
from lightning_fpdt.parallel.binding import SequenceParallelContext  # noqa: E402
from lightning_fpdt.parallel.packed_documents import PackedDocuments  # noqa: E402
from tests.helpers import (  # noqa: E402
    TokenDataset,
    assert_same_step,
    float32_classes,
    float32_functions,
    in_float64,
)
from tests.hf.test_hf_causal_lm import (  # noqa: E402
    LOSS_TILES,
    MLP_TILES,
    SEQ,
    VOCAB,
    Case,
    Packed,
    _fit,
    _mean_ce,
    _plain,
    _redraw,
)
from tests.hf.test_hf_moe import _float64_source, _router_in_input_dtype  # noqa: E402

DELTA_RULE_MODULES = [modeling_qwen3_5, modeling_qwen3_5_moe, modeling_qwen3_next, modeling_olmo_hybrid]
SCAN_MODULES = [modeling_nemotron_h, modeling_granitemoehybrid, modeling_bamba, modeling_falcon_h1, modeling_zamba2]
KDA_MODULES = [modeling_kimi_linear]
SELECTIVE_SCAN_MODULES = [modeling_jamba]
ROUTED = [modeling_qwen3_next, modeling_qwen3_5_moe, modeling_minimax]
WRAPPERS = ("causal_conv1d_forward", "mamba2_scan_forward", "mamba_scan_forward")  # 5.25's cache-handling wrappers

SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_hidden_layers=3)
DELTA_NET = dict(layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_value_heads=4,
                 linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
               output_router_logits=True, router_aux_loss_coef=0.5)
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8, mamba_expand=2)
# family: its tiny config's fields (3 layers, a recurrence on either side of an attention layer where the family
# lets the pattern be set)
FIELDS: dict[str, dict[str, Any]] = {
    "qwen3_5_text": DELTA_NET,
    "qwen3_5_moe_text": {**DELTA_NET, **EXPERTS},
    "qwen3_next": {**DELTA_NET, **EXPERTS},
    "olmo_hybrid": dict(pad_token_id=0, layer_types=["linear_attention", "full_attention", "linear_attention"],
                        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8),
    "nemotron_h": dict(hybrid_override_pattern="M*M", mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8,
                       n_groups=2, chunk_size=8, expand=2),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba"], num_local_experts=0,
                             shared_intermediate_size=48, **MAMBA),
    "bamba": dict(attn_layer_indices=[1], **MAMBA),
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
                      mamba_chunk_size=8),
    "zamba2": dict(layers_block_type=["mamba", "hybrid", "mamba"], mamba_headdim=8, mamba_d_state=8, mamba_ngroups=1,
                   chunk_size=8, num_mem_blocks=1),
    # Kimi delta attention (a gate per key channel) on either side of a latent-attention layer (MLA, its k/v heads
    # all query heads), routed experts in the middle layer
    # Mamba-1 (its selective scan, d_inner = 64 channels) on either side of an attention layer, routed experts in
    # the middle layer
    "jamba": dict(attn_layer_period=3, attn_layer_offset=1, expert_layer_period=3, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_expand=2, mamba_d_conv=4,
                  pad_token_id=0),
    # lightning attention (a decayed linear attention, blocks of 5 in transformers' own) on either side of an
    # attention layer, every layer's experts
    "minimax": dict(layer_types=["linear_attention", "full_attention", "linear_attention"], block_size=5,
                    num_local_experts=2, num_experts_per_tok=1),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "dense"], linear_num_heads=4, linear_head_dim=8,
                        linear_conv_kernel_dim=4, num_key_value_heads=4, kv_lora_rank=8, q_lora_rank=None,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6, num_experts=4, num_experts_per_token=2,
                        moe_intermediate_size=16, num_shared_experts=1, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2),
}


@pytest.fixture(autouse=True)
def kernels_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' delta-rule and scan kernels compute in float32 whatever their inputs: here in float64 (their
    own source, one dtype changed), on both sides; so are the routers' softmaxes and the auxiliary loss."""
    for module in DELTA_RULE_MODULES + SCAN_MODULES + KDA_MODULES + SELECTIVE_SCAN_MODULES:
        kernel = (DELTA_RULE if module in DELTA_RULE_MODULES else KDA if module in KDA_MODULES
                  else SELECTIVE_SCAN if module in SELECTIVE_SCAN_MODULES else SCAN)
        monkeypatch.setattr(module, kernel, in_float64(getattr(module, kernel)))
        for wrapper in float32_functions(module, WRAPPERS):  # 5.25's per-layer wrappers around the kernels
            monkeypatch.setattr(module, wrapper, in_float64(getattr(module, wrapper)))
        for layer in float32_classes(module):
            monkeypatch.setattr(layer, "forward", in_float64(layer.forward))
    for layer in float32_classes(modeling_minimax):
        monkeypatch.setattr(layer, "forward", in_float64(layer.forward))
    for module in ROUTED:
        router = next(c for n, c in vars(module).items() if n.endswith("TopKRouter"))
        monkeypatch.setattr(router, "forward", _router_in_input_dtype)
        monkeypatch.setattr(module, "load_balancing_loss_func", _float64_source(module.load_balancing_loss_func))


def _config(family: str) -> Any:
    defaults = AutoConfig.for_model(family)
    fields = {**{k: v for k, v in SIZES.items() if hasattr(defaults, k) or k == "num_hidden_layers"},
              **FIELDS[family]}
    config = AutoConfig.for_model(family, **fields)
    config._experts_implementation = "eager"  # the per-expert loop (grouped_mm has no float64 kernel)
    return config


def _hybrid(family: str, seed: int, stack: bool = False) -> HFCausalLM:
    tiles = dict(mlp_tiles=MLP_TILES, loss_tiles=LOSS_TILES) if stack else dict(mlp_tiles=1, loss_tiles=1)
    with warnings.catch_warnings():  # the families' "falling back to the torch implementation" notices
        warnings.simplefilter("ignore")
        module = HFCausalLM(_config(family), learning_rate=1e-3, warmup_steps=1, **tiles)
    _redraw(module.model, seed)
    lightning = [m for m in module.modules() if isinstance(m, modeling_minimax.MiniMaxLightningAttention)]
    for m in lightning:  # its decays, made in float32 at construction: in float64 (the model with them)
        m.query_decay, m.key_decay, m.diagonal_decay = m.decay_factors(m.slope_rate.double())
    return module.double() if lightning else module


def _routed_oracle(ref: torch.nn.Module, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor,
                                                                                                    dict]:
    """Mean cross-entropy of ``samples`` (each alone) + coefficient * the auxiliary loss over all their tokens'
    router logits together (transformers' ``load_balancing_loss_func`` of the family, one process)."""
    family = __import__(type(ref).__module__, fromlist=["load_balancing_loss_func"])
    loss_sum, count, logits = torch.zeros((), dtype=torch.float64), 0, []
    for ids, labels in samples:
        out = ref(input_ids=ids, use_cache=False, output_router_logits=True)
        targets = labels[:, 1:]
        loss_sum = loss_sum + F.cross_entropy(out.logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
        count += int((targets != -100).sum())
        logits.append(out.router_logits)
    per_layer = tuple(torch.cat([sample[i] for sample in logits]) for i in range(len(logits[0])))
    config = ref.config
    aux = family.load_balancing_loss_func(per_layer, config.num_experts, config.num_experts_per_tok, None)
    loss = loss_sum / count + config.router_aux_loss_coef * aux
    loss.backward()
    return loss.detach(), {f"model.{n}": p.grad.detach().clone() for n, p in ref.named_parameters()}


def _oracle(module: HFCausalLM, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, dict]:
    ref = _plain(module).double()  # OLMo-hybrid keeps A_log in float32 when built in float64
    if getattr(ref.config, "output_router_logits", False):
        return _routed_oracle(ref, samples)
    return _mean_ce(ref, samples)


CASES = [Case("qwen3_5_text", sp=2, chunk_size=8, offload="emulate"),  # 4 chunks per rank
         Case("qwen3_next", sp=2, chunk_size=8),
         Case("nemotron_h", sp=2, chunk_size=8, offload="emulate"),
         Case("granitemoehybrid", sp=2, chunk_size=8),
         Case("olmo_hybrid", sp=2, chunk_size=8),
         Case("qwen3_5_moe_text", sp=2, chunk_size=8),
         Case("bamba", sp=2, chunk_size=8),
         Case("falcon_h1", sp=2, chunk_size=8),
         Case("zamba2", sp=2, chunk_size=8),
         Case("qwen3_5_text", sp=4, chunk_size=16),  # 2 key heads replicated over 4 ranks
         Case("granitemoehybrid", sp=4, chunk_size=16),  # 1 group of B/C for 4 ranks
         Case("qwen3_5_text", sp=2, chunk_size=8, offload="emulate", stack=True),
         Case("nemotron_h", sp=2, chunk_size=8, offload="emulate", stack=True),
         Case("qwen3_next", sp=2, chunk_size=None),  # plain Ulysses: one chunk, a contiguous shard per rank
         Case("kimi_linear", sp=2, chunk_size=8, offload="emulate"),
         Case("kimi_linear", sp=4, chunk_size=16, offload="emulate", stack=True),  # one head per rank
         Case("jamba", sp=2, chunk_size=8, offload="emulate"),
         Case("jamba", sp=4, chunk_size=16, offload="emulate", stack=True),
         Case("minimax", sp=2, chunk_size=8, offload="emulate"),
         Case("minimax", sp=4, chunk_size=16, offload="emulate", stack=True)]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fit_step_equals_plain_transformers(case: Case, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    module = _hybrid(case.family, fresh_seed, stack=case.stack)
    assert module.recurrences and module.token_mixers() == []
    data = TokenDataset(2, SEQ, VOCAB, fresh_seed)
    ref_loss, ref_grads = _oracle(module, [(data.ids[i:i + 1], data.labels[i:i + 1]) for i in range(len(data))])
    results = _fit(module, data, case, tmp_path)
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"{case.name} seed={fresh_seed}")


@pytest.mark.distributed
@pytest.mark.parametrize(("family", "sp"), [("qwen3_5_text", 2), ("qwen3_next", 2), ("nemotron_h", 2),
                                            ("granitemoehybrid", 2), ("qwen3_5_text", 4), ("kimi_linear", 2),
                                            ("jamba", 2), ("minimax", 2)])
def test_packed_fit_step_equals_each_document_alone(family: str, sp: int, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    module = _hybrid(family, fresh_seed)
    data = Packed(fresh_seed)
    ref_loss, ref_grads = _oracle(module, data.documents())
    results = _fit(module, data, Case(family, sp=sp, chunk_size=8 * sp // 2), tmp_path)
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"packed {family} sp={sp} seed={fresh_seed}")


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])
def test_a_short_last_chunk(family: str, tmp_path, fresh_seed: int) -> None:
    """34 tokens in chunks of 8 at sp=2: the last chunk's sub-chunks hold 1 token each, so the convolution's
    3-token history before them reaches back over several sub-chunks on both ranks."""
    torch.manual_seed(fresh_seed)
    module = _hybrid(family, fresh_seed)
    data = TokenDataset(2, 34, VOCAB, fresh_seed)
    ref_loss, ref_grads = _oracle(module, [(data.ids[i:i + 1], data.labels[i:i + 1]) for i in range(len(data))])
    results = _fit(module, data, Case(family, sp=2, chunk_size=8), tmp_path)
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"{family} S=34 seed={fresh_seed}")


def _layer(family: str, seed: int) -> tuple[torch.nn.Module, SequenceParallelRecurrence]:
    """The first recurrence of a float64 tiny ``family`` model, and its installed forward."""
    module = _hybrid(family, seed).double()
    layer = module.get_submodule(f"model.{module.recurrences[0]}")
    return layer, layer.__dict__["forward"]


def _own(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's own forward on ``x`` (MiniMax's lightning attention takes its position embeddings and mask
    positionally, unused, and returns its state beside its output)."""
    extra = (None, None) if isinstance(layer, modeling_minimax.MiniMaxLightningAttention) else ()
    out = type(layer).forward(layer, x, *extra)
    return out[0] if isinstance(out, tuple) else out


def _width(layer: torch.nn.Module) -> int:
    return getattr(layer, "hidden_size", None) or layer.qkv_proj.in_features


def _sp(forward: SequenceParallelRecurrence, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    out = forward(x, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float(((ours - theirs).abs().max() / theirs.abs().max()).detach())


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "kimi_linear", "jamba", "minimax"])
@pytest.mark.parametrize("chunk_size", [3, 4, 7])
def test_one_process_chunks_carry_the_state(family: str, chunk_size: int, fresh_seed: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """In chunks (the last one shorter for 3 and 7), the state and the convolution's tail carried from chunk to
    chunk: equal to the family's forward over the whole sequence; dropping the state between chunks is caught."""
    layer, forward = _layer(family, fresh_seed)
    g = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(2, 17, _width(layer), generator=g, dtype=torch.float64)
    theirs = _own(layer, x)
    ours = _sp(forward, x, fpdt_context=SequenceParallelContext(chunk_size=chunk_size))
    assert _relative(ours, theirs) <= 1e-12
    real = recurrent.run_pieces

    def forgetful(run: Any, *args: Any) -> Any:  # every piece from a zero state
        return real(lambda pieces, params, state: run(pieces, params, None), *args)

    monkeypatch.setattr(recurrent, "run_pieces", forgetful)
    assert _relative(_sp(forward, x, fpdt_context=SequenceParallelContext(chunk_size=chunk_size)), theirs) > 1e-3


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "kimi_linear", "jamba", "minimax"])
def test_one_process_documents_restart_the_state(family: str, fresh_seed: int) -> None:
    """With packed documents (one of a single token, documents across chunks), in chunks of 4: each document equals
    the family's forward over that document alone; carrying the state across a document start is caught."""
    layer, forward = _layer(family, fresh_seed)
    g = torch.Generator().manual_seed(fresh_seed)
    lengths = [[1, 6, 9], [5, 11]]
    x = torch.randn(2, 16, _width(layer), generator=g, dtype=torch.float64)
    documents = PackedDocuments(tuple(tuple(sum(n[:i]) for i in range(len(n))) for n in lengths), 16)
    ours = _sp(forward, x, fpdt_context=SequenceParallelContext(chunk_size=4), documents=documents)
    for row, doc_lengths in enumerate(lengths):
        start = 0
        for n in doc_lengths:
            alone = _own(layer, x[row:row + 1, start:start + n])
            assert _relative(ours[row:row + 1, start:start + n], alone) <= 1e-12, (row, start, n)
            start += n
    unreset = PackedDocuments(documents.starts, 16)
    object.__setattr__(unreset, "pieces", lambda lo, hi: [(slice(None), [(lo, hi, lo == 0)])])
    mixed = _sp(forward, x, fpdt_context=SequenceParallelContext(chunk_size=4), documents=unreset)
    assert _relative(mixed[1:, 5:], ours[1:, 5:]) > 1e-3  # the second document read the first one's state


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])
def test_offloaded_chunk_inputs_come_back_for_backward(family: str, fresh_seed: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With offload, every chunk's inputs go into a store (host memory) and come back, prefetched, for its
    backward: the output and every gradient equal the family's forward over the whole sequence."""
    layer, forward = _layer(family, fresh_seed)
    stored = []
    put = ChunkStore.put
    monkeypatch.setattr(ChunkStore, "put", lambda store, key, x, **kw: (stored.append(key), put(store, key, x, **kw)))
    g = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(2, 16, layer.hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 16, layer.hidden_size, generator=g, dtype=torch.float64)
    params = [p for p in layer.parameters() if p.requires_grad]
    try:
        theirs = type(layer).forward(layer, x)
        expected = torch.autograd.grad((theirs * weights).sum(), [x, *params], allow_unused=True)
        ours = forward(x, fpdt_context=SequenceParallelContext(chunk_size=4, offload=True))
        found = torch.autograd.grad((ours * weights).sum(), [x, *params], allow_unused=True)
    finally:
        release_copy_engines()
    assert len(stored) == 4  # one packed input per chunk
    assert _relative(ours, theirs) <= 1e-12
    for e, f in zip(expected, found):
        assert (e is None) == (f is None) and (e is None or _relative(f, e) <= 1e-10)


def test_head_counts_the_group_cannot_split_are_refused_with_the_numbers() -> None:
    assert delta_rule_split(2, 4, 2) is None and delta_rule_split(2, 4, 4) is None  # split; key heads replicated
    assert "2 key heads and 6 value heads, which sequence_parallel_size=4 cannot split" in delta_rule_split(2, 6, 4)
    assert "Use a sequence_parallel_size in [1, 3, 6]" in delta_rule_split(3, 6, 4)
    assert scan_split(4, 1, 4) is None and scan_split(8, 8, 4) is None  # one group for all; whole groups each
    assert "3 B/C groups and 6 heads, which sequence_parallel_size=2 cannot split" in scan_split(6, 3, 2)
    layer, forward = _layer("qwen3_5_text", 0)
    layer.num_v_heads = 6  # as a config of 6 value heads would have it
    with pytest.raises(ValueError, match=r"Qwen3_5GatedDeltaNet \(layer 0\) has 2 key heads and 6 value heads"):
        forward.check_heads(4)
    forward.check_heads(2)


def test_a_generation_cache_under_chunks_is_refused() -> None:
    layer, forward = _layer("nemotron_h", 0)
    x = torch.randn(1, 8, layer.hidden_size, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="generation cache"):
        forward._context = SequenceParallelContext(chunk_size=4)
        forward._scan(x.new_zeros(1, 8, 4, 16), x.new_zeros(1, 8, 4), x.new_zeros(4), x.new_zeros(1, 8, 2, 8),
                      x.new_zeros(1, 8, 2, 8), chunk_size=8, return_final_states=True)


@pytest.mark.parametrize(("family", "kinds"), [
    ("qwen3_5_text", [(False, True, 1), (True, True, 0), (False, True, 1)]),  # delta-net, attention, delta-net
    ("falcon_h1", [(True, True, 1)] * 3),  # attention beside a Mamba-2 mixer in every layer
    ("nemotron_h", [(False, False, 1), (True, False, 0), (False, False, 1)]),  # one kind per block
])
def test_the_memory_model_reads_what_each_layer_of_a_hybrid_has(family: str, kinds: list) -> None:
    """Attention, an MLP and sequence-parallel mixers, per layer (Falcon-H1 was sized as an attention model before,
    its mixers left out; Nemotron-H and Granite-4.0-H were refused for 'no mlp module')."""
    shape, _ = ModelShape.from_module(_hybrid(family, 0))
    assert [(k.attention, k.mlp, len(k.mixers)) for k in shape.layer_kinds()] == kinds
    mixer = next(m for k in shape.layer_kinds() for m in k.mixers)
    assert mixer.saved(4, 8, 32) > mixer.saved(2, 8, 32) or family == "qwen3_5_text"  # Mamba-2's B/C gathered
    assert mixer.offloaded(2) < mixer.saved(2, 8, 32) and mixer.work() > 0


@pytest.mark.parametrize("copy_by", ["deepcopy", "pickle"])
def test_a_copied_model_keeps_its_recurrences_bound_to_the_copy(copy_by: str) -> None:
    """A spawned rank gets the module pickled; tests and users deepcopy it: the installed forwards come along,
    each bound to its own copy of the module (the family's namespace is not copied)."""
    module = _hybrid("nemotron_h", 0).double()
    copied = copy.deepcopy(module) if copy_by == "deepcopy" else pickle.loads(pickle.dumps(module))
    assert copied.recurrences == module.recurrences
    for name in module.recurrences:
        layer = copied.get_submodule(f"model.{name}")
        forward = layer.__dict__["forward"]
        assert isinstance(forward, SequenceParallelRecurrence) and forward.module is layer
    x = torch.randn(2, 12, module.model.config.hidden_size, dtype=torch.float64)
    original = module.get_submodule(f"model.{module.recurrences[0]}")
    twin = copied.get_submodule(f"model.{module.recurrences[0]}")
    context = SequenceParallelContext(chunk_size=4)
    assert torch.equal(original(x, fpdt_context=context), twin(x, fpdt_context=context))


def test_channels_and_heads_the_group_cannot_split_are_refused_with_the_numbers() -> None:
    """Mamba-1's d_inner channels and lightning attention's heads are split like attention's heads: a size that does
    not divide them is refused before any step, with the sizes that work."""
    for family, attribute, count, message in (
            ("jamba", "intermediate_size", 6, r"JambaMambaMixer \(layer 0\) has 6 d_inner channels, which"
                                              r" sequence_parallel_size=4 cannot split evenly"),
            ("minimax", "num_attention_heads", 6, r"MiniMaxLightningAttention \(layer 0\) has 6 heads, which"
                                                  r" sequence_parallel_size=4 cannot split evenly")):
        layer, forward = _layer(family, 0)
        setattr(layer, attribute, count)  # as a config of 6 would have it
        with pytest.raises(ValueError, match=message + r".*Use a sequence_parallel_size in \[1, 2, 3, 6\]"):
            forward.check_heads(4)
        forward.check_heads(2)


def test_the_install_check_feeds_the_projections_dtype() -> None:
    """OLMo-hybrid registers A_log (kept in float32 by the family) before its projections: the check that installs
    the sequence-parallel forward feeds its input in the projections' dtype, not the first parameter's (a model in
    float64 or bfloat16 had its layers refused for 'expected m1 and m2 to have the same dtype')."""
    from lightning_fpdt.hf.mixer_install import _disagreement

    layer, forward = _layer("olmo_hybrid", 0)  # float64
    layer.A_log = torch.nn.Parameter(layer.A_log.detach().float())
    assert next(layer.parameters()).dtype == torch.float32 and layer.q_proj.weight.dtype == torch.float64
    assert _disagreement(layer, forward) is None


def test_a_hybrid_read_from_a_directory_gets_the_buffers_from_pretrained_gives(tmp_path, fresh_seed: int) -> None:
    """Falcon-H1 fills its mixers' ``mup_vector`` (a buffer no checkpoint holds) from its base model's
    ``_init_weights`` branch. Read from a directory (built on the meta device, then read), it gets every buffer and
    parameter ``from_pretrained`` gives and is not refused (the mixer probe read uninitialised memory there and
    refused the family: "differs from the module's own by nan")."""
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_config(_config("falcon_h1"))
    _redraw(saved, fresh_seed)
    saved.save_pretrained(str(tmp_path))
    with warnings.catch_warnings():  # the family's "falling back to the torch implementation" notices
        warnings.simplefilter("ignore")
        module = HFCausalLM(str(tmp_path))
        module.load_weights()
        ref = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    for name, value in ref.named_buffers():
        assert torch.equal(module.model.get_buffer(name), value), name
    for name, value in ref.named_parameters():
        assert torch.equal(module.model.get_parameter(name), value), name
    assert any(name.endswith("mup_vector") for name, _ in ref.named_buffers())

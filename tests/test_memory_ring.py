"""The memory model and the communication figures of a sequence-parallel group that is Ulysses x ring."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.memory import EstimateOptions, ModelShape, auto_chunk_size, communication_bytes, estimate, sizing
from lightning_fpdt.memory.__main__ import main, shape_from_config
from lightning_fpdt.models import LlamaConfig, LlamaLM
from lightning_fpdt.options import FPDTOptions
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind
from lightning_fpdt.parallel.layout import layout_multiple, validate_chunk_size
from lightning_fpdt.parallel.mesh import SequenceParallelGroups
from lightning_fpdt.testing import run_on_ranks
from tests.helpers import training_step_peak

# 8 query heads of width 128 (k and v: 256 values per head and token), 4 layers
MHA = shape_from_config(LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=8, vocab_size=32000))
GQA = shape_from_config(LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=2, vocab_size=32000))


def _kv_store(shape: ModelShape, seq: int, ulysses: int, bytes_per_value: int = 4) -> int:
    """k and v of the whole sequence at the heads one rank of a Ulysses group of ``ulysses`` holds (KV heads
    replicated up to it), over every layer: what a rank's chunk stores keep between forward and backward."""
    heads = max(shape.num_kv_heads, ulysses) // ulysses
    return shape.num_layers * seq * heads * 2 * shape.head_dim * bytes_per_value


@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "offloaded"])
def test_the_ring_keeps_the_kv_store_at_the_ulysses_degree(offload: bool) -> None:
    """With a ring, the peers' key/value parts join a rank's store: per rank it holds the sequence's k/v at heads / U,
    ``R`` times what Ulysses over all ``P`` ranks holds (KV heads >= P), the same as Ulysses of degree ``U`` alone;
    on the device without offload, on the host with it. With GQA KV heads replicated up to ``P`` by Ulysses, the
    ring holds no more."""
    seq, chunk = 1 << 15, 1 << 12
    where = "host" if offload else "saved_activations"
    for sp, ring in ((4, 2), (8, 4), (8, 8)):
        u = sp // ring
        options = EstimateOptions(sequence_parallel_size=sp, chunk_size=chunk, offload=offload)
        plain, ringed = estimate(MHA, seq, options), estimate(MHA, seq, options.replace(ring_size=ring))
        assert _kv_store(MHA, seq, u) == ring * _kv_store(MHA, seq, sp)
        assert getattr(ringed, where) - getattr(plain, where) == _kv_store(MHA, seq, u) - _kv_store(MHA, seq, sp)
        # the term is Ulysses-only's at sp=U: the other saved activations are per token of the rank (S / P)
        alone = estimate(MHA, seq, options.replace(sequence_parallel_size=u, chunk_size=chunk))
        assert getattr(alone, where) - getattr(ringed, where) == pytest.approx(
            (getattr(alone, where) - _kv_store(MHA, seq, u)) * (1 - u / sp), rel=1e-9)
        if offload:  # nothing of the store stays on the device
            assert ringed.saved_activations == plain.saved_activations
    # 2 KV heads: Ulysses 4 replicates them to 4 (one per rank, the whole sequence); Ulysses 2 x ring 2 holds one too
    options = EstimateOptions(sequence_parallel_size=4, chunk_size=chunk)
    assert _kv_store(GQA, seq, 4) == _kv_store(GQA, seq, 2)
    assert (estimate(GQA, seq, options.replace(ring_size=2)).saved_activations
            == estimate(GQA, seq, options).saved_activations)


def test_ring_buffers_and_head_counts_use_the_ulysses_degree() -> None:
    """The ring's buffers are the backward's packed key/value gradient sums of one chunk (going and coming, R - 1
    parts each) in the accumulation dtype; the math kernel's scores are a ring part against a ring part at heads / U;
    a head count that Ulysses over P cannot shard but U can is no longer noted as refused."""
    seq, chunk, sp, ring = 1 << 15, 1 << 12, 8, 4
    options = EstimateOptions(sequence_parallel_size=sp, chunk_size=chunk, precision="bf16-mixed")
    part = chunk // sp * MHA.num_kv_heads * 2 * MHA.head_dim  # one ring rank's k/v of a chunk (U=2: 8 heads)
    assert estimate(MHA, seq, options).ring_buffers == 0
    assert estimate(MHA, seq, options.replace(ring_size=ring)).ring_buffers == 2 * (ring - 1) * part * 4  # float32
    assert "ring buffers" in estimate(MHA, seq, options.replace(ring_size=ring)).table()
    assert "ring buffers" not in estimate(MHA, seq, options).table()
    math_kernel = options.replace(attention_backend="math", precision="32-true")
    scores = {r: estimate(MHA, seq, math_kernel.replace(ring_size=r)).chunk_buffers
              - estimate(MHA, seq, math_kernel.replace(ring_size=r, attention_backend="sdpa")).chunk_buffers
              for r in (1, 4)}
    assert scores[1] == 4 * (MHA.num_heads // sp) * chunk**2 * 4
    assert scores[4] == 4 * (MHA.num_heads // (sp // 4)) * (chunk // 4) ** 2 * 4
    sixteen = EstimateOptions(sequence_parallel_size=16, chunk_size=chunk)
    assert any("cannot be sharded over sp=16" in n for n in estimate(MHA, seq, sixteen).notes)
    assert not estimate(MHA, seq, sixteen.replace(ring_size=2)).notes


@pytest.mark.parametrize(("sp", "ring"), [(4, 1), (4, 2), (4, 4), (6, 3), (8, 8), (12, 4)])
def test_auto_chunk_sizes_divide_by_the_layout_multiple(sp: int, ring: int, monkeypatch) -> None:
    """Every chunk size ``auto`` proposes divides by lcm(P, 2R) (each chunk is cut into P sub-chunks and 2R ring
    pieces), so the layout accepts it: every candidate it estimates, from one chunk down to the smallest, and the
    one it picks."""
    multiple = layout_multiple(sp, ring)
    assert multiple == (sp if ring == 1 else math.lcm(sp, 2 * ring))
    options = EstimateOptions(sequence_parallel_size=sp, ring_size=ring, activation_checkpointing=True,
                              mlp_tiled=True, loss_tiled=True)
    seq = 100_003  # not a multiple of anything here
    tried: list[int | None] = []

    def spy(shape: ModelShape, seq_len: int, opts: EstimateOptions) -> object:
        tried.append(opts.chunk_size)
        return estimate(shape, seq_len, opts)

    monkeypatch.setattr(sizing, "estimate", spy)  # what auto_chunk_size calls
    with pytest.raises(ValueError, match=rf"the smallest chunk \({multiple}\) still needs"):
        auto_chunk_size(MHA, seq, 0, options)
    assert tried[0] is None and tried[-1] == multiple and len(tried) >= 12, tried
    for chunk in tried[1:]:
        assert chunk % multiple == 0, tried
        validate_chunk_size(chunk, sp, ring)  # the layout takes it
    budget = estimate(MHA, seq, options.replace(chunk_size=tried[3])).device_peak
    picked = auto_chunk_size(MHA, seq, budget, options)
    assert picked is not None and picked % multiple == 0 and picked >= tried[3], (picked, tried)


def test_ring_size_is_validated_and_resolved_as_the_strategy_resolves_it() -> None:
    with pytest.raises(ValueError, match=r"EstimateOptions: ring_size=3 does not divide sequence_parallel_size=4"
                                         r" \(the group is ulysses x ring ranks\); use one of \[1, 2, 4\]"):
        EstimateOptions(sequence_parallel_size=4, ring_size=3)
    with pytest.raises(ValueError, match="ring_size must be a positive int, got 0"):
        EstimateOptions(ring_size=0)
    assert EstimateOptions(sequence_parallel_size=8, ring_size=2).ulysses_size == 4
    strategy = FPDTStrategy(sequence_parallel_size=4, ring_size=2)
    strategy.num_nodes, strategy.parallel_devices = 1, [torch.device("cpu")] * 4
    assert (strategy.estimate_options.sequence_parallel_size, strategy.estimate_options.ring_size) == (4, 2)
    # "auto": the largest Ulysses degree that divides sp, fits a node's devices and (given the model) its heads
    options = FPDTOptions(sequence_parallel_size=16)
    assert EstimateOptions.from_strategy(options, 2, 8).ring_size == 2
    with torch.device("meta"):
        two_heads = LlamaLM(LlamaConfig.tiny(num_attention_heads=2, num_key_value_heads=1))
    assert EstimateOptions.from_strategy(options, 2, 8, model=two_heads).ring_size == 8
    assert EstimateOptions.from_strategy(options, 2, 8, ring_size=4, model=two_heads).ring_size == 4  # as resolved
    yaml = {"trainer": {"devices": 8, "num_nodes": 2,
                        "strategy": {"init_args": {"sequence_parallel_size": 16, "ring_size": "auto"}}}}
    assert EstimateOptions.from_yaml(yaml, model=two_heads).ring_size == 8
    assert EstimateOptions.from_yaml(yaml).ring_size == 2


def test_communication_bytes_follow_the_ulysses_and_ring_degrees() -> None:
    """All-to-alls move (U - 1) / U of each local q, k, v and output (and their gradients); the ring moves each
    rank's parts to R - 1 peers (forward, input dtype) and their gradient sums back (accumulation dtype). Chunking
    changes none of it; checkpointing moves the forward's twice; KV heads replicated over U move replicated."""
    seq, sp = 1 << 16, 8
    t = seq // sp
    options = EstimateOptions(sequence_parallel_size=sp, precision="bf16-mixed")
    q_out = t * MHA.num_heads * MHA.head_dim * 2 * 2  # q and out (or dout and dq), bf16
    for ring in (1, 2, 4, 8):
        u = sp // ring
        moved = communication_bytes(MHA, options.replace(ring_size=ring), seq)
        kv = t * max(MHA.num_kv_heads, u) * 2 * MHA.head_dim * 2
        layers = MHA.num_layers
        assert moved["all_to_all_forward"] == moved["all_to_all_backward"] == layers * (u - 1) / u * (q_out + kv)
        assert moved["ring_forward"] == layers * (ring - 1) * kv and moved["ring_backward"] == 2 * moved["ring_forward"]
        assert moved == communication_bytes(MHA, options.replace(ring_size=ring, chunk_size=4096), seq)
        twice = communication_bytes(MHA, options.replace(ring_size=ring, activation_checkpointing=True), seq)
        assert twice["all_to_all_forward"] == 2 * moved["all_to_all_forward"]
        assert twice["ring_backward"] == moved["ring_backward"]
    assert communication_bytes(MHA, options, seq)["ring_forward"] == 0
    assert communication_bytes(MHA, options.replace(ring_size=sp), seq)["all_to_all_forward"] == 0
    # 2 KV heads over Ulysses 8: k and v cross the all-to-all at 8 heads, four times the bytes of 2
    gqa = {u: communication_bytes(GQA, options.replace(ring_size=sp // u), seq)["all_to_all_forward"] for u in (2, 8)}
    kv2 = t * 2 * 2 * GQA.head_dim * 2
    assert gqa[8] / (7 / 8) - GQA.num_layers * q_out == pytest.approx(4 * GQA.num_layers * kv2)
    assert gqa[2] / (1 / 2) - GQA.num_layers * q_out == pytest.approx(GQA.num_layers * kv2)


def test_memory_cli_takes_a_ring(capsys) -> None:
    llama3_8b = ["--hidden", "4096", "--layers", "32", "--heads", "32", "--kv-heads", "8", "--intermediate", "14336",
                 "--vocab", "128256", "--seq", "4194304", "--chunk-size", "65536", "--offload", "--checkpointing",
                 "--offload-checkpoints", "--tiled", "--precision", "bf16-mixed", "--shard"]
    main([*llama3_8b, "--sp", "64", "--ring", "8"])
    out = capsys.readouterr().out
    assert "sequence_parallel_size=64, data_parallel_size=1, ring_size=8," in out and "ring buffers" in out, out
    moved = {line.split("  ")[1].strip(): line.rsplit("  ", 1)[1].strip() for line in out.splitlines()
             if line.startswith("  ")}
    assert list(moved) == ["all-to-all forward (ulysses 8)", "ring forward (ring 8)", "all-to-all backward (ulysses 8)",
                           "ring backward (ring 8)", "total"], out
    assert "bytes moved per step per rank, attention (forward twice: recomputed):" in out
    main([*llama3_8b, "--sp", "64"])  # the default ring of 1: Ulysses 64, which 32 heads cannot shard
    out = capsys.readouterr().out
    assert "ring_size=1," in out and "num_heads=32, num_kv_heads=8 cannot be sharded over sp=64" in out, out
    assert re.search(r"ring forward \(ring 1\) +0 KiB", out), out
    with pytest.raises(SystemExit, match="ring_size=3 does not divide sequence_parallel_size=64"):
        main([*llama3_8b, "--sp", "64", "--ring", "3"])


def _ring_step(rank: int, world: int, ring: int, seq: int) -> tuple[int, int]:
    """One training step of a small Llama (4 KV heads, so that Ulysses 4 needs no replication) at sp=``world`` as
    Ulysses x ring ``ring``, chunks of a quarter of the sequence, nothing tiled or checkpointed: the measured peak of
    live tensors and the estimator's device peak."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, mlp_tiles=1)
    module = LlamaLM(config, loss_tiles=1)
    shape, tiling = ModelShape.from_module(module)
    groups = SequenceParallelGroups.create(1, world, ring)
    chunk = seq // 4
    bind(module, SequenceParallelContext(group=dist.group.WORLD, chunk_size=chunk, attention_backend="sdpa",
                                         ulysses_group=groups.ulysses_group, ring_group=groups.ring_group))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    ids = torch.randint(0, shape.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
    batch = shard_batch({"input_ids": ids}, world, rank, chunk, ring_size=ring)
    measured = training_step_peak(module, batch, optimizer)
    options = EstimateOptions(sequence_parallel_size=world, ring_size=ring, chunk_size=chunk, **tiling)
    return measured, estimate(shape, seq, options).device_peak


@pytest.mark.distributed
def test_ring_estimate_matches_a_measured_step() -> None:
    """sp=4 as Ulysses 2 x ring 2 against Ulysses 4: the measured peaks differ by the larger key/value store (k/v at
    heads / 2, not / 4), and the estimate of each is within a few percent of its measured peak (CPU, live tensors)."""
    seq = 2048
    (m1, e1), (m2, e2) = (run_on_ranks(_ring_step, 4, ring, seq)[0] for ring in (1, 2))
    print(f"ring 1: measured {m1 / 2**20:.2f} MiB, estimate {e1 / 2**20:.2f}; ring 2: measured {m2 / 2**20:.2f},"
          f" estimate {e2 / 2**20:.2f}")
    small = ModelShape(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=352,
                       vocab_size=256, num_params=0)
    store_growth = _kv_store(small, seq, 2) - _kv_store(small, seq, 4)
    assert store_growth == 2**20  # 2 layers x 2048 tokens x (2 - 1 heads) x 64 values x 4 bytes
    assert abs((m2 - m1) - store_growth) <= 0.1 * store_growth, (m1, m2)
    assert abs((e2 - e1) - store_growth) <= 0.1 * store_growth, (e1, e2)
    for measured, estimated in ((m1, e1), (m2, e2)):
        assert abs(estimated / measured - 1) <= 0.05, (measured / 2**20, estimated / 2**20)

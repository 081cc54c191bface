"""Attention computed once per step (``lightning_fpdt.attention.kept_answers``): a recomputed decoder layer answers
its attention from the output and log-sum-exp its forward kept, streamed or recomputed whole, for the own Llama and a
transformers Llama (tests/test_streaming.py's, float64, on its packed-document batches); exact against one process at
sp=2, and attention's forward kernel runs once per block."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_fpdt.attention.kernels import MathKernel
from lightning_fpdt.layers.activation_checkpoint import new_layer_input_store
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind
from lightning_fpdt.testing import run_on_ranks
from tests.reference import rel_error
from tests.test_streaming import _batch, _group_step, _model, _step


def _sharded_step(rank: int, world: int, kind: str, seed: int, seq: int, chunk: int, streamed: bool, keep: bool,
                  offload: bool) -> dict[str, Any]:
    calls = {"forward": 0, "backward": 0}
    forward, backward = MathKernel.forward, MathKernel.backward

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    MathKernel.forward = counted("forward", forward)  # this forked rank's own copy of the class
    MathKernel.backward = counted("backward", backward)
    module = _model(kind, seed)
    bind(module, SequenceParallelContext(
        group=dist.group.WORLD, chunk_size=chunk, attention_backend="math", offload=offload,
        activation_checkpointing=True, layer_input_store=new_layer_input_store(torch.device("cpu")),
        streaming=streamed, keep_attention=keep))
    loss_sum, grads = _group_step(module, shard_batch(_batch(seed, seq), world, rank, chunk))
    return {"loss": loss_sum, "grads": grads, "calls": calls}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["llama", "hf"])
@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
def test_attention_runs_once_per_step_and_stays_exact(kind: str, streamed: bool, fresh_seed: int) -> None:
    """sp=2, packed documents, four chunks, layers checkpointed (streamed, or recomputed whole), chunks offloaded: loss
    and every gradient
    equal one process's plain model on the whole batch, and each rank runs attention's forward kernel exactly as often
    as its backward kernel (once per block); without kept answers the forward kernel runs twice per block."""
    seq, chunk = 64, 16
    kept = run_on_ranks(_sharded_step, 2, kind, fresh_seed, seq, chunk, streamed, True, True)
    recomputed = run_on_ranks(_sharded_step, 2, kind, fresh_seed, seq, chunk, streamed, False, False)
    reference = _model(kind, fresh_seed)
    ref_loss, ref_grads = _step(reference, _batch(fresh_seed, seq))
    for result in (*kept, *recomputed):
        assert rel_error(result["loss"], ref_loss) <= 1e-10, f"{kind} seed={fresh_seed}: loss"
        for name, g in ref_grads.items():
            assert rel_error(result["grads"][name], g) <= 1e-10, f"{kind} seed={fresh_seed}: {name}"
    for result in kept:
        calls = result["calls"]
        assert calls["backward"] > 0 and calls["forward"] == calls["backward"], calls
    for result in recomputed:  # the comparison the test makes is not vacuous: recomputation doubled the forward
        calls = result["calls"]
        assert calls["forward"] == 2 * calls["backward"], calls


def test_auto_keeps_the_answers_where_they_fit_and_says_once_where_not(caplog: pytest.LogCaptureFixture) -> None:
    """``keep_attention="auto"``: on where the memory model's estimate with the answers fits the room; off where not,
    said once (with the numbers and the fix) however many batch shapes follow."""
    from lightning_fpdt.memory import EstimateOptions, estimate
    from lightning_fpdt.memory.planning import AnswerPlanner
    from lightning_fpdt.memory.shape import ModelShape

    module = _model("llama", 0)
    options = EstimateOptions(activation_checkpointing=True, offload=True, chunk_size=64)
    shape, tiling = ModelShape.from_module(module)
    needed = estimate(shape, 512, options.replace(keep_attention=True, precision="32-true", optimizer="none",
                                                  **tiling))
    assert needed.kept_answers == 2 * 512 * (4 * 8 * 4 + 4 * 4)  # 2 layers x tokens x (heads x v_dim x 4 B + lse)
    batch = {"input_ids": torch.zeros(1, 512, dtype=torch.long)}
    assert AnswerPlanner(needed.host, options).keep_for(module, batch, 64, current=False)
    tight = AnswerPlanner(needed.host - 1, options)
    with caplog.at_level("INFO"):
        assert not tight.keep_for(module, batch, 64, current=True)
        assert not tight.keep_for(module, {"input_ids": torch.zeros(1, 1024, dtype=torch.long)}, 64, current=True)
    said = [r.getMessage() for r in caplog.records if "keep_attention='auto'" in r.getMessage()]
    assert len(said) == 1 and "host memory" in said[0] and "keep_attention=True" in said[0], said
    assert tight.keep_for(module, {"labels": torch.zeros(1, 4)}, 64, current=True)  # no input_ids: unchanged


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_keep_attention_takes_true_false_or_auto(value: Any) -> None:
    from lightning_fpdt import FPDTStrategy

    with pytest.raises(ValueError, match=r"keep_attention must be True, False or 'auto', got"):
        FPDTStrategy(keep_attention=value)


def test_the_replay_hands_each_attention_call_its_own_answers_in_order() -> None:
    """Every attention call of a run takes its turn, whether it kept (or uses) answers or not, so a call that kept
    none cannot shift a later call onto another call's answers; what the replay did not hand out is closed when it
    ends, and the answers of a forward whose graph is dropped are closed when the next store is made."""
    import gc

    from lightning_fpdt.attention.kept_answers import AnswerKeeper, active_keeper
    from lightning_fpdt.offload.chunk_store import ChunkStore

    def store_with(value: float) -> ChunkStore:
        store = ChunkStore(torch.device("cpu"))
        store.put(("o", 0), torch.full((2,), value))
        return store

    first, third = store_with(1.0), store_with(3.0)
    keeper = AnswerKeeper()
    keeper.wrap(lambda: [keeper.record(s) for s in (first, None, third)])()  # a run of three attention calls
    seen = []
    keeper.wrap(lambda: seen.append((active_keeper() is keeper, keeper.replay(), keeper.replay())))()
    assert seen == [(True, first, None)]  # the first two calls' turns; the third call never came
    assert ("o", 0) in first and ("o", 0) not in third  # handed out: the caller's; not handed out: closed
    assert active_keeper() is None  # a keeper is active only during its layer's run

    dropped = store_with(4.0)

    def forward_only() -> None:  # a recomputed layer's forward whose graph is dropped before any backward
        orphan = AnswerKeeper()
        orphan.wrap(orphan.record)(dropped)

    forward_only()
    gc.collect()
    assert ("o", 0) in dropped  # a finalizer only queues it
    ChunkStore(torch.device("cpu"))  # a safe point
    assert ("o", 0) not in dropped

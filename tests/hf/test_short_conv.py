"""Short convolutions (LFM2) sequence-parallel and exact (lightning_fpdt/hf/short_conv.py): each sub-chunk's
convolution gets the tail of the one before it (on this rank, on the rank before, or on the last rank for a rank's
first sub-chunk of a chunk), and its history restarts at every document start.

One ``Trainer.fit`` step at sp=2 (4 chunks per rank) and sp=4 equals plain transformers in one process (float64,
loss and every gradient, 1e-10), on plain batches and on packed ones (each document against itself alone), for LFM2
and LFM2-MoE; and with the memory stack (tiled MLP and loss, checkpointing with offload emulated, FSDP2). In one
process the carried tail and the restart are checked against ``Conv1d`` itself.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers import Lfm2Config, Lfm2MoeConfig  # noqa: E402

from lightning_fpdt.hf.mixer_install import install_short_convs  # noqa: E402
from lightning_fpdt.hf.short_conv import causal_conv, causal_conv_chunk, is_short_conv  # noqa: E402
from lightning_fpdt.layers.carried import MixerStream  # noqa: E402
from lightning_fpdt.models import HFCausalLM  # noqa: E402
from lightning_fpdt.parallel.binding import SequenceParallelContext  # noqa: E402
from lightning_fpdt.parallel.packed_documents import PackedDocuments  # noqa: E402
from tests.helpers import TokenDataset, assert_same_step  # noqa: E402
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
    each_sample_alone,
)


def _lfm2(seed: int, stack: bool = False, moe: bool = False) -> HFCausalLM:
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"])
    if moe:  # layer 0 dense, layers 1 and 2 routed (top-2 of 4, sigmoid router, no auxiliary loss)
        config = Lfm2MoeConfig(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
                               **sizes)
        config._experts_implementation = "eager"  # the per-expert loop (grouped_mm has no float64 kernel)
    else:
        config = Lfm2Config(block_auto_adjust_ff_dim=False, **sizes)
    tiles = dict(mlp_tiles=MLP_TILES, loss_tiles=LOSS_TILES) if stack else dict(mlp_tiles=1, loss_tiles=1)
    module = HFCausalLM(config, learning_rate=1e-3, warmup_steps=1, **tiles)
    _redraw(module.model, seed)
    return module


def test_both_short_convolutions_run_sequence_parallel_and_nothing_else_mixes() -> None:
    module = _lfm2(0)
    assert module.short_convs == ["model.layers.0.conv", "model.layers.2.conv"]
    assert module.token_mixers() == []
    module.refuse_token_mixers(2)  # nothing left to refuse


# chunk 1: sub-chunks shorter than the K - 1 = 2 taps before; a streamed layer runs in chunks (never None)
RUNS = [(None, False), *((chunk, streamed) for chunk in (1, 2, 4, 8) for streamed in (False, True))]


@pytest.mark.parametrize(("chunk_size", "streamed"), RUNS,
                         ids=[f"C{c}-{'streamed' if s else 'whole'}" for c, s in RUNS])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_one_process_tails_and_document_restarts_equal_conv1d(chunk_size: int | None, streamed: bool, packed: bool,
                                                             fresh_seed: int) -> None:
    """In one process with sub-chunks (the tail carried from the sub-chunk before; streamed: one chunk per call, the
    tail carried from call to call), against ``Conv1d`` over the whole sequence, or over each document alone."""
    g = torch.Generator().manual_seed(fresh_seed)
    b, s, width, k = 2, 16, 6, 3
    conv = nn.Conv1d(width, width, kernel_size=k, groups=width, padding=k - 1, bias=False).double()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g, dtype=torch.float64))
    u = torch.randn(b, s, width, generator=g, dtype=torch.float64)
    lengths = [[1, 6, 9], [5, 11]] if packed else [[s], [s]]
    documents = PackedDocuments(tuple(tuple(sum(n[:i]) for i in range(len(n))) for n in lengths), s) if packed else None
    context = SequenceParallelContext(chunk_size=chunk_size)
    if not streamed:
        ours = causal_conv(u, conv.weight[:, 0, :], context, documents)
    else:
        pieces, carry = [], {}
        for c, lo in enumerate(range(0, s, chunk_size)):
            stream = MixerStream(c, lo, min(lo + chunk_size, s), s, carry)
            pieces.append(causal_conv_chunk(u[:, lo:lo + chunk_size], conv.weight[:, 0, :], context, documents,
                                            stream, "conv"))
            carry = stream.carried_out
        ours = torch.cat(pieces, dim=1)
    expected = torch.zeros_like(u)
    for i, doc_lengths in enumerate(lengths):
        start = 0
        for n in doc_lengths:
            piece = u[i:i + 1, start:start + n].transpose(1, 2)
            expected[i:i + 1, start:start + n] = conv(piece)[..., :n].transpose(1, 2)
            start += n
    assert torch.allclose(ours, expected, rtol=1e-12, atol=1e-12)


def test_a_model_read_from_a_directory_gets_them_once_its_weights_are_in(tmp_path) -> None:
    _lfm2(0).model.save_pretrained(tmp_path)
    module = HFCausalLM(str(tmp_path), mlp_tiles=1)
    assert module.weights_pending and module.short_convs == [] and module.token_mixers() is None
    module.load_weights()
    assert module.short_convs == ["model.layers.0.conv", "model.layers.2.conv"] and module.token_mixers() == []


def test_a_module_that_is_no_short_convolution_is_left_alone() -> None:
    module = _lfm2(0)
    conv = module.model.model.layers[0].conv
    assert is_short_conv(conv)
    conv.__dict__.pop("forward")
    conv.conv.padding = (0,)  # not causal-padded any more: not the computation SequenceParallelShortConv does
    assert install_short_convs(module.model) == []
    assert [m.module for m in module.token_mixers() or []] in ([], ["model.layers.0.conv"])


CASES = [Case("lfm2", sp=2, chunk_size=8, kv_heads=2, offload="emulate"),  # 4 chunks per rank
         Case("lfm2_moe", sp=2, chunk_size=8, kv_heads=2),
         Case("lfm2", sp=4, chunk_size=16, kv_heads=2),  # 2 chunks per rank of 4 tokens
         Case("lfm2", sp=2, chunk_size=None, kv_heads=2),  # plain Ulysses: one contiguous shard per rank
         Case("lfm2", sp=2, chunk_size=8, kv_heads=2, offload="emulate", stack=True)]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fit_step_equals_plain_transformers(case: Any, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    module = _lfm2(fresh_seed, stack=case.stack, moe=case.family == "lfm2_moe")
    ref = _plain(module)
    data = TokenDataset(2, SEQ, VOCAB, fresh_seed)
    results = _fit(module, data, case, tmp_path)
    ref_loss, ref_grads = each_sample_alone(ref, data)
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"{case.name} seed={fresh_seed}")


@pytest.mark.distributed
@pytest.mark.parametrize(("family", "sp"), [("lfm2", 2), ("lfm2", 4), ("lfm2_moe", 2)])
def test_packed_fit_step_equals_each_document_alone(family: str, sp: int, tmp_path, fresh_seed: int) -> None:
    torch.manual_seed(fresh_seed)
    case = Case(family, sp=sp, chunk_size=8, kv_heads=2)
    module = _lfm2(fresh_seed, moe=family == "lfm2_moe")
    ref = _plain(module)
    data = Packed(fresh_seed)
    results = _fit(module, data, case, tmp_path)
    ref_loss, ref_grads = _mean_ce(ref, data.documents())
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"packed {family} sp={sp} seed={fresh_seed}")

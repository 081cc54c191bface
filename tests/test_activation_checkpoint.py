"""Block activation checkpointing: any schedule of forward and backward passes gives the plain gradients."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lightning_fpdt.layers.activation_checkpoint import new_layer_input_store
from lightning_fpdt.layers.block import FPDTAttention, FPDTBlock
from lightning_fpdt.layers.rope import RotaryEmbedding
from lightning_fpdt.models.llama import RMSNorm, SwiGLU
from lightning_fpdt.offload.chunk_store import ChunkStore, slow_copies
from lightning_fpdt.offload.tiling import TiledMLP
from lightning_fpdt.parallel.binding import SequenceParallelContext
from tests.reference import rel_error

CPU = torch.device("cpu")
BATCH, SEQ, HIDDEN, LAYERS = 2, 24, 32, 2

# where the inputs of recomputed blocks live; the offloading ones copy slowly (COPY_DELAY) on the background
# workers that emulate the copy streams
STORES = {
    "graph": lambda: None,
    "device-store": lambda: ChunkStore(CPU, offload=False),
    "offloaded": lambda: ChunkStore(CPU, offload=True),
    "layer-input-store": lambda: new_layer_input_store(CPU),
}
COPY_DELAY = 0.001
# f: a forward pass whose output goes into the next backward; d: a forward pass whose output is
# dropped (no backward ever comes); b: one backward over every pending output
SCHEDULES = {
    "one-step": "fb",
    "two-forwards-one-backward": "ffb",
    "three-forwards-one-backward": "fffb",
    "forward-backward-twice": "fbfb",
    "mixed": "ffbfb",
    "dropped-forward": "dfdb",
}


def _block() -> FPDTBlock:
    block = FPDTBlock(
        attention=FPDTAttention(HIDDEN, 4, 2, rope=RotaryEmbedding(8)),
        mlp=TiledMLP(SwiGLU(HIDDEN, 48), num_tiles=3),
        attention_norm=RMSNorm(HIDDEN),
        mlp_norm=RMSNorm(HIDDEN),
    ).double()
    for m in block.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=1 / math.sqrt(m.in_features))
    return block


def _run_schedule(
    model: torch.nn.ModuleList, schedule: str, inputs: list[torch.Tensor], grads: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Runs ``schedule`` (see ``SCHEDULES``); returns the gradient of each input whose output had a backward."""
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    with_backward: list[torch.Tensor] = []
    data = iter(zip(inputs, grads))
    for step in schedule:
        if step == "b":
            torch.autograd.backward([y for y, _ in pending], [g for _, g in pending])
            pending = []
            continue
        x, g = next(data)
        x = x.clone().requires_grad_()
        y = x
        for block in model:
            y = block(y, pos)
        if step == "f":
            pending.append((y, g))
            with_backward.append(x)
    return [x.grad for x in with_backward]


@pytest.mark.parametrize("store_name", list(STORES))
@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_any_forward_backward_schedule_matches_plain(store_name: str, schedule_name: str, fresh_seed: int) -> None:
    seed = fresh_seed
    torch.manual_seed(seed)
    label = f"store={store_name} schedule={schedule_name} seed={seed}"
    schedule = SCHEDULES[schedule_name]
    plain = torch.nn.ModuleList([_block() for _ in range(LAYERS)])
    ckpt = copy.deepcopy(plain)
    store = STORES[store_name]()
    for i, block in enumerate(ckpt):
        block.bind(SequenceParallelContext(activation_checkpointing=True, layer_input_store=store,
                                           chunk_size=8, attention_backend="math"), layer_index=i)
    forwards = sum(s != "b" for s in schedule)
    inputs = [torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64) for _ in range(forwards)]
    grads = [torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64) for _ in range(forwards)]

    expected = _run_schedule(plain, schedule, inputs, grads)
    with slow_copies(COPY_DELAY):
        got = _run_schedule(ckpt, schedule, inputs, grads)

    for k, (a, b) in enumerate(zip(got, expected)):
        assert rel_error(a, b) <= 1e-10, f"{label}: input {k} gradient"
    for (name, p_plain), p_ckpt in zip(plain.named_parameters(), ckpt.parameters()):
        assert rel_error(p_ckpt.grad, p_plain.grad) <= 1e-10, f"{label}: {name}"
    if store is not None:
        assert not list(store.keys()), f"{label}: layer inputs left in the store"
        if store.offload:
            # each backward waits only for the layer input it meets first; every later one was prefetched
            assert store.stats.stalls == schedule.count("b"), label
            assert max(store.stats.peak_resident_chunks.values()) <= 2, label  # the one in use + the next
        store.close()


def test_forward_without_gradients_keeps_no_layer_input() -> None:
    store = ChunkStore(CPU, offload=True)
    block = _block()
    block.bind(SequenceParallelContext(activation_checkpointing=True, layer_input_store=store, chunk_size=8,
                                       attention_backend="math"))
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    block.requires_grad_(False)
    block(x, pos)  # grad mode on, but nothing requires a gradient
    with torch.no_grad():
        block(x, pos)
    assert store.stats.bytes_to_host == 0 and not list(store.keys())
    store.close()

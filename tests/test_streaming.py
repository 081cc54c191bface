"""Decoder layers that stream (``lightning_fpdt.layers.streaming``): exact against one process at sp=2, and no layer's
work sized by the local sequence, forward or backward, for the own Llama and a transformers Llama."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import lightning_fpdt.layers.streaming as streaming
from lightning_fpdt.hf.layers import decoder_modules
from lightning_fpdt.layers.activation_checkpoint import new_layer_input_store
from lightning_fpdt.layers.block import FPDTBlock
from lightning_fpdt.models import CausalLM, HFCausalLM, LlamaConfig, LlamaLM
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind
from lightning_fpdt.testing import run_on_ranks
from tests.reference import rel_error

VOCAB, HIDDEN = 64, 32
# allocations, which a layer makes for its output and its input's gradient (filled chunk by chunk), are not work
ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default",
               "aten.empty_strided.default"}


def _model(kind: str, seed: int) -> CausalLM:
    torch.manual_seed(seed)
    if kind == "llama":
        module: CausalLM = LlamaLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               rope_theta=10000.0, mlp_tiles=2), loss_tiles=3)
    else:
        module = HFCausalLM(transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
                                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                     max_position_embeddings=1024), mlp_tiles=2, loss_tiles=3)
    module = module.double()
    for p in module.parameters():  # non-trivial weights: a wrong scale or mask cannot hide under the tolerance
        nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))
    return module


def _batch(seed: int, seq: int) -> dict[str, Tensor]:
    """Two samples of packed documents (position ids restarting at each)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    positions = []
    for _ in range(2):
        cuts = sorted(torch.randperm(seq - 1, generator=g)[:2].add(1).tolist())
        lengths = [a - b for a, b in zip([*cuts, seq], [0, *cuts])]
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
    return {"input_ids": ids, "position_ids": torch.stack(positions)}


def _context(group: Any, chunk: int, streamed: bool = True) -> SequenceParallelContext:
    """The full stack: chunks offloaded, layers checkpointed with their inputs offloaded (emulated on CPU)."""
    return SequenceParallelContext(group=group, chunk_size=chunk, attention_backend="math", offload=True,
                                   activation_checkpointing=True, layer_input_store=new_layer_input_store(
                                       torch.device("cpu")), streaming=streamed)


def _step(module: CausalLM, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    loss_sum, _ = module.loss_terms(batch)
    loss_sum.backward()
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters()}
    return loss_sum.detach(), grads


def _group_step(module: CausalLM, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`_step` on this rank's shard, its loss and gradients summed over the group (one process's, then)."""
    loss_sum, grads = _step(module, batch)
    dist.all_reduce(loss_sum)
    for g in grads.values():
        dist.all_reduce(g)
    return loss_sum, grads


def _sharded_step(rank: int, world: int, kind: str, seed: int, seq: int, chunk: int) -> dict[str, Any]:
    module = _model(kind, seed)
    backwards = []
    original = streaming._Streamed.backward

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        backwards.append(self.bounds)
        return original(self, *args, **kwargs)

    streaming._Streamed.backward = counted  # this forked rank's own copy of the module
    bind(module, _context(dist.group.WORLD, chunk))
    loss_sum, grads = _group_step(module, shard_batch(_batch(seed, seq), world, rank, chunk))
    return {"loss": loss_sum, "grads": grads, "streamed": backwards}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_streamed_layers_match_one_process(kind: str, fresh_seed: int) -> None:
    """sp=2, packed documents, four chunks per rank, the whole memory stack: loss and every gradient equal one
    process's plain model on the whole batch, and every decoder layer's backward ran streamed."""
    seq, chunk = 64, 16
    results = run_on_ranks(_sharded_step, 2, kind, fresh_seed, seq, chunk)
    reference = _model(kind, fresh_seed)
    ref_loss, ref_grads = _step(reference, _batch(fresh_seed, seq))
    for result in results:
        assert rel_error(result["loss"], ref_loss) <= 1e-10, f"{kind} seed={fresh_seed}: loss"
        for name, g in ref_grads.items():
            assert rel_error(result["grads"][name], g) <= 1e-10, f"{kind} seed={fresh_seed}: {name}"
        assert len(result["streamed"]) == 2 and all(len(b) == 4 for b in result["streamed"]), result["streamed"]


class _WholeSequenceWork(TorchDispatchMode):
    """Records every op computed inside a decoder layer (its forward, or its node's backward) whose result is sized
    by the local sequence length ``s_local`` (a dimension of ``s_local`` tokens, or of ``batch x s_local``)."""

    def __init__(self, s_local: int, batch: int) -> None:
        super().__init__()
        self.sizes = {s_local, s_local * batch}
        self.depth = 0
        self.found: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if self.depth > 0 and not func.is_view and name not in ALLOCATIONS:
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor) and self.sizes & set(t.shape):
                    self.found.append(f"{name} -> {tuple(t.shape)}")
        return out

    def watch(self, layers: list[nn.Module]) -> list[Any]:
        """Count ``layers``' forwards, and their backward nodes' runs, as inside a layer."""
        def enter(*_: Any) -> None:
            self.depth += 1

        def leave(*_: Any) -> None:
            self.depth -= 1

        def after_forward(module: nn.Module, inputs: Any, output: Any) -> None:
            self.depth -= 1
            node = output.grad_fn if isinstance(output, Tensor) else None
            if node is not None:
                node.register_prehook(lambda grads: enter())
                node.register_hook(lambda grads_in, grads_out: leave())

        handles = []
        for layer in layers:
            handles += [layer.register_forward_pre_hook(lambda m, a: enter()),
                        layer.register_forward_hook(after_forward)]
        return handles


def _layers(module: CausalLM) -> list[nn.Module]:
    if isinstance(module, HFCausalLM):
        return [layer for _, layer in decoder_modules(module.model)]
    return [m for m in module.modules() if isinstance(m, FPDTBlock)]


@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_no_layer_work_is_sized_by_the_local_sequence(kind: str, fresh_seed: int) -> None:
    """A full-stack training step with six chunks: inside the decoder layers, forward and backward, no op makes a
    tensor sized by the local sequence (beyond the output and input-gradient buffers a layer fills chunk by chunk);
    the same check fails when layers are recomputed whole, and both give the same loss and gradients."""
    seq, chunk = 96, 16
    batch = shard_batch(_batch(fresh_seed, seq), 1, 0, chunk)
    assert_layer_work_is_chunk_sized(lambda: _model(kind, fresh_seed), _layers, batch, seq, kind)


def assert_layer_work_is_chunk_sized(make: Callable[[], CausalLM], layers_of: Callable[[CausalLM], list[nn.Module]],
                                     batch: dict[str, Tensor], seq: int, label: str) -> None:
    """A full-stack step of ``make()``'s model on ``batch`` (one process, chunks of 16): no op inside its decoder
    layers (``layers_of``) sized by the ``seq`` local tokens when they stream; more than ten when they are recomputed
    whole (the check sees); the same loss and gradients both ways."""
    results, found = [], []
    for streamed in (True, False):
        module = make()
        bind(module, _context(None, 16, streamed))
        watcher = _WholeSequenceWork(seq, 2)
        handles = watcher.watch(layers_of(module))
        with watcher:
            results.append(_step(module, batch))
        for handle in handles:
            handle.remove()
        assert watcher.depth == 0
        found.append(watcher.found)
    assert found[0] == [], f"{label}: whole-sequence work inside a streamed layer: {found[0][:8]}"
    assert len(found[1]) > 10, f"{label}: the check saw nothing in a layer recomputed whole: {found[1]}"
    (loss, grads), (whole_loss, whole_grads) = results
    assert math.isfinite(loss.item()) and rel_error(loss, whole_loss) <= 1e-10, label
    for name, g in whole_grads.items():
        assert rel_error(grads[name], g) <= 1e-10, f"{label}: {name}"

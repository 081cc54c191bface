"""No waste in a bf16-mixed training step (issue 42): no float32 matrix product, each weight cast once, attention
computed once, and the host never waits for the device inside a step.

Under ``precision="bf16-mixed"`` every product runs in the compute dtype (bfloat16: tensor cores on a GPU) and only
accumulations are float32: a float32 product runs without tensor cores (on an H200 the tiled loss's head gradient,
a float32 ``addmm_``, was 15% of a step). A weight is cast to bfloat16 at most once per forward and once per
recomputation of its layer, not once per chunk, MLP tile or loss tile (Lightning's autocast keeps no cast cache). And
a recomputed layer answers its attention from what its forward kept: attention's forward kernel runs as often as its
backward kernel.

A ``TorchDispatchMode`` records every op of one ``Trainer.fit`` step (forward, recomputation, backward, optimizer
step) of the own Llama and of a transformers Llama, through the whole stack (chunked attention, checkpointed and
streamed layers, tiled MLP and loss): the dtypes of every matrix product's operands, every cast of a parameter, and
attention's forward and backward kernel calls.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.attention.kernels import SdpaKernel
from lightning_fpdt.models import LlamaConfig, LlamaLM
from tests.helpers import TokenDataset, dataloader

# the matrix products of aten (and the attention ops, whose q/k/v are products' operands too)
PRODUCTS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "addbmm", "matmul", "linear",
            "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention"}


ATTENTION_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"  # the sdpa backend's kernel on CPU
ATTENTION_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"
CASTS = {"_to_copy", "to", "copy_"}


class StepOps(TorchDispatchMode):
    """Counts each matrix-product op by the dtypes of its tensor operands, each cast of a parameter (an op of
    :data:`CASTS` reading a parameter's storage) by the parameter's name, and attention's kernel calls."""

    def __init__(self, parameters: dict[int, str]) -> None:
        super().__init__()
        self.parameters = parameters  # data pointer -> name
        self.products: collections.Counter[tuple[str, tuple[str, ...]]] = collections.Counter()
        self.casts: collections.Counter[str] = collections.Counter()
        self.attention: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if name in PRODUCTS:
            self.products[(name, tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor)))] += 1
        if name in (ATTENTION_FORWARD, ATTENTION_BACKWARD):
            self.attention[name] += 1
        source = args[-1] if name == "copy_" else args[0]
        if name in CASTS and isinstance(source, torch.Tensor) and source.dtype == torch.float32:
            found = self.parameters.get(source.untyped_storage().data_ptr())
            if found is not None:
                self.casts[found] += 1
        return func(*args, **(kwargs or {}))


class RecordStep(L.Callback):
    """One training step (its batch start to its end: forward, backward, optimizer step) under :class:`StepOps`;
    what it counted written to ``out/step.pt`` (the rank is a forked process). The optimizer's own casts (none
    under AdamW) would count too: they read the parameters after the step's backward. Besides, the attention
    kernel's backward calls made under autocast (``"backward under autocast"``, counted outside the dispatch mode,
    which does not see autocast's state)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.mode: StepOps | None = None
        self.backward: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        local = {name: getattr(p, "_local_tensor", p) for name, p in module.named_parameters()}  # FSDP2: the shard
        mode = self.mode = StepOps({p.untyped_storage().data_ptr(): name for name, p in local.items()})
        self.backward = original = SdpaKernel.backward

        def backward(kernel: SdpaKernel, *args: Any, **kwargs: Any) -> Any:
            if torch.is_autocast_enabled("cpu"):
                mode.attention["backward under autocast"] += 1
            return original(kernel, *args, **kwargs)

        SdpaKernel.backward = backward  # this forked rank's own class
        mode.__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        assert self.mode is not None
        self.mode.__exit__(None, None, None)
        SdpaKernel.backward = self.backward
        torch.save({"products": dict(self.mode.products), "casts": dict(self.mode.casts),
                    "attention": dict(self.mode.attention)}, self.out / "step.pt")


def _own_llama() -> L.LightningModule:
    config = LlamaConfig.tiny(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128)
    return LlamaLM(config, learning_rate=1e-3, warmup_steps=1, loss_tiles=2)


def _hf_llama() -> L.LightningModule:
    transformers = pytest.importorskip("transformers")
    from lightning_fpdt.models import HFCausalLM

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return HFCausalLM(config, learning_rate=1e-3, warmup_steps=1, loss_tiles=2, mlp_tiles=2)


def _fit_one_step(build: Any, out: Path, sharded: bool = False) -> dict[str, Any]:
    """One bf16-mixed step of four chunks, checkpointed layers (streamed), tiled MLP and loss, on one CPU process
    (``sharded``: parameters sharded by FSDP2, whose mixed-precision policy gathers them in bfloat16)."""
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[RecordStep(out)],
                        strategy=FPDTStrategy(chunk_size=16, activation_checkpointing=True, attention_backend="sdpa",
                                              shard_parameters=sharded, start_method="fork"))
    trainer.fit(build(), dataloader(TokenDataset(2, 64, 128, seed=0), 2))
    return torch.load(out / "step.pt")


@pytest.mark.parametrize("build", [_own_llama, _hf_llama], ids=["own-llama", "hf-llama"])
def test_a_bf16_mixed_step_multiplies_no_float32_operands(build: Any, tmp_path: Path) -> None:
    seen = _fit_one_step(build, tmp_path)["products"]
    assert sum(seen.values()) > 20, seen  # the step ran under the recorder: the projections, attention, the head
    float32 = {op: n for op, n in seen.items() if str(torch.float32) in op[1]}
    assert not float32, f"matrix products with a float32 operand in a bf16-mixed step: {float32}"


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "fsdp2"])
@pytest.mark.parametrize("build", [_own_llama, _hf_llama], ids=["own-llama", "hf-llama"])
def test_a_bf16_mixed_step_casts_each_weight_once_per_forward_and_recomputation(build: Any, sharded: bool,
                                                                                tmp_path: Path) -> None:
    """Every layer is checkpointed: its weights are cast in its forward and in its recomputation, at most twice a
    step, however many chunks and tiles; the output layer (untied, not recomputed as a layer) in the loss's forward
    and its backward. Sharded by FSDP2, each shard is cast when it is gathered: for the forward and again for the
    backward."""
    casts = _fit_one_step(build, tmp_path, sharded)["casts"]
    linear = [name for name in casts if "proj" in name or "lm_head" in name or "output" in name]
    assert len(linear) >= 8, casts  # the recorder saw the projections' casts (q, k, v, o, gate, up, down, the head)
    over = {name: n for name, n in casts.items() if n > 2}
    assert not over, f"weights cast more than once per forward and once per recomputation: {over}"


@pytest.mark.parametrize("build", [_own_llama, _hf_llama], ids=["own-llama", "hf-llama"])
def test_a_bf16_mixed_step_computes_attention_once(build: Any, tmp_path: Path) -> None:
    """Checkpointed layers answer their recomputation from the attention their forward kept: as many forward kernel
    calls as backward ones (one per block of every layer)."""
    calls = _fit_one_step(build, tmp_path)["attention"]
    assert calls.get(ATTENTION_BACKWARD, 0) > 0, calls
    assert calls.get(ATTENTION_FORWARD, 0) == calls[ATTENTION_BACKWARD], calls
    # a streamed layer restores autocast around each chunk's own work only: its attention backward runs outside it
    assert calls.get("backward under autocast", 0) == 0, calls


# ops whose result the host must wait for: a value read back (item), or a shape that depends on values (nonzero,
# masked_select, indexing with a boolean mask)
HOST_WAITS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal"}


class HostWaits(TorchDispatchMode):
    """Counts the ops of :data:`HOST_WAITS`, and indexing with a boolean mask (a ``nonzero`` inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        masks = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else ()
        if name in HOST_WAITS or any(isinstance(m, torch.Tensor) and m.dtype == torch.bool for m in masks):
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("build", [_own_llama, _hf_llama], ids=["own-llama", "hf-llama"])
def test_a_step_never_makes_the_host_wait_for_the_device(build: Any) -> None:
    """Forward and backward of the whole stack (four chunks, streamed checkpointed layers with kept attention,
    offload emulated, tiled MLP and loss) under bf16 autocast read nothing back and index with no boolean mask: on a
    GPU each of those is a stream synchronisation, which the tiled loss made three times per tile."""
    from lightning_fpdt.layers.activation_checkpoint import new_layer_input_store
    from lightning_fpdt.layers.loss import token_weighted_loss
    from lightning_fpdt.parallel.batches import shard_batch
    from lightning_fpdt.parallel.binding import SequenceParallelContext, bind

    torch.manual_seed(0)
    module = build()
    context = SequenceParallelContext(chunk_size=16, attention_backend="sdpa", offload=True,
                                      activation_checkpointing=True, keep_attention=True,
                                      layer_input_store=new_layer_input_store(torch.device("cpu")))
    bind(module, context)
    batch = shard_batch({"input_ids": torch.randint(0, 128, (2, 64))}, 1, 0, 16)
    with HostWaits() as waits:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = token_weighted_loss(*module.loss_terms(batch))
        loss.backward()
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)  # the step ran under the counter
    assert not waits.seen, f"ops that make the host wait for the device in a training step: {dict(waits.seen)}"

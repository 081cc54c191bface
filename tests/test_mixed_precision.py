"""No matrix product of a bf16-mixed training step multiplies float32 operands (issue 42).

Under ``precision="bf16-mixed"`` every product runs in the compute dtype (bfloat16: tensor cores on a GPU) and only
accumulations are float32: a float32 product runs without tensor cores (on an H200 the tiled loss's head gradient,
a float32 ``addmm_``, was 15% of a step). A ``TorchDispatchMode`` records every matrix-product op of one
``Trainer.fit`` step (forward, recomputation, backward, optimizer step) of the own Llama and of a transformers Llama,
through the whole stack (chunked attention, checkpointed and streamed layers, tiled MLP and loss), and the test fails
on a product with a float32 operand.
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
from lightning_fpdt.models import LlamaConfig, LlamaLM
from tests.helpers import TokenDataset, dataloader

# the matrix products of aten (and the attention ops, whose q/k/v are products' operands too)
PRODUCTS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "addbmm", "matmul", "linear",
            "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention"}


class ProductDtypes(TorchDispatchMode):
    """Counts each matrix-product op by the dtypes of its tensor operands."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[tuple[str, tuple[torch.dtype, ...]]] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if name in PRODUCTS:
            self.seen[(name, tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))] += 1
        return func(*args, **(kwargs or {}))


class RecordStep(L.Callback):
    """One training step (its batch start to its end: forward, backward, optimizer step) under
    :class:`ProductDtypes`; the counts written to ``out/products.pt`` (the rank is a forked process)."""

    def __init__(self, out: Path) -> None:
        self.out, self.mode = out, ProductDtypes()

    def on_train_batch_start(self, *args: Any) -> None:
        self.mode.__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        self.mode.__exit__(None, None, None)
        torch.save({(op, tuple(str(d) for d in dtypes)): n for (op, dtypes), n in self.mode.seen.items()},
                   self.out / "products.pt")


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


@pytest.mark.parametrize("build", [_own_llama, _hf_llama], ids=["own-llama", "hf-llama"])
def test_a_bf16_mixed_step_multiplies_no_float32_operands(build: Any, tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[RecordStep(tmp_path)],
                        strategy=FPDTStrategy(chunk_size=16, activation_checkpointing=True, attention_backend="sdpa",
                                              start_method="fork"))
    trainer.fit(build(), dataloader(TokenDataset(2, 64, 128, seed=0), 2))
    seen = torch.load(tmp_path / "products.pt")
    assert sum(seen.values()) > 20, seen  # the step ran under the recorder: the projections, attention, the head
    float32 = {op: n for op, n in seen.items() if str(torch.float32) in op[1]}
    assert not float32, f"matrix products with a float32 operand in a bf16-mixed step: {float32}"

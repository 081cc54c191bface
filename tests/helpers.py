"""Shared pieces of the Trainer-level tests: data, gradient capture, the single-process reference."""

from __future__ import annotations

import copy
import inspect
import os
import signal
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from lightning_fpdt.hf.kernel_binding import kernel_function
from lightning_fpdt.layers.loss import token_weighted_loss
from lightning_fpdt.offload.memtrack import peak_step_bytes
from lightning_fpdt.parallel.dtensors import full_tensor, local_tensor
from tests.reference import rel_error


class TokenDataset(Dataset):
    """Fixed random samples: ``input_ids``, ``labels`` with a ragged run of ignored (-100) positions
    so every rank holds a different number of valid tokens, and an ``index`` that is not a sequence."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int, with_labels: bool = True) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)
        self.labels = self.ids.clone()
        for i in range(n):  # ignore a different-length tail (padding) and a few random positions
            tail = int(torch.randint(0, seq_len // 2, (1,), generator=g))
            if tail:
                self.labels[i, -tail:] = -100
            self.labels[i, torch.randint(0, seq_len, (2,), generator=g)] = -100
        self.with_labels = with_labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = {"input_ids": self.ids[i], "index": i}
        if self.with_labels:
            item["labels"] = self.labels[i]
        return item

    def full_batch(self) -> dict[str, torch.Tensor]:
        batch = {"input_ids": self.ids}
        if self.with_labels:
            batch["labels"] = self.labels
        return batch


class CaptureStep(L.Callback):
    """Saves, on every rank, the synchronised gradients, the logged loss and the sample indices of
    the first optimizer step."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.indices: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.indices = [int(i) for i in batch["index"]]
        self.seq_keys = {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = {n: full_tensor(p.grad).detach().clone() for n, p in pl_module.named_parameters()}
        local = sum(local_tensor(p).numel() for p in pl_module.parameters())  # elements this rank holds
        self._pending = {"grads": grads, "indices": self.indices, "shapes": self.seq_keys, "local_numel": local,
                         "numel": sum(g.numel() for g in grads.values())}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            self._pending["loss"] = trainer.callback_metrics["train/loss"].detach().clone()
            torch.save(self._pending, Path(self.out_dir) / f"rank{trainer.global_rank}.pt")


def dataloader(ds: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, shuffle=False)


def reference_step(
    module: L.LightningModule, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of the same module in one process on the whole batch (no strategy)."""
    ref = copy.deepcopy(module).double()
    loss, mean = token_weighted_loss(*ref.loss_terms(batch))
    loss.backward()
    return mean.detach(), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def assert_same_step(
    results: list[dict], ref_loss: torch.Tensor, ref_grads: dict[str, torch.Tensor], tol: float, label: str
) -> None:
    for res in results:
        assert res["grads"].keys() == ref_grads.keys()
    for rank, what, err in step_errors(results, ref_loss, ref_grads):
        assert err <= tol, f"{label} rank {rank}: {what} rel. error {err:.2e}"


def step_errors(
    results: list[dict], ref_loss: torch.Tensor, ref_grads: dict[str, torch.Tensor]
) -> Iterator[tuple[int, str, float]]:
    """``(rank, what, relative error)`` of each rank's loss and every gradient against the reference.

    Some gradients are exactly zero in exact arithmetic (a key bias shifts every logit of a row equally,
    and softmax ignores that), so both sides are rounding noise. Errors are relative to the parameter's
    own gradient or 1e-3 of the largest gradient in the model, whichever is larger.
    """
    floor = 1e-3 * max(g.abs().max().item() for g in ref_grads.values())
    for rank, res in enumerate(results):
        yield rank, f"loss {res['loss'].item()} vs {ref_loss.item()}:", rel_error(res["loss"], ref_loss)
        for name, g in ref_grads.items():
            err = (res["grads"][name] - g).abs().max() / max(g.abs().max().item(), floor)
            yield rank, f"grad of {name}", err.item()


def in_float64(function: Any) -> Any:
    """A family's kernel or method (wrapped by transformers' decorators, which are applied again; a plain function
    or, as transformers 5.25 binds kernels, a ``kernels`` ``Func`` module) compiled again from its own source in the
    family's namespace, every float32 read as float64."""
    plain = inspect.unwrap(kernel_function(function) or function)
    lines = textwrap.dedent(inspect.getsource(plain)).splitlines()
    source = "\n".join(x for x in lines if not x.startswith("@auto_docstring"))  # needs the class; docs only
    source = source.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    namespace: dict[str, Any] = {}
    exec(source, plain.__globals__, namespace)  # transformers' own source, one dtype changed
    return namespace[plain.__name__]


def _casts_to_float32(function: Any) -> bool:
    return any(f in inspect.getsource(function) for f in ("torch.float32", ".float()"))


def float32_classes(family: Any) -> list[type]:
    """The module classes of a family whose forward computes in float32 whatever its input (norms, the recurrent
    layers' ``A_log.float()``): their gradients are summed over the sequence in float32."""
    return [c for c in vars(family).values() if isinstance(c, type) and issubclass(c, torch.nn.Module)
            and c.__module__ == family.__name__ and c.forward is not torch.nn.Module.forward
            and _casts_to_float32(c.forward)]


def float32_functions(family: Any, names: Iterable[str]) -> list[str]:
    """Of ``names``, the module-level functions of a family (plain or ``kernels`` ``Func`` modules, as releases bind
    them) that compute in float32 whatever their input (transformers 5.25's ``mamba2_scan_forward`` reads
    ``A_log.float()``, which 5.24's forward read itself); names the family does not have are left out."""
    found = []
    for name in names:
        plain = kernel_function(getattr(family, name, None))
        if plain is not None and inspect.unwrap(plain).__module__ == family.__name__ and _casts_to_float32(plain):
            found.append(name)
    return found


def training_step_peak(module: torch.nn.Module, batch: dict[str, Any], optimizer: torch.optim.Optimizer, *,
                       reduce_gradients: bool = True, bf16: bool = False, resizable: bool = False) -> int:
    """The peak of live tensors of one training step of ``module`` on ``batch`` (the token-weighted loss, its
    backward, every gradient all-reduced over the world unless ``reduce_gradients`` is off (FSDP2 reduces its own),
    the optimizer step), measured on a second step: the first creates the optimizer state. ``bf16``: the loss under
    bf16 autocast; ``resizable``: :func:`~lightning_fpdt.offload.memtrack.peak_step_bytes`'s (FSDP2's resized
    storages)."""

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = token_weighted_loss(*module.loss_terms(batch))
        loss.backward()
        if reduce_gradients:
            for p in module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    return peak_step_bytes(step, module, optimizer, resizable=resizable)


class KillRank(L.Callback):
    """SIGKILL this process when it is global rank ``rank`` and its training batch ``batch`` starts: as the kernel's
    out-of-memory killer or a scheduler stops a process (no error, no output). For a YAML's ``trainer.callbacks``."""

    def __init__(self, rank: int = 1, batch: int = 1) -> None:
        self.rank, self.batch = rank, batch

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)

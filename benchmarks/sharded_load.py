"""Peak host memory and time of loading a safetensors checkpoint under ``FPDTStrategy(shard_parameters=True)``.

    python benchmarks/sharded_load.py                        # 1.5B-parameter Llama (float32, 6.2 GB), 4 ranks
    python benchmarks/sharded_load.py --layers 4 --dir /tmp/ckpt   # 0.3B, the checkpoint kept for another run

It writes a random float32 Llama checkpoint itself (vocabulary 32000, hidden 2048, intermediate 5632, 32 heads,
8 KV heads, ``--layers`` decoder layers; safetensors files of at most ``--file-gb`` with an index, as
``save_pretrained`` writes them), then runs ``Trainer.validate`` on ``--world`` CPU processes
(gloo) for each mode and reports, per rank, the peak resident memory (``ru_maxrss``, interpreter included: the
"start" column is the peak before the strategy's setup) and the time from the start of setup to the start of
validation (FSDP2 sharding, reading, the mask probe). ``Trainer.validate`` sets the strategy up as ``fit`` does,
without an optimizer (AdamW's state is created at the first step anyway) and without the weights Lightning's fork
launcher sends back to this process after ``fit``:

- ``own-rows``: ``HFCausalLM(path)`` is built on the meta device and each rank reads the rows of each tensor
  it owns (``HFCausalLM.load_sharded_weights``: what the library does);
- ``scatter``: the same meta-device model, but rank 0 reads each tensor whole and scatters the rows to the
  others (``dist.scatter``; the alternative the issue asks to measure);

The page cache is not dropped between modes (no root here): every mode reads from memory after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.utils.data import DataLoader
from transformers import LlamaConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import print_table

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.hf.weights import build_on_meta, compute_buffers
from lightning_fpdt.models import HFCausalLM
from lightning_fpdt.models.weight_files import SafetensorsFiles, owned_rows

MiB = 2**20


def llama_config(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                       max_position_embeddings=4096, dtype="float32")


def write_checkpoint(directory: Path, config: LlamaConfig, file_bytes: int) -> int:
    """Random float32 weights of ``config`` in safetensors files of at most ``file_bytes`` and an index, written
    file by file (one file's tensors in memory at a time). Returns the bytes of weights."""
    config.save_pretrained(str(directory))
    shapes = {name: tuple(p.shape) for name, p in build_on_meta(config, torch.float32).named_parameters()}
    g = torch.Generator().manual_seed(0)
    files: list[dict[str, torch.Tensor]] = [{}]
    size, total = 0, 0
    for name, shape in shapes.items():
        nbytes = 4 * torch.Size(shape).numel()
        if files[-1] and size + nbytes > file_bytes:
            _flush(directory, files, len(files))
            files.append({})
            size = 0
        files[-1][name] = (torch.randn(shape, generator=g) / shape[-1] ** 0.5 if len(shape) > 1
                           else torch.ones(shape))
        size, total = size + nbytes, total + nbytes
    _flush(directory, files, len(files))
    count = len(files)
    weight_map = {}
    for i in range(1, count + 1):
        tmp = directory / f"part-{i}.safetensors"
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        tmp.rename(directory / final)
        weight_map.update({name: final for name in json.loads((directory / f"part-{i}.json").read_text())})
        (directory / f"part-{i}.json").unlink()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def _flush(directory: Path, files: list[dict[str, torch.Tensor]], number: int) -> None:
    tensors = files[-1]
    save_file(tensors, str(directory / f"part-{number}.safetensors"), metadata={"format": "pt"})
    (directory / f"part-{number}.json").write_text(json.dumps(sorted(tensors)))
    files[-1] = {}


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class Measure(L.Callback):
    """Peak RSS before and after the strategy's setup and its duration, written per rank."""

    def __init__(self, out: str) -> None:
        self.out = out

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.start_peak, self.t0 = _peak_mib(), time.perf_counter()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        held = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                   for p in pl_module.parameters())
        result = {"start": self.start_peak, "peak": _peak_mib(), "seconds": time.perf_counter() - self.t0,
                  "held": held / MiB}
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def scatter_shards(self: HFCausalLM, device: torch.device | str) -> None:
    """The alternative: rank 0 reads each tensor whole and scatters each rank's rows (padded to equal chunks)."""
    checkpoint, self._checkpoint = self._checkpoint, None
    self.to_empty(device=device)
    compute_buffers(self.model)
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for name, param in self.model.named_parameters():
            rows = owned_rows(param, name, "benchmark")
            chunk = -(-param.shape[0] // world)
            out = torch.empty((chunk, *param.shape[1:]), dtype=param.dtype)
            pieces = None
            if rank == 0:
                full = checkpoint.read(name).to(param.dtype)
                padded = torch.zeros((chunk * world, *param.shape[1:]), dtype=param.dtype)
                padded[:full.shape[0]] = full
                pieces = list(padded.chunk(world))
                del full
            dist.scatter(out, pieces, src=0)
            param.to_local().copy_(out[:rows[1] - rows[0]])


def run_mode(mode: str, directory: Path, world: int) -> list[dict]:
    out = tempfile.mkdtemp(prefix="sharded_load_")
    module = HFCausalLM(str(directory))
    assert module.weights_pending
    if mode == "scatter":
        module.load_sharded_weights = scatter_shards.__get__(module)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, limit_val_batches=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Measure(out)],
        strategy=FPDTStrategy(sequence_parallel_size=world, chunk_size=None, shard_parameters=True,
                              start_method="fork"),
    )
    data = [{"input_ids": torch.zeros(8 * world, dtype=torch.long)}]
    # validate: the same setup as fit (configure_model, FSDP2, the read), and no weights sent back to this process
    trainer.validate(module, DataLoader(data, batch_size=1), verbose=False)
    results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    shutil.rmtree(out)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=31, help="decoder layers (31: 1.53B parameters)")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--file-gb", type=float, default=2.0, help="largest safetensors file")
    parser.add_argument("--modes", nargs="+", default=["own-rows", "scatter"], choices=["own-rows", "scatter"])
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    args = parser.parse_args()
    config = llama_config(args.layers)
    directory = Path(args.dir or tempfile.mkdtemp(prefix="fpdt_ckpt_"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        if SafetensorsFiles.find(directory) is None:
            total = write_checkpoint(directory, config, int(args.file_gb * 2**30))
        else:
            files = set(SafetensorsFiles.find(directory).files.values())
            total = sum((directory / f).stat().st_size for f in files)
        write_s = time.perf_counter() - t0
        params = total // 4
        files = len(set(SafetensorsFiles.find(directory).files.values()))
        print(f"checkpoint: {params / 1e9:.2f}B parameters, {total / 2**30:.2f} GiB float32 in {files} files"
              f" (written in {write_s:.0f} s); {args.world} ranks; limit per rank = model / {args.world} + 1.5 GiB"
              f" = {total / args.world / MiB + 1536:.0f} MiB")
        rows = []
        for mode in args.modes:
            for rank, r in enumerate(run_mode(mode, directory, args.world)):
                print(f"{mode} rank {rank}: {r}", flush=True)
                limit = total / args.world / MiB + 1536
                rows.append([mode, rank, round(r["start"]), round(r["peak"]), round(r["held"]),
                             round(r["peak"] - r["start"]), f"{r['seconds']:.1f}",
                             f"{r['seconds'] / (total / 1e9):.2f}", "yes" if r["peak"] <= limit else "NO"])
        print_table(["mode", "rank", "start MiB", "peak MiB", "shards MiB", "peak - start", "setup s", "s/GB",
                     "within limit"], rows)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()

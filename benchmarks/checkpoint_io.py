"""Time and peak host memory of moving a run's checkpoints out (``fpdt-export``) on CPU, per GB of weights.

    python benchmarks/checkpoint_io.py                      # 0.31B-parameter Llama, float32 (1.25 GB of weights)
    python benchmarks/checkpoint_io.py --layers 16 --keep /tmp/ckpts   # 0.85B; kept (and used again if there)

It writes its own checkpoints (nothing is downloaded) into a temporary directory, removed at the end: an
``HFCausalLM`` of a transformers Llama (vocabulary 32000, hidden 2048, intermediate 5632, 32 heads, 8 KV heads,
``--layers`` decoder layers; the shape of ``benchmarks/sharded_load.py``), trained one AdamW step by
``Trainer.fit`` on ``--world`` CPU processes (gloo) and saved by ``ModelCheckpoint`` as a run saves it:

- ``replicated``: one ``.ckpt`` file (``FPDTStrategy`` without ``shard_parameters``);
- ``sharded``: the torch distributed checkpoint directory of ``shard_parameters=True`` (each rank its shards).

Both hold the AdamW state beside the weights, as a run's checkpoints do (the export reads only the weights).

Each measurement is one function returning a :class:`Row`; its call runs in a fresh Python process (``--child``)
``--repeats`` times (the median time and the largest peak are shown), so that its peak resident memory is its
own (``VmHWM``, which a new process image starts afresh, unlike ``ru_maxrss``): the ``start`` column is the
resident memory just before the measured call (interpreter, torch, transformers), ``peak`` the maximum during it.

- :func:`measure_export`: ``lightning_fpdt.export.hf_directory.export(ckpt, out, dtype=..., max_shard_size=...)``, what
  ``fpdt-export CKPT OUT [--dtype bfloat16] [--max-shard-size 5GB]`` runs, into a fresh directory; ``GB written``
  is the size of that directory. It holds one safetensors file's tensors at a time (``--max-shard-size``), and
  a ``.ckpt`` file is memory-mapped: the weights' pages it reads count in its resident memory (file-backed).

Another measurement (loading) is added the same way: a ``measure_<what>`` function returning a :class:`Row`, and
a ``--child <what>`` branch in :func:`child` for the measured call.

``s/GB`` is seconds per GB (10^9 bytes) of float32 weights in the checkpoint. The checkpoints have just been
written, so they are read from the page cache (the cache cannot be dropped without root): the figures are the
CPU and memory cost of the export, and a disk's speed adds to them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import print_table

MiB = 2**20
SHARDINGS = ("replicated", "sharded")
DTYPES = ("float32", "bfloat16")


class Row(NamedTuple):
    """One measurement: ``what`` was done to the checkpoint of ``sharding`` in ``dtype``."""

    what: str
    sharding: str
    dtype: str
    seconds: float  # the median of the repeats
    gb_weights: float  # float32 weights in the checkpoint, 10^9 bytes
    gb_written: float
    start_mib: float
    peak_mib: float  # the largest of the repeats

    def cells(self) -> list:
        written = f"{self.gb_written:.3g}" if self.gb_written else "-"
        return [self.what, self.sharding, self.dtype, f"{self.seconds:.3g}", f"{self.gb_weights:.3g}", written,
                f"{self.seconds / self.gb_weights:.2f}", round(self.start_mib), round(self.peak_mib),
                round(self.peak_mib - self.start_mib)]


HEADERS = ["what", "checkpoint", "dtype", "seconds", "GB weights", "GB written", "s/GB", "start MiB", "peak MiB",
           "peak - start"]


# ---- the checkpoints ------------------------------------------------------------------------------------------


def llama_config(layers: int, hidden: int, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                       num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                       num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=False,
                       max_position_embeddings=4096)


def write_run_checkpoint(directory: Path, sharding: str, config, world: int) -> Path:
    """One ``Trainer.fit`` step (AdamW) of ``HFCausalLM(config)`` on ``world`` CPU ranks, sequence parallel over
    all of them, and the checkpoint ``ModelCheckpoint`` writes (``model.ckpt``: a file, or a directory when
    ``sharding == "sharded"``)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_fpdt import FPDTStrategy
    from lightning_fpdt.models import HFCausalLM

    torch.manual_seed(0)
    module = HFCausalLM(config)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=str(directory), filename="model",
                                                       every_n_train_steps=1)],
        strategy=FPDTStrategy(sequence_parallel_size=world, chunk_size=None, shard_parameters=sharding == "sharded",
                              start_method="fork"),
    )
    data = [{"input_ids": torch.randint(0, config.vocab_size, (16 * world,))}]
    trainer.fit(module, DataLoader(data, batch_size=1))
    return directory / "model.ckpt"


# ---- the measurements (each in a fresh process: python checkpoint_io.py --child WHAT ...) --------------------


def measure_export(ckpt: Path, out: Path, sharding: str, dtype: str, gb_weights: float, repeats: int,
                   max_shard_size: str) -> Row:
    """``fpdt-export ckpt out --dtype dtype --max-shard-size ...`` in fresh processes: its time, the bytes it
    wrote, its peak resident memory."""
    results = []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        results.append(_child("export", str(ckpt), str(out), dtype, max_shard_size))
    written = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return Row("export", sharding, dtype, statistics.median(r["seconds"] for r in results), gb_weights,
               written / 1e9, min(r["start_mib"] for r in results), max(r["peak_mib"] for r in results))


def _child(what: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", what, *args], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"checkpoint_io --child {what} {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _status_mib(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak since this process image started), in MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB


def child(what: str, args: list[str]) -> None:
    """The measured call of ``what``, after the imports; prints ``{"seconds", "start_mib", "peak_mib"}``."""
    if what == "export":
        import torch

        from lightning_fpdt.export.hf_directory import export

        ckpt, out, dtype, max_shard_size = args
        start = _status_mib("VmRSS")
        t0 = time.perf_counter()
        export(ckpt, out, dtype=getattr(torch, dtype), max_shard_size=max_shard_size)
        seconds = time.perf_counter() - t0
    else:
        raise SystemExit(f"checkpoint_io: unknown --child {what!r}")
    print(json.dumps({"seconds": seconds, "start_mib": start, "peak_mib": _status_mib("VmHWM")}))


# ---- main -----------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (4: 0.31B parameters)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--world", type=int, default=2, help="CPU ranks of the run that writes the checkpoints")
    parser.add_argument("--shardings", nargs="+", default=list(SHARDINGS), choices=SHARDINGS)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--max-shard-size", default="5GB", help="fpdt-export's bytes per safetensors file")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per measurement (median time)")
    parser.add_argument("--keep", default=None, help="write into this directory and keep it (default: a temporary one)")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1:])
        return
    config = llama_config(args.layers, args.hidden, args.vocab)
    root = Path(args.keep or tempfile.mkdtemp(prefix="fpdt_checkpoint_io_"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for sharding in args.shardings:
            t0 = time.perf_counter()
            ckpt = root / sharding / "model.ckpt"
            if not ckpt.exists():  # a kept directory's checkpoint is used again (same sizes assumed)
                ckpt = write_run_checkpoint(root / sharding, sharding, config, args.world)
            files = [ckpt] if ckpt.is_file() else [f for f in ckpt.rglob("*") if f.is_file()]
            size = sum(f.stat().st_size for f in files)
            import torch

            from lightning_fpdt.models import HFCausalLM

            with torch.device("meta"):
                params = sum(p.numel() for p in HFCausalLM(config).parameters())
            gb = params * 4 / 1e9
            print(f"{sharding}: {params / 1e9:.2f}B parameters ({gb:.2f} GB float32), checkpoint {size / 1e9:.2f} GB"
                  f" (with AdamW state), ready in {time.perf_counter() - t0:.0f} s", flush=True)
            for dtype in args.dtypes:
                out = root / f"hf_{sharding}_{dtype}"
                row = measure_export(ckpt, out, sharding, dtype, gb, args.repeats, args.max_shard_size)
                print(f"  {row}", flush=True)
                rows.append(row.cells())
                shutil.rmtree(out)
        print_table(HEADERS, rows)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

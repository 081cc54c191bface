"""HFDataModule throughput: tokenization and packing of a generated corpus, and the data loader's share of a
training step on the CPU example configs.

    python benchmarks/data.py --text-mb 50 --chat-mb 10 --num-proc 2 --steps 10

1. Writes a jsonl corpus of ``--text-mb`` MB of documents and ``--chat-mb`` MB of conversations
   (:mod:`lightning_fpdt.data.toy`, no download) and runs ``HFDataModule.prepare_data`` on each with
   ``--num-proc`` tokenizer processes and a fresh cache: tokens per second per process for tokenization
   (reading, tokenizing, chat rendering) and for packing (with the cache writes), and the packed fill.
2. Trains ``--steps`` steps of examples/configs/hf_sft_cpu.yaml and hf_text_cpu.yaml (2 CPU processes) and
   measures, on rank 0, the time between a step's end and the next step's start (where Lightning fetches
   the next batch) against the step itself, after the first batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402

from benchmarks.common import print_table  # noqa: E402
from lightning_fpdt.cli import FPDTCLI  # noqa: E402
from lightning_fpdt.data.hf_datamodule import HFDataModule  # noqa: E402
from lightning_fpdt.data.toy import conversations, documents  # noqa: E402
from lightning_fpdt.models import CausalLM  # noqa: E402

TOKENIZER = str(ROOT / "examples" / "data" / "tokenizer")


def write_corpus(path: Path, rows, megabytes: float) -> int:
    """Rows of ``rows`` as jsonl until the file holds ``megabytes`` MB; returns the rows written."""
    limit, n = megabytes * 1e6, 0
    with open(path, "w") as f:
        for row in rows:
            if f.tell() >= limit:
                break
            f.write(json.dumps(row) + "\n")
            n += 1
    return n


def throughput(files: Path, fmt: str, seq_len: int, num_proc: int, cache: Path) -> list:
    data = HFDataModule(str(files), tokenizer=TOKENIZER, format=fmt, seq_len=seq_len, num_proc=num_proc,
                        cache_dir=str(cache))
    data.prepare_data()
    data.setup("fit")
    meta = data.stats
    tokens = meta["train"]["tokens"]
    return [fmt, f"{os.path.getsize(files) / 1e6:.1f}", meta["train"]["documents"], tokens, num_proc,
            tokens / meta["tokenize_s"] / num_proc, tokens / meta["pack_s"], f"{meta['train']['fill']:.1%}"]


class StepTimer(L.Callback):
    """Rank 0: per step, the seconds from the previous step's end to this step's start (the data loader's
    next batch, plus Lightning's loop) and the step itself; written to ``out`` at the end."""

    def __init__(self, out: str) -> None:
        self.out, self.gaps, self.steps, self.last_end, self.start = out, [], [], None, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = time.perf_counter()
        if self.last_end is not None:
            self.gaps.append(self.start - self.last_end)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.last_end = time.perf_counter()
        self.steps.append(self.last_end - self.start)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            Path(self.out).write_text(json.dumps({"gaps": self.gaps, "steps": self.steps}))


def loader_share(config: str, steps: int, cache: Path) -> list:
    out = cache / f"{Path(config).stem}.json"
    args = ["--config", config, f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
            "--trainer.strategy.init_args.start_method=fork", f"--data.init_args.cache_dir={cache}"]
    cli = FPDTCLI(CausalLM, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                  args=args, save_config_callback=None)
    cli.trainer.callbacks.append(StepTimer(str(out)))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    timing = json.loads(out.read_text())
    gaps, times = timing["gaps"][1:], timing["steps"][1:]  # after the first batch
    step, gap = sum(times) / len(times), sum(gaps) / len(gaps)
    return [Path(config).name, len(times), step * 1e3, gap * 1e3, f"{gap / (gap + step):.1%}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text-mb", type=float, default=50.0)
    parser.add_argument("--chat-mb", type=float, default=10.0)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_corpus(tmp / "text.jsonl", documents(10**9, seed=0, max_sentences=40), args.text_mb)
        write_corpus(tmp / "chat.jsonl", conversations(10**9, seed=0), args.chat_mb)
        rows = [throughput(tmp / f"{fmt}.jsonl", fmt, args.seq_len, args.num_proc, tmp / "cache")
                for fmt in ("text", "chat")]
        print_table(["format", "MB", "documents", "tokens", "processes", "tokenize tok/s per process",
                     "pack tok/s", "fill"], rows)
        os.chdir(ROOT)  # the configs name examples/data/ relative to the repository
        rows = [loader_share(f"examples/configs/{name}.yaml", args.steps, tmp / "cache")
                for name in ("hf_sft_cpu", "hf_text_cpu")]
        print_table(["config", "steps timed", "step ms", "between steps ms", "loader share"], rows)


if __name__ == "__main__":
    main()

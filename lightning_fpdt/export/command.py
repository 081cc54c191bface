"""``fpdt-export``, the command: its arguments, and each refusal as one line on stderr (exit status 2 for an
argument, 1 for a checkpoint, model or output directory), around :func:`~lightning_fpdt.export.hf_directory.export`
and :func:`~lightning_fpdt.export.adapter.export_adapter`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from lightning_fpdt.export.adapter import export_adapter
from lightning_fpdt.export.checks import OWNER, export_dtype, shard_bytes
from lightning_fpdt.export.hf_directory import export


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not the usage block: exit status 2 (a usage error)
        self.exit(2, f"fpdt-export: error: {message} (fpdt-export --help lists the arguments)\n")


def main(argv: list[str] | None = None) -> None:
    """``fpdt-export CKPT OUT [--config FIT_YAML] [--dtype bf16] [--max-shard-size 5GB] [--tokenizer DIR]
    [--overwrite] [--adapter]``: exit status 0 when written, 2 for arguments it refuses, 1 for a checkpoint, model or
    output directory it refuses; each refusal one line on stderr, naming the problem and the fix."""
    parser = _Parser(prog="fpdt-export", description="A run's checkpoint as a Hugging Face directory.")
    parser.add_argument("ckpt", help="a .ckpt file or a sharded checkpoint directory")
    parser.add_argument("out", help="the Hugging Face directory to write")
    parser.add_argument("--config", default=None, help="the fit's LightningCLI YAML (default: saved hyper-parameters)")
    parser.add_argument("--dtype", default=None, type=_argument(export_dtype),
                        help="float32 (fp32), bfloat16 (bf16), float16 (fp16) or float64 (default: the trained dtype)")
    parser.add_argument("--max-shard-size", default="5GB", type=_argument(shard_bytes),
                        help="bytes per safetensors file: 5GB, 500MB, 2GiB, ...")
    parser.add_argument("--tokenizer", default=None, help="copy the tokenizer files of this directory")
    parser.add_argument("--overwrite", action="store_true", help="replace the model files OUT already holds")
    parser.add_argument("--adapter", action="store_true", help="a LoRA run's adapter in peft's format, not merged")
    args = parser.parse_args(argv)
    try:
        out = (export_adapter(args.ckpt, args.out, args.config, args.dtype, args.tokenizer, args.overwrite)
               if args.adapter else export(args.ckpt, args.out, args.config, args.dtype, args.max_shard_size,
                                           args.tokenizer, args.overwrite))
    except (ValueError, TypeError, OSError, NotImplementedError) as err:  # CheckpointError is a ValueError
        message = " ".join(str(err).split())
        ours = message.startswith(OWNER.strip())  # else another library's (a disk full): its kind shows too
        message = message.removeprefix(OWNER.strip()).strip() if ours else f"{type(err).__name__}: {message}"
        print(f"fpdt-export: error: {message}", file=sys.stderr)
        sys.exit(1)
    print(f"fpdt-export: wrote {out}")


def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its ValueError's message (without the program's name) is the usage error."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(OWNER)) from None

    convert.__name__ = parse.__name__
    return convert

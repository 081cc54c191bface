"""``fpdt-train``: the LightningCLI entry point.

    fpdt-train fit --config examples/configs/tiny_cpu.yaml
    fpdt-train validate --config ... --ckpt_path ...
    fpdt-train fit --config ... --print_config

The strategy is given by name (``strategy: fpdt``) or by ``class_path: lightning_fpdt.FPDTStrategy``
with its options; the model and data by ``class_path``.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

import lightning_fpdt  # noqa: F401  (registers the "fpdt" strategy names)
from lightning_fpdt.data import PasskeyDataModule
from lightning_fpdt.models import CausalLM, LlamaLM


class FPDTCLI(LightningCLI):
    """LightningCLI with the project's models and data modules as defaults."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.set_defaults({"model": {"class_path": "lightning_fpdt.models.LlamaLM"},
                             "data": {"class_path": "lightning_fpdt.data.PasskeyDataModule"}})


def run(args: list[str] | None = None) -> FPDTCLI:
    """Run the CLI (``args`` defaults to ``sys.argv[1:]``) and return it."""
    return FPDTCLI(
        CausalLM,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def main() -> None:
    """The ``fpdt-train`` console script."""
    run(sys.argv[1:])


__all__ = ["FPDTCLI", "LlamaLM", "PasskeyDataModule", "main", "run"]

if __name__ == "__main__":
    main()

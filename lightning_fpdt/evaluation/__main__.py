"""``python -m lightning_fpdt.evaluation``: the ``fpdt-eval`` command (see ``command.py``)."""

from lightning_fpdt.evaluation.command import main

main()

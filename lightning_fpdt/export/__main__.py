"""``python -m lightning_fpdt.export``: ``fpdt-export``."""

from lightning_fpdt.export.command import main

main()

"""``fpdt-export`` and the ``HFExport`` callback: a run's checkpoint as a Hugging Face directory
(``hf_directory``), what is checked before anything is written (``checks``), and a LoRA run's adapter in peft's
format (``adapter``)."""

from lightning_fpdt.export.hf_directory import HFExport, export, main

__all__ = ["HFExport", "export", "main"]

"""``fpdt-export`` and the ``HFExport`` callback: a run's checkpoint as a Hugging Face directory
(``hf_directory``), what is checked before anything is written (``checks``), a LoRA run's adapter in peft's format
(``adapter``), and the command line (``command``)."""

from lightning_fpdt.export.command import main
from lightning_fpdt.export.hf_directory import HFExport, export

__all__ = ["HFExport", "export", "main"]

"""Reference models built from ``FPDTBlock``."""

from lightning_fpdt.models.llama import Llama, LlamaConfig, LlamaLM
from lightning_fpdt.models.lm import CausalLM

__all__ = ["CausalLM", "Llama", "LlamaConfig", "LlamaLM"]

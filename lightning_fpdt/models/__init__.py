"""Reference models built from ``FPDTBlock``."""

from lightning_fpdt.models.gpt import GPT, GPTLM, GPTConfig
from lightning_fpdt.models.llama import Llama, LlamaConfig, LlamaLM
from lightning_fpdt.models.lm import CausalLM

__all__ = ["GPT", "CausalLM", "GPTConfig", "GPTLM", "Llama", "LlamaConfig", "LlamaLM"]

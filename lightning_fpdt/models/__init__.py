"""Reference models built from ``FPDTBlock``, and :class:`HFCausalLM` around any Hugging Face causal LM."""

from typing import Any

from lightning_fpdt.models.gpt import GPT, GPTLM, GPTConfig
from lightning_fpdt.models.llama import Llama, LlamaConfig, LlamaLM
from lightning_fpdt.models.lm import CausalLM

__all__ = ["GPT", "CausalLM", "GPTConfig", "GPTLM", "HFCausalLM", "Llama", "LlamaConfig", "LlamaLM"]


def __getattr__(name: str) -> Any:
    # HFCausalLM needs transformers, an optional extra ("hf"): imported on first use, so the package
    # imports without it
    if name == "HFCausalLM":
        try:
            from lightning_fpdt.models.hf_causal_lm import HFCausalLM
        except ModuleNotFoundError as err:
            if err.name != "transformers":
                raise
            raise ModuleNotFoundError(
                "lightning_fpdt.models.HFCausalLM needs transformers: pip install 'lightning-fpdt[hf]'."
            ) from err
        return HFCausalLM
    raise AttributeError(f"module 'lightning_fpdt.models' has no attribute {name!r}")

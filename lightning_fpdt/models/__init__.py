"""Reference models built from ``FPDTBlock``, and :class:`HFCausalLM` around any Hugging Face causal LM.

Layers, each importing only those below it: ``init`` (shared weight initialisation) and ``lm`` (``CausalLM``
and the :class:`DecoderModel` contract); ``llama`` and ``gpt``; ``convert`` (weights from and to
``transformers``); ``hf_checkpoint`` (``LlamaLM``/``GPTLM(hf_checkpoint=...)``, imported by them when used: needs
transformers); ``hf_attention``, ``hf_layers`` and ``hf_causal_lm`` (``HFCausalLM``, needs transformers).
"""

from typing import Any

from lightning_fpdt.models.convert import gpt_from_hf, llama_from_hf, to_hf
from lightning_fpdt.models.gpt import GPT, GPTLM, GPTConfig
from lightning_fpdt.models.llama import Llama, LlamaConfig, LlamaLM
from lightning_fpdt.models.lm import CausalLM, DecoderModel

__all__ = ["GPT", "CausalLM", "DecoderModel", "GPTConfig", "GPTLM", "HFCausalLM", "Llama", "LlamaConfig", "LlamaLM",
           "gpt_from_hf", "llama_from_hf", "to_hf"]


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

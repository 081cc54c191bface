"""The models FPDT trains: the bundled families (Llama, GPT-2) built from ``FPDTBlock``, a user's own decoder
through :class:`CausalLM`, and any Hugging Face causal LM through :class:`HFCausalLM` (:mod:`lightning_fpdt.hf`).

Layers, each importing only those below it:

- ``contract`` (the :class:`DecoderModel` a ``CausalLM`` trains), ``configs``, ``metrics``, ``init``, ``family``
  (the :class:`~lightning_fpdt.models.family.Family` record);
- ``pending_weights`` (a meta-device model's weights read where they are needed), ``causal_lm`` (:class:`CausalLM`);
- ``pretrained`` (reading a pretrained directory through a family's weight table), ``bundled`` (the bundled
  families' LightningModule);
- one file per family: ``llama``, ``gpt`` (model, LightningModule, weight table, config mapping, ``FAMILY``);
- ``convert`` (whole models from and to ``transformers``, the list of families), ``from_config`` (a YAML's model
  section or a checkpoint's hyper-parameters to a LightningModule).

``HFCausalLM`` needs transformers (the extra ``hf``): it is imported on first use, so this package imports
without it.
"""

from typing import Any

from lightning_fpdt.models.causal_lm import CausalLM
from lightning_fpdt.models.class_paths import publish
from lightning_fpdt.models.contract import DecoderModel
from lightning_fpdt.models.convert import gpt_from_hf, llama_from_hf, to_hf
from lightning_fpdt.models.gpt import GPT, GPTLM, GPTConfig
from lightning_fpdt.models.llama import Llama, LlamaConfig, LlamaLM
from lightning_fpdt.optional import require

publish(__name__, CausalLM, GPT, GPTConfig, GPTLM, Llama, LlamaConfig, LlamaLM)

__all__ = ["GPT", "CausalLM", "DecoderModel", "GPTConfig", "GPTLM", "HFCausalLM", "Llama", "LlamaConfig", "LlamaLM",
           "gpt_from_hf", "llama_from_hf", "to_hf"]


def __getattr__(name: str) -> Any:
    if name == "HFCausalLM":  # needs transformers: imported on first use, so the package imports without it
        require("transformers", "lightning_fpdt.models.HFCausalLM")
        return require("lightning_fpdt.hf.causal_lm", "lightning_fpdt.models.HFCausalLM").HFCausalLM
    raise AttributeError(f"module 'lightning_fpdt.models' has no attribute {name!r}")

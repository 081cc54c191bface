"""Any Hugging Face causal LM trained exactly under FPDT: :class:`HFCausalLM` (needs transformers, the extra ``hf``).

Modules: ``causal_lm`` (the LightningModule), ``build`` (its ``model`` argument to a transformers config and model,
with ``config_overrides``), ``attention`` (the attention function that runs the FPDT pipeline), ``guards`` (what
would be silently wrong, refused: the context's arrival, the head's logit transform, length-dependent RoPE),
``masks`` (windows read from each layer's mask), ``layers`` (the memory stack on its decoder layers), ``experts``
(mixtures of experts, their router loss over the whole batch), ``weights`` (a pretrained directory read onto the
meta-device model), ``flops`` (training FLOPs per token), ``lora`` (LoRA adapters through peft). The public name is also
``lightning_fpdt.models.HFCausalLM``.
"""

from lightning_fpdt.hf.causal_lm import HFCausalLM

__all__ = ["HFCausalLM"]

"""The LightningModule of a bundled family (``LlamaLM``, ``GPTLM``): its model from a config, or from a pretrained
Hugging Face directory read where the weights are needed, and the hyper-parameters that rebuild it."""

from __future__ import annotations

from typing import Any, ClassVar

from lightning_fpdt.models.causal_lm import CausalLM
from lightning_fpdt.models.class_paths import check_saved_class
from lightning_fpdt.models.configs import config_and_options, with_overrides
from lightning_fpdt.models.family import Family
from lightning_fpdt.models.pretrained import from_pretrained_dir


class BundledLM(CausalLM):
    """Trains the model of :attr:`family` (see :class:`~lightning_fpdt.models.causal_lm.CausalLM` for batches and
    options). A subclass sets :attr:`family` and documents its ``__init__``, which calls this one.

    Args:
        config: the model's config, or its fields as a dict (a checkpoint's hyper-parameters); ``None``: the
            family's ``tiny`` config, or with ``hf_checkpoint`` the directory's own.
        hf_checkpoint: a local Hugging Face model directory to read the config and the weights from.
        config_overrides: config fields to set on the config.
        **kwargs: the options of :class:`CausalLM`.
    """

    family: ClassVar[Family]

    def __init__(self, config: Any = None, hf_checkpoint: str | None = None,
                 config_overrides: dict[str, Any] | None = None, **kwargs: Any) -> None:
        check_saved_class(kwargs.get("_class_path"), type(self))  # load_from_checkpoint: before the config is read
        config_class, owner = self.family.config_class, type(self).__name__
        if isinstance(config, dict):  # from a checkpoint's hyper-parameters
            config, kwargs = config_and_options(config, kwargs)
            config = config_class(**config)
        super().__init__(**kwargs)
        if hf_checkpoint is not None:
            self.model, self._pending_weights = from_pretrained_dir(self.family, hf_checkpoint, config,
                                                                    config_overrides, owner)
        else:
            self.model = self.family.model_class(with_overrides(config or config_class.tiny(), config_overrides,
                                                                owner))
        self.config = self.model.config
        source = {} if hf_checkpoint is None else {"hf_checkpoint": str(hf_checkpoint)}
        # the config holds the overrides: a reload builds the same model (and reads no config.json)
        self.save_hyperparameters({"config": self.config.to_dict(), **source, **kwargs})

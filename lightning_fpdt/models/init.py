"""Weight initialisation shared by the bundled models (Llama, GPT) and usable by a user's own model."""

from __future__ import annotations

import math

from torch import nn


def init_weights(module: nn.Module, std: float | None) -> None:
    """Normal init of every ``nn.Linear`` and ``nn.Embedding`` in ``module``; biases zero.

    Args:
        module: the model (every submodule is initialised, in place).
        std: the standard deviation of every weight; ``None`` means ``1 / sqrt(in_features)`` for a linear
            layer and 1 for an embedding.
    """
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std or 1.0 / math.sqrt(m.in_features))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std or 1.0)

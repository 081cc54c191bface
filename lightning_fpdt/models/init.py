"""Weight initialisation shared by the bundled models (Llama, GPT) and usable by a user's own model."""

from __future__ import annotations

import math

from torch import nn


def init_weights(module: nn.Module, std: float | None, tied: nn.Embedding | None = None) -> None:
    """Normal init of every ``nn.Linear`` and ``nn.Embedding`` in ``module``; biases zero.

    Args:
        module: the model (every submodule is initialised, in place).
        std: the standard deviation of every weight; ``None`` means ``1 / sqrt(in_features)`` for a linear
            layer and 1 for an embedding.
        tied: the embedding that is also the output layer (tied word embeddings): with ``std=None`` it gets the
            output layer's ``1 / sqrt(embedding_dim)``. At 1, every logit of the normed last hidden state has a
            standard deviation of ``sqrt(embedding_dim)``, and a 64-wide model starts at a loss of 39, not ln(V).
    """
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std or 1.0 / math.sqrt(m.in_features))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std or (1.0 / math.sqrt(m.embedding_dim) if m is tied else 1.0))

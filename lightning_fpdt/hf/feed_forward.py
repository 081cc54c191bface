"""The feed-forward module of a transformers decoder layer, whatever its family names it."""

from __future__ import annotations

from torch import nn

FEED_FORWARD_NAMES = ("mlp", "feed_forward", "mlp_block", "ffn")  # as transformers' families name it


def feed_forward(layer: nn.Module) -> nn.Module | None:
    """The feed-forward module of a decoder layer (``mlp``; LFM2's and Falcon-H1's ``feed_forward``,
    RecurrentGemma's ``mlp_block``; Nemotron-H's ``mixer`` where that block's mixer is its MLP), or ``None``: a layer
    without one (a mixer-only layer of a hybrid)."""
    found = next((m for name in FEED_FORWARD_NAMES if isinstance(m := getattr(layer, name, None), nn.Module)), None)
    mixer = getattr(layer, "mixer", None)  # one block, one kind: Mamba-2, attention, MLP or experts
    if found is None and isinstance(mixer, nn.Module) and type(mixer).__name__.endswith(("MLP", "MoE")):
        return mixer
    return found

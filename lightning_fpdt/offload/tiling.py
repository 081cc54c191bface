"""Sequence tiling, one rule for everything tiled: the MLP, the loss, the Hugging Face MLPs, the memory model.

A tiled call runs over ``num_tiles`` slices of the sequence and keeps only its inputs; backward recomputes
one tile at a time (:func:`lightning_fpdt.offload.recompute.recomputed_call`), so no ``[tokens, intermediate]`` or
``[tokens, vocab]`` tensor exists for the whole sequence. The MLP's intermediate (3.5-4x the hidden size)
is the largest activation of a block once attention is chunked; the loss's logits are wider still.

``num_tiles`` reads the same everywhere: ``1`` is off (the call runs as is, autograd keeps its
intermediates), ``None`` is automatic (tiles of at most ``tile_tokens`` tokens, :func:`tile_count`), any
other count is used as given (at most one tile per token). :mod:`lightning_fpdt.memory` sizes a tile with
the same functions.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import Tensor, nn

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.offload.recompute import Params, TileGrad, recomputed_call

MIN_TILE_TOKENS = 1024
"""Automatic tiles are at least this many tokens: a large enough matrix multiply, and a tile's logits
(``1024 x vocab`` float32) or intermediate do not grow with the sequence."""


def mlp_tile_tokens(hidden_size: int) -> int:
    """Tokens of an automatic MLP tile: ``max(hidden, 1024)``, so its intermediate stays bounded however long
    the sequence, and its matrix multiplies stay large."""
    return max(hidden_size, MIN_TILE_TOKENS)


def tile_count(length: int, configured: int | None, tile_tokens: int = MIN_TILE_TOKENS) -> int:
    """Tiles of a sequence of ``length`` tokens: ``configured`` (at most ``length``), or with ``None`` the
    fewest tiles of at most ``tile_tokens`` tokens."""
    count = -(-length // tile_tokens) if configured is None else configured
    return max(1, min(count, length))


def tile_bounds(length: int, num_tiles: int) -> list[tuple[int, int]]:
    """``num_tiles`` contiguous, nearly equal ``[lo, hi)`` slices of ``range(length)`` (no empty ones; the
    longer ones first)."""
    num_tiles = max(1, min(num_tiles, length))
    step, rest = divmod(length, num_tiles)
    bounds, lo = [], 0
    for t in range(num_tiles):
        hi = lo + step + (1 if t < rest else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def largest_tile(length: int, configured: int | None, tile_tokens: int = MIN_TILE_TOKENS) -> int:
    """Tokens of the largest tile :func:`tiled_call` cuts a sequence of ``length`` into (what sets its memory)."""
    lo, hi = tile_bounds(length, tile_count(length, configured, tile_tokens))[0]
    return hi - lo


def tiled_call(
    fn: Callable[..., Tensor],
    *inputs: Tensor,
    num_tiles: int | None,
    params: Params = (),
    tile_tokens: int = MIN_TILE_TOKENS,
    tile_grad: TileGrad | None = None,
    name: str = "tile",
) -> Tensor:
    """``fn(*inputs)`` over sequence tiles (dimension 1 of every input), keeping only the inputs for backward,
    where each tile is recomputed (:func:`~lightning_fpdt.offload.recompute.recomputed_call`).

    Args:
        fn: position-wise in dimension 1 (it must not mix tokens of different tiles); returns
            ``[batch, tile, ...]``, or a 0-dimensional sum over the tile's tokens (summed over tiles).
        inputs: ``[batch, seq, ...]`` each.
        num_tiles: ``1`` runs ``fn(*inputs)`` as is (tiling off: intermediates kept by autograd); ``None``
            picks :func:`tile_count` of ``tile_tokens`` (and recomputes in backward even when that is one tile).
        params: the parameters ``fn`` uses (a module, or tensors it closes over).
        tile_tokens: the automatic tile size.
        tile_grad: a closed form of one tile's gradients (:data:`~lightning_fpdt.offload.recompute.TileGrad`).
        name: the profiler range of each tile, ``fpdt/<name>``.
    """
    if num_tiles == 1:
        return fn(*inputs)
    length = inputs[0].shape[1]
    bounds = tile_bounds(length, tile_count(length, num_tiles, tile_tokens))
    return recomputed_call(fn, *inputs, params=params, tiles=bounds, tile_grad=tile_grad, name=name)


class TiledMLP(nn.Module):
    """Run ``mlp`` over ``[batch, seq, hidden]`` in ``num_tiles`` sequence tiles.

    Args:
        mlp: any module applied position-wise (SwiGLU, GeLU MLP, ...). It must not mix positions.
        num_tiles: tiles per call, read as :func:`tiled_call` reads it (``None``: tiles of
            :func:`mlp_tile_tokens`; ``1``: off, intermediates kept).
    """

    def __init__(self, mlp: nn.Module, num_tiles: int | None = None) -> None:
        super().__init__()
        if num_tiles is not None and num_tiles < 1:
            raise FPDTError(f"TiledMLP: num_tiles must be >= 1 or None, got {num_tiles}.")
        self.mlp = mlp
        self.num_tiles = num_tiles

    def forward(self, x: Tensor) -> Tensor:
        return tiled_call(self.mlp, x, num_tiles=self.num_tiles, params=self.mlp,
                          tile_tokens=mlp_tile_tokens(x.shape[-1]), name="mlp_tile")


class TiledForward:
    """An MLP instance's ``forward`` (set on the instance, so its class, parameter names and
    ``save_pretrained`` stay its own): its class's forward over sequence tiles of ``[batch, seq, hidden]``.

    Args:
        mlp: the MLP (position-wise), e.g. a transformers decoder layer's.
        num_tiles: tiles per call, read as :class:`TiledMLP` reads it.
    """

    def __init__(self, mlp: nn.Module, num_tiles: int | None) -> None:
        self.mlp, self.num_tiles = mlp, num_tiles

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        forward = partial(type(self.mlp).forward, self.mlp)
        # more inputs of one value per token (Bloom's and MPT's MLPs add the residual): tiled alike
        if kwargs or not all(isinstance(a, Tensor) and a.shape[:2] == x.shape[:2] for a in args):
            return forward(x, *args, **kwargs)  # anything else: the MLP as it is, untiled
        return tiled_call(forward, x, *args, num_tiles=self.num_tiles, params=self.mlp,
                          tile_tokens=mlp_tile_tokens(x.shape[-1]), name="mlp_tile")


def configured_tiles(module: nn.Module) -> int | None:
    """The ``num_tiles`` of the first tiled MLP in ``module`` (a :class:`TiledMLP`, or an MLP whose forward is a
    :class:`TiledForward`); ``1`` (off) when it has none."""
    for m in module.modules():
        tiling = m if isinstance(m, TiledMLP) else vars(m).get("forward")
        if isinstance(tiling, (TiledMLP, TiledForward)):
            return tiling.num_tiles
    return 1

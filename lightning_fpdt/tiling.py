"""Sequence-tiled MLP: any MLP module run tile by tile, recomputed per tile in backward.

The MLP's intermediate (``[tokens, intermediate]``, 3.5-4x the hidden size) is the largest activation
of a block after attention is chunked. :class:`TiledMLP` runs the wrapped module on ``num_tiles``
slices of the sequence under ``no_grad`` and keeps only its input; backward recomputes one tile at a
time. The MLP's parameters are passed to the autograd function as explicit inputs and their
gradients returned from it, so every parameter's gradient is produced once per backward (what DDP's
reducer and FSDP expect), never accumulated from a nested backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.autocast_state import AutocastState
from lightning_fpdt.profiling import record

MIN_TILE_TOKENS = 1024


def tile_bounds(length: int, num_tiles: int) -> list[tuple[int, int]]:
    """``num_tiles`` contiguous, nearly equal ``[lo, hi)`` slices of ``range(length)`` (no empty ones)."""
    num_tiles = max(1, min(num_tiles, length))
    step, rest = divmod(length, num_tiles)
    bounds, lo = [], 0
    for t in range(num_tiles):
        hi = lo + step + (1 if t < rest else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, module: nn.Module, run: Callable[[Tensor], Tensor], num_tiles: int,
                *params: Tensor) -> Tensor:
        ctx.module, ctx.run, ctx.num_tiles = module, run, num_tiles
        ctx.autocast = AutocastState.capture(x.device.type)
        ctx.save_for_backward(x)
        out = None
        for lo, hi in tile_bounds(x.shape[1], num_tiles):
            with record("fpdt/mlp_tile"):
                y = run(x[:, lo:hi])
            if out is None:
                out = y.new_empty(x.shape[0], x.shape[1], *y.shape[2:])
            out[:, lo:hi] = y
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        params = [p for p in ctx.module.parameters() if p.requires_grad]
        dx = torch.empty_like(x)
        dparams: list[Tensor | None] = [None] * len(params)
        for lo, hi in tile_bounds(x.shape[1], ctx.num_tiles):
            x_tile = x[:, lo:hi].detach().requires_grad_(x.requires_grad)
            with torch.enable_grad(), ctx.autocast.restore(), record("fpdt/mlp_tile_backward"):
                y = ctx.run(x_tile)
                inputs = [x_tile, *params] if x.requires_grad else params
                grads = torch.autograd.grad(y, inputs, grad[:, lo:hi], allow_unused=True)
            if x.requires_grad:
                dx[:, lo:hi] = grads[0]
                grads = grads[1:]
            for i, g in enumerate(grads):
                if g is not None:
                    dparams[i] = g if dparams[i] is None else dparams[i].add_(g)
        # gradients for (x, module, run, num_tiles, *params) in the order forward received them
        all_params = list(ctx.module.parameters())
        by_param = {id(p): g for p, g in zip(params, dparams)}
        return (dx if x.requires_grad else None, None, None, None, *(by_param.get(id(p)) for p in all_params))


def tiled_call(
    module: nn.Module, x: Tensor, num_tiles: int | None, run: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """``run(x)`` (default ``module(x)``) over ``x`` ``[batch, seq, hidden]`` in sequence tiles, keeping only
    ``x`` for backward, where each tile is recomputed; ``module`` owns the parameters ``run`` uses.

    ``num_tiles``: ``1`` runs ``run(x)`` as is (tiling off: intermediates kept by autograd); ``None`` picks
    :meth:`TiledMLP.auto_tiles` from the sequence and hidden sizes (and recomputes in backward even when that
    is one tile). Without grad mode the tiles run and nothing is saved.
    """
    run = module if run is None else run
    if num_tiles == 1:
        return run(x)
    tiles = num_tiles if num_tiles is not None else TiledMLP.auto_tiles(x.shape[1], x.shape[-1])
    if not torch.is_grad_enabled():
        return _TiledFunction.forward(_NoCtx(), x, module, run, tiles)  # inference: tiles, nothing saved
    return _TiledFunction.apply(x, module, run, tiles, *module.parameters())


class TiledMLP(nn.Module):
    """Run ``mlp`` over ``[batch, seq, hidden]`` in ``num_tiles`` sequence tiles.

    Args:
        mlp: any module applied position-wise (SwiGLU, GeLU MLP, ...). It must not mix positions.
        num_tiles: tiles per call; ``None`` picks :meth:`auto_tiles` from the sequence and hidden
            sizes (and recomputes in backward even when that is one tile); ``1`` runs the module
            directly (tiling off: no recomputation, intermediates kept).
    """

    def __init__(self, mlp: nn.Module, num_tiles: int | None = None) -> None:
        super().__init__()
        if num_tiles is not None and num_tiles < 1:
            raise ValueError(f"TiledMLP: num_tiles must be >= 1 or None, got {num_tiles}.")
        self.mlp = mlp
        self.num_tiles = num_tiles

    @staticmethod
    def auto_tiles(seq_len: int, hidden_size: int) -> int:
        """Tiles of ``max(hidden, 1024)`` tokens: a tile's intermediate stays bounded however long the
        sequence, and tiles stay large enough for efficient matrix multiplies."""
        return max(1, -(-seq_len // max(hidden_size, MIN_TILE_TOKENS)))

    def forward(self, x: Tensor) -> Tensor:
        return tiled_call(self.mlp, x, self.num_tiles)


class _NoCtx:
    """A stand-in autograd context for running the tiled forward without autograd."""

    autocast: AutocastState | None = None

    def save_for_backward(self, *tensors: Tensor) -> None:
        pass

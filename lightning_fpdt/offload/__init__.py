"""Where tensors live between their uses, and what is computed again instead of kept: the copy engine (a stream per
direction and a pinned host pool per device), the chunk store (host offload with double-buffered prefetch), the
recomputation in backward written once, the one sequence-tiling rule, the autocast state a recomputation restores,
and a tracker of live tensors. The floor of the engine: it imports nothing of the package but ``profiling``."""

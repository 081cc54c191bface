"""lightning-fpdt: a PyTorch Lightning strategy for training LLMs on very long sequences with FPDT.

Importing the package registers the strategy names ``"fpdt"``, ``"fpdt_spawn"`` and ``"fpdt_fork"``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_fpdt.attention import fpdt_attention
from lightning_fpdt.layers.block import FPDTAttention, FPDTBlock
from lightning_fpdt.parallel.binding import SequenceParallelContext
from lightning_fpdt.strategy import FPDTStrategy

__version__ = "0.1.0"

FPDTStrategy.register_strategies(StrategyRegistry)

__all__ = ["FPDTAttention", "FPDTBlock", "FPDTStrategy", "SequenceParallelContext", "fpdt_attention", "__version__"]

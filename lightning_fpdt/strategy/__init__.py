"""``FPDTStrategy`` (``fpdt``: Lightning's hooks, each handing its concern to a module around it), its launchers
(``launcher``), FSDP2 parameter sharding applied from outside (``sharding``) and the step guard against non-finite
losses and gradients (``step_guard``)."""

from lightning_fpdt.strategy.fpdt import FPDTStrategy

__all__ = ["FPDTStrategy"]

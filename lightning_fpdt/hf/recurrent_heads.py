"""Which head counts a sequence-parallel gated delta rule or Mamba-2 scan can split over the group
(:mod:`lightning_fpdt.hf.recurrent`): each rank takes a share of the heads, as attention does, with the key heads or
``B``/``C`` groups split too or replicated; anything else is refused with the numbers and the sizes that work."""

from __future__ import annotations

from lightning_fpdt.errors import FPDTError


def delta_rule_split(n_k: int, n_v: int, p: int) -> str | None:
    """Why a gated delta rule of ``n_k`` key and ``n_v`` value heads cannot run over ``p`` ranks, or ``None``: each
    rank takes ``n_v / p`` value heads, with their key heads split too or replicated (``p`` a multiple of ``n_k``)."""
    return _split(n_v, "value heads", n_k, "key heads", "replicated", p)


def scan_split(heads: int, groups: int, p: int) -> str | None:
    """Why a Mamba-2 scan of ``heads`` heads in ``groups`` ``B``/``C`` groups cannot run over ``p`` ranks, or
    ``None``: each rank takes ``heads / p`` heads, which must cover whole groups or lie in one."""
    return _split(heads, "heads", groups, "B/C groups", "shared", p)


def _split(outer: int, outer_name: str, inner: int, inner_name: str, kept: str, p: int) -> str | None:
    """The rule both kernels share (attention's for its KV heads too,
    :func:`~lightning_fpdt.parallel.comm.check_heads`): ``outer`` divisible by ``p``, ``inner`` divisible by it or
    dividing it."""
    if outer % p == 0 and (inner % p == 0 or p % inner == 0):
        return None
    sizes = [q for q in range(1, outer + 1) if outer % q == 0 and (inner % q == 0 or q % inner == 0)]
    return (f"{inner} {inner_name} and {outer} {outer_name}, which sequence_parallel_size={p} cannot split: each rank"
            f" takes {outer_name} / {p}, with their {inner_name} split too ({inner_name} divisible by {p}) or {kept}"
            f" (sequence_parallel_size a multiple of the {inner_name}). Use a sequence_parallel_size in"
            f" {sizes}")


def refuse_split(where: str, why: str | None) -> None:
    if why is not None:
        raise FPDTError(f"HFCausalLM: {where} has {why}.")


__all__ = ["delta_rule_split", "refuse_split", "scan_split"]

"""The cores of :mod:`lightning_fpdt.hf.recurrent` (gated delta rule, Kimi delta attention, Mamba-2 and Mamba-1
scans, lightning attention) and their heads: which head counts the group can split (each rank takes a share of the
heads, as attention does, with the key heads or ``B``/``C`` groups split too or replicated; anything else is refused
with the numbers and the sizes that work), and what each kernel costs per token."""

from __future__ import annotations

from torch import nn

from lightning_fpdt.errors import FPDTError

# the cores, by the name of the kernel each family calls (lightning attention has none: its core is in its forward)
DELTA_RULE = "torch_chunk_gated_delta_rule"
KDA = "chunk_kimi_delta_attention"  # Kimi Linear: the gated delta rule with a gate per key channel
SCAN = "mamba2_chunk_scan"
SELECTIVE_SCAN = "mamba_selective_scan"  # Mamba-1 (Jamba)
LIGHTNING = "lightning_attention"  # MiniMax


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


def channel_split(channels: int, p: int, what: str = "d_inner channels") -> str | None:
    """Why Mamba-1's ``channels`` (``d_inner``; or lightning attention's heads) cannot be split over ``p`` ranks,
    or ``None``."""
    if channels % p == 0:
        return None
    sizes = [q for q in range(1, min(channels, 64) + 1) if channels % q == 0]
    return (f"{channels} {what}, which sequence_parallel_size={p} cannot split evenly (each rank takes 1 / {p} of"
            f" them). Use a sequence_parallel_size in {sizes}")


def refuse_split(where: str, why: str | None) -> None:
    if why is not None:
        raise FPDTError(f"HFCausalLM: {where} has {why}.")


def check_module_heads(core: str, module: nn.Module, sp_size: int, where: str) -> None:
    """Refuse head counts ``sp_size`` ranks cannot split, read from the module's ``num_k_heads``/``num_v_heads`` or
    ``num_heads``/``n_groups`` where it has them (the kernels check the shapes they are given in any case).

    Raises:
        FPDTError: naming the layer (``where``), the head counts and the sizes that work.
    """
    m = module
    if core == DELTA_RULE and isinstance(n_k := getattr(m, "num_k_heads", None), int):
        refuse_split(where, delta_rule_split(n_k, m.num_v_heads, sp_size))
    if core == KDA and isinstance(heads := getattr(m, "num_heads", None), int):
        refuse_split(where, delta_rule_split(heads, heads, sp_size))
    if core == SCAN and isinstance(heads := getattr(m, "num_heads", None), int):
        refuse_split(where, scan_split(heads, m.n_groups, sp_size))
    if core == SELECTIVE_SCAN and isinstance(channels := getattr(m, "intermediate_size", None), int):
        refuse_split(where, channel_split(channels, sp_size))
    if core == LIGHTNING and isinstance(heads := getattr(m, "num_attention_heads", None), int):
        refuse_split(where, channel_split(heads, sp_size, "heads"))


def kernel_flops_per_token(core: str, module: nn.Module) -> float:
    """Training FLOPs per token of the ``core`` kernel of ``module`` (forward and backward: 3 x the forward's
    matmuls, as the kernel computes them; the convolution and projections are parameters, counted by the caller),
    from the module's head counts and widths; 0 where it has none of them.

    Gated delta rule (chunks of ``c = 64``, per value head): ``6 d_k d_v`` against the state (read, delta, update)
    and ``c (5 d_k + 3 d_v)`` within the chunk (the two ``c x c`` score matrices, the two triangular solves, the
    scores times the new values); Kimi delta attention the same with ``d_k = d_v`` (its gate is per channel, not a
    matmul). Mamba-2 scan (chunks of the config's ``chunk_size``, per head): ``4 p n`` against the state and
    ``2 c (n + p)`` within the chunk. Mamba-1's selective scan: ``6 d n`` (discretise, update and read the state).
    Lightning attention (per head, chunks of 64): ``4 c d`` within the chunk and ``4 d^2`` against the state.
    """
    def has(*names: str) -> bool:
        return all(isinstance(getattr(module, a, None), int) for a in names)

    m = module
    if core == DELTA_RULE and has("num_v_heads", "head_k_dim", "head_v_dim"):
        dk, dv, c = m.head_k_dim, m.head_v_dim, 64
        return 3.0 * m.num_v_heads * (6 * dk * dv + c * (5 * dk + 3 * dv))
    if core == KDA and has("num_heads", "head_dim"):
        d, c = m.head_dim, 64
        return 3.0 * m.num_heads * (6 * d * d + c * 8 * d)
    if core == SCAN and has("num_heads", "head_dim", "ssm_state_size", "chunk_size"):
        p, n, c = m.head_dim, m.ssm_state_size, m.chunk_size
        return 3.0 * m.num_heads * (4 * p * n + 2 * c * (n + p))
    if core == SELECTIVE_SCAN and has("intermediate_size", "ssm_state_size"):
        return 3.0 * 6 * m.intermediate_size * m.ssm_state_size  # per channel and state: discretise, update, read
    if core == LIGHTNING and has("num_attention_heads", "head_dim"):
        d, c = m.head_dim, 64  # per head: the chunk's scores and their values, the state read and updated
        return 3.0 * m.num_attention_heads * (4 * c * d + 4 * d * d)
    return 0.0

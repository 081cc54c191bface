"""What a gated delta-net, Mamba-2 or short-convolution layer keeps, as the memory model counts it
(:class:`~lightning_fpdt.parallel.binding.SequenceMixerMemory`), read from the module's widths: installed or not, so a
model on the meta device is sized too. The counts follow what autograd saves in transformers' layers and kernels under
:mod:`lightning_fpdt.hf.recurrent` and :mod:`lightning_fpdt.hf.short_conv` (measured with saved-tensor hooks)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_fpdt.hf.recurrent import KDA, LIGHTNING, SELECTIVE_SCAN, SequenceParallelRecurrence, recurrence_core
from lightning_fpdt.hf.short_conv import is_short_conv


@dataclass(frozen=True)
class RecurrenceMemory:
    """What one gated delta-net or Mamba-2 layer keeps under :class:`SequenceParallelRecurrence`, per rank-token
    (:class:`~lightning_fpdt.parallel.binding.SequenceMixerMemory`), from its widths: ``conv`` channels of a
    ``taps``-tap convolution, chunk inputs of ``chunk_in`` values per token plus ``replicated`` ``(heads, width)``
    replicated up to sp and ``gathered`` values gathered whole (Mamba-2's ``B`` and ``C``: sp times), ``after`` values
    of the position-wise ops after the kernel (gates, norm, output projection), ``state`` values of one chunk's state
    and ``kernel`` float32 values per token of the kernel's intermediates when a chunk is recomputed. ``chunked``: the
    layer runs :class:`~lightning_fpdt.hf.recurrent.SequenceParallelRecurrence` (chunk by chunk, each chunk
    recomputed in backward); ``False``: it runs its family's own forward over the whole local sequence (a layer
    that could not be given the sequence-parallel forward, trained in one process), whose kernel keeps its
    intermediates for backward for every token.

    The counts follow what autograd saves in transformers' layers and kernels (measured with saved-tensor hooks on
    Qwen3.5's gated delta-net and Nemotron-H's mixer, the kernels at several widths): the convolution keeps its
    ``taps`` windows and its activation's input, the gated norm about six value-widths.
    """

    kind: str
    conv: int
    taps: int
    chunk_in: int
    replicated: tuple[int, int]
    gathered: int
    after: int
    state: int
    kernel: float
    chunked: bool = True

    def _chunk_in(self, sp: int) -> float:
        heads, width = self.replicated
        return self.chunk_in + max(heads, sp) * width + sp * self.gathered

    def saved(self, sp: int, chunk_size: int | None, seq_len: int) -> float:
        chunk = seq_len if chunk_size is None or not self.chunked else min(chunk_size, seq_len)
        # the convolution's windows and its activation's input; the chunk inputs; after the kernel; each chunk's
        # starting state (per rank: state / P of every chunk of chunk / P tokens)
        return (self.taps + 1) * self.conv + self._chunk_in(sp) + self.after + self.state / chunk

    def offloaded(self, sp: int) -> float:
        return self._chunk_in(sp)

    def kept_float32(self) -> float:
        return 0.0 if self.chunked else self.kernel  # the whole sequence's kernel intermediates, kept for backward

    def work(self) -> float:
        # the recomputed intermediates and, about as large, their gradients; over the whole sequence the
        # intermediates are kept (kept_float32) and only their gradients are made in backward
        return (2 if self.chunked else 1) * self.kernel

    def released(self) -> float:
        return self.after


def mixer_memory(module: nn.Module) -> RecurrenceMemory | None:
    """The :class:`RecurrenceMemory` of a short convolution (:func:`~lightning_fpdt.hf.short_conv.is_short_conv`) or
    of a module with the widths of a gated delta-net or a Mamba-2 mixer, from its attributes: chunked where it runs
    (or, on the meta device, will run once its weights are in) :class:`SequenceParallelRecurrence`, else as its
    family's own forward over the whole sequence (its kernels not recognised in this release, or a pure Mamba-2
    model at one rank); ``None`` for another module or one without the widths transformers' layers have."""
    m = module
    if is_short_conv(m):  # B, C, x; the windows; the product and the output projection's input: no kernel, no state
        width = m.conv.in_channels
        return RecurrenceMemory(type(m).__name__, conv=width, taps=m.conv.kernel_size[0], chunk_in=0,
                                replicated=(0, 0), gathered=0, after=4 * width, state=0, kernel=0.0)
    ints = lambda *names: all(isinstance(getattr(m, n, None), int) for n in names)  # noqa: E731
    param = next(m.parameters(), None)
    installed = isinstance(m.__dict__.get("forward"), SequenceParallelRecurrence)
    pending = param is not None and param.device.type == "meta"  # installed once the weights are in, if recognised
    chunked = installed or (pending and recurrence_core(m) is not None)
    if ints("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size"):
        kd, vd, nv = m.num_k_heads * m.head_k_dim, m.num_v_heads * m.head_v_dim, m.num_v_heads
        # per value head, chunks of 64: 310 + 12.5 d_k + 3.5 d_v values (measured; key heads repeated per value head)
        return RecurrenceMemory(type(m).__name__, conv=2 * kd + vd, taps=m.conv_kernel_size, chunk_in=vd + 2 * nv,
                                replicated=(m.num_k_heads, 2 * m.head_k_dim), gathered=0, after=6 * vd + 5 * nv,
                                state=nv * m.head_k_dim * m.head_v_dim,
                                kernel=nv * (310 + 12.5 * m.head_k_dim + 3.5 * m.head_v_dim), chunked=chunked)
    if ints("num_heads", "head_dim", "conv_kernel_size") and recurrence_core(m) == KDA:
        nh, d = m.num_heads, m.head_dim
        # Kimi delta attention: the delta-net's counts with d_k = d_v, its gate per key channel an input of every
        # chunk, and its decay mask [c, c, d_k] per chunk (c = 64 values per token and channel) among the kernel's
        # intermediates (from the kernel's tensors, not measured)
        return RecurrenceMemory(type(m).__name__, conv=3 * nh * d, taps=m.conv_kernel_size, chunk_in=2 * nh * d + nh,
                                replicated=(nh, 2 * d), gathered=0, after=6 * nh * d + 5 * nh, state=nh * d * d,
                                kernel=nh * (310 + 16 * d + 64 * d), chunked=chunked)
    if ints("intermediate_size", "ssm_state_size", "conv_kernel_size") and recurrence_core(m) == SELECTIVE_SCAN:
        d, n = m.intermediate_size, m.ssm_state_size
        # Mamba-1: x, dt and z per channel and B, C gathered whole into each chunk; the kernel's discretised A and
        # B x, [d, n] per token each (from the kernel's tensors, not measured)
        return RecurrenceMemory(type(m).__name__, conv=d, taps=m.conv_kernel_size, chunk_in=3 * d, replicated=(0, 0),
                                gathered=2 * n, after=4 * d, state=d * n, kernel=2.0 * d * n, chunked=chunked)
    if ints("num_attention_heads", "head_dim") and recurrence_core(m) == LIGHTNING:
        nh, d = m.num_attention_heads, m.head_dim
        # lightning attention: q, k, v per head into each chunk, the state [d, d] per head, the chunk's decayed scores
        # (64 per token and head) and their product among the kernel's intermediates (from its tensors, not measured)
        return RecurrenceMemory(type(m).__name__, conv=0, taps=0, chunk_in=3 * nh * d, replicated=(0, 0), gathered=0,
                                after=4 * nh * d, state=nh * d * d, kernel=nh * (2 * 64 + 2 * d), chunked=chunked)
    if ints("num_heads", "head_dim", "n_groups", "ssm_state_size", "conv_kernel_size", "chunk_size"):
        heads, inner, bc = m.num_heads, m.num_heads * m.head_dim, 2 * m.n_groups * m.ssm_state_size
        # per head: 5.5 head_dim + 6 state + 2.875 chunk values (measured)
        return RecurrenceMemory(type(m).__name__, conv=inner + bc, taps=m.conv_kernel_size, chunk_in=inner + heads,
                                replicated=(0, 0), gathered=bc, after=6 * inner + 2 * heads,
                                state=inner * m.ssm_state_size,
                                kernel=heads * (5.5 * m.head_dim + 6 * m.ssm_state_size + 2.875 * m.chunk_size),
                                chunked=chunked)
    return None

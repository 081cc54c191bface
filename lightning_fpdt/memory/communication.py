"""The bytes attention moves per training step: the all-to-alls inside the Ulysses groups and the ring's
point-to-point parts (``benchmarks/ring.py`` measures them)."""

from __future__ import annotations

from lightning_fpdt.memory.estimate_options import PRECISION_BYTES, EstimateOptions
from lightning_fpdt.memory.shape import ModelShape
from lightning_fpdt.parallel.layout import padded_length


def communication_bytes(shape: ModelShape, options: EstimateOptions, seq_len: int) -> dict[str, float]:
    """Bytes one rank sends per training step of ``shape`` on sequences of ``seq_len`` tokens under ``options``,
    summed over the attention layers (``benchmarks/ring.py`` measures them).

    The sequence-parallel group of ``P = U x R`` ranks (``lightning_fpdt.parallel.mesh``) moves, in every attention
    layer:

    - inside each Ulysses group of ``U`` ranks, per chunk, the all-to-alls of q, k, v (forward) and of the output
      back, and in backward those of ``dout``, ``dq``, ``dk`` and ``dv``. An all-to-all keeps ``1 / U`` of its input on
      the rank and sends the rest, so each moves ``(U - 1) / U`` of the rank's local tensor. KV heads fewer than ``U``
      are replicated before it (:func:`lightning_fpdt.parallel.comm.expand_kv_heads`): k and v then move at ``U`` heads;
    - inside each ring of ``R`` ranks, per chunk, this rank's key/value part (``C / R`` tokens at the rank's heads of
      the Ulysses group) to every ring peer whose queries see it: all ``R - 1`` of them under causal or full attention
      (a window or documents may spare some; not modelled: the figure is the upper bound). In backward the peers send
      the part's key/value gradients over their queries back, as many messages, in the accumulation dtype (float32 for
      bf16/fp16 inputs, else the input dtype) (:mod:`lightning_fpdt.attention.ring`).

    The total over a step does not depend on the chunk size: every token's q, k, v and output crosses the all-to-all
    once per pass, and every part goes to each peer once however many query chunks read it. With activation
    checkpointing the forward's moves happen twice (the forward, and the recomputation in backward). Not counted: the
    gradient all-reduce over the world and the loss's scalar all-reduces (independent of ``U x R``).

    Returns:
        ``{"all_to_all_forward", "ring_forward", "all_to_all_backward", "ring_backward"}`` -> bytes; the forward's
        twice with ``activation_checkpointing`` (its recomputation in backward moves them again).
    """
    p, r, u = options.sequence_parallel_size, options.ring_size, options.ulysses_size
    _, e = PRECISION_BYTES[options.precision]
    acc = max(e, 4)  # lightning_fpdt.attention.kernels.accumulate_dtype
    t = options.batch_size * padded_length(seq_len, p, ring_size=r) // p  # tokens per rank
    hd = shape.head_dim or shape.hidden_size // shape.num_heads
    vd = shape.v_head_dim or hd
    kv_heads = max(shape.num_kv_heads, u)  # replicated up to the Ulysses degree before the all-to-all
    layers = sum(kind.attention for kind in shape.layer_kinds())
    passes = 2 if options.activation_checkpointing else 1
    share = (u - 1) / u  # what leaves the rank of an all-to-all's input
    q, out = t * shape.num_heads * hd, t * shape.num_heads * vd  # elements per rank
    kv = t * kv_heads * (hd + vd)  # the local k and v, replicated; also this rank's parts of every chunk, summed
    ring = (r - 1) * kv  # each part to every other rank of the ring
    return {
        "all_to_all_forward": passes * layers * share * (q + kv + out) * e,
        "ring_forward": passes * layers * ring * e,
        "all_to_all_backward": layers * share * (out + q + kv) * e,  # dout, dq, dk and dv
        "ring_backward": layers * ring * acc,
    }

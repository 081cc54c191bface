"""An analytic per-rank memory model of a training step, and ``chunk_size="auto"``.

    python -m lightning_fpdt.memory --config examples/configs/tiny_cpu.yaml
    python -m lightning_fpdt.memory --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --vocab 128256 \\
        --seq 1048576 --sp 8 --chunk-size 65536 --offload --checkpointing --precision bf16-mixed

The model counts what lightning-fpdt's implementation keeps (see docs/how-fpdt-works.md): per rank,
``T = batch x S / sp`` tokens of every sample.

- parameters, gradients (twice under DDP without ``gradient_as_bucket_view``: its buckets) and AdamW state
  (every rank holds all of them, or ``1 / world`` of them and the gathered layers in use with ``shard_parameters``);
  gradients and AdamW state of the trainable parameters only (``ModelShape.trainable_params``: LoRA's adapters,
  whose frozen base and output projection make none);
- saved activations per layer (block input, norm outputs, the attention pipeline's head-sharded
  q/k/v/out chunks and lse (with a ring of ``ring_size`` ranks, k/v of the whole sequence at the Ulysses degree
  ``sp / ring_size``: the ring peers' parts join the rank's store), the o_proj input, the MLP intermediates unless
  tiled; a hybrid's layers by what each has, a gated delta-net's or Mamba-2 mixer's conv windows, chunk inputs and
  states as its :class:`~lightning_fpdt.parallel.binding.SequenceMixerMemory` says); with activation checkpointing only
  the block input (on the host with ``offload_checkpoints``);
- the largest transient: the loss (full logits unless tiled) or the backward of one block (recomputed
  with activation checkpointing; a streamed one, :mod:`lightning_fpdt.layers.streaming`, holds its output's and
  input's gradients and one chunk's work: ``EstimateOptions.streaming``), plus the attention working set of one
  chunk (a mixer's: one chunk's kernel intermediates and their gradients; with a ring, its point-to-point buffers:
  the backward's packed key/value gradient sums in the accumulation dtype);
- the gradients made so far during backward: a block's backward is the peak when it runs late in the
  backward, with the gradients of every later block (and, under ``shard_parameters``, the unsharded
  gradients of the root's parameters and of one block, and a block's float32 reduce-scatter input) alive;
- host memory: offloaded attention chunks (one layer's worth at a time: the pipeline keeps a layer's
  chunks from its forward to its backward only without activation checkpointing) and the block inputs it keeps.

The sizes come from the module itself (:meth:`ModelShape.from_module`, :mod:`lightning_fpdt.memory.shape`): its
decoder layers (``FPDTBlock`` s, or the transformers decoder layers of ``HFCausalLM``), its output projection or token
embedding, and its parameters, so any model built from ``FPDTBlock`` or wrapped by ``HFCausalLM`` can be
sized, not only the bundled ones; this package imports no model. How the run trains is one
:class:`EstimateOptions` (built from a strategy's options or from a YAML). It is an estimate for planning.
``benchmarks/training.py`` measures the real peak of live tensors.

:func:`communication_bytes` gives the bytes attention moves per step: all-to-alls inside the Ulysses groups and the
ring's point-to-point parts (``benchmarks/ring.py`` measures them).
"""

from lightning_fpdt.memory.communication import communication_bytes
from lightning_fpdt.memory.estimate_options import EstimateOptions
from lightning_fpdt.memory.estimator import GIB, MemoryEstimate, estimate, format_bytes
from lightning_fpdt.memory.shape import ModelShape
from lightning_fpdt.memory.sizing import auto_chunk_size, report

__all__ = ["GIB", "EstimateOptions", "MemoryEstimate", "ModelShape", "auto_chunk_size", "communication_bytes",
           "estimate", "format_bytes", "report"]

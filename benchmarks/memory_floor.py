"""Toward the memory floor: the device memory per token of a training step with every decoder layer streaming
chunk by chunk (``lightning_fpdt.layers.streaming``), against layers recomputed whole, and the memory model's longest
Llama-3-8B sequence.

    python benchmarks/memory_floor.py                       # CPU, 2 gloo processes, 8K and 16K tokens
    python benchmarks/memory_floor.py --seq 8192 32768 --repeats 2
    python benchmarks/memory_floor.py --models qwen35 qwen3moe --layers 4 --hidden 256

Table 1, on ``--world`` CPU processes, the full stack (attention chunks of ``--chunk-size`` tokens and the layer
inputs offloaded, emulated on CPU: the offload's host buffers are not counted; tiled MLP and loss; activation
checkpointing), float32, for the own ``LlamaLM`` and ``HFCausalLM(transformers.LlamaForCausalLM)`` of the same shape,
a Qwen3.5-shaped hybrid (gated delta-net layers, their state carried chunk to chunk: ``lightning_fpdt.layers.carried``)
and a Qwen3-MoE-shaped model with the auxiliary loss on (``--models``), each with layers recomputed whole
(``streaming=False``, as before) and streamed: the peak of live tensors per rank at each length
(``TensorMemoryTracker``, a second step: parameters, gradients and AdamW state included), the memory model's
estimate of it, the slope between the lengths in bytes per token and in hidden vectors (``hidden x 4`` bytes), and
the seconds per step.

Table 2: the memory model's longest Llama-3-8B sequence (hidden 4096, 32 layers, 32 heads, 8 KV heads,
intermediate 14336, vocabulary 128256; bf16-mixed, flash attention, chunks of 65536 tokens offloaded, checkpointing
with offloaded layer inputs, tiled MLP and loss, FSDP2 with the optimizer offloaded) on 1, 4 and 8 H200s (141 GB),
with and without streaming, and the host memory each rank needs there.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table

from lightning_fpdt.layers.activation_checkpoint import new_layer_input_store
from lightning_fpdt.layers.loss import token_weighted_loss
from lightning_fpdt.memory import GIB, EstimateOptions, ModelShape, estimate
from lightning_fpdt.models import CausalLM, HFCausalLM, LlamaConfig, LlamaLM
from lightning_fpdt.offload.memtrack import peak_step_bytes
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind
from lightning_fpdt.testing import run_on_ranks

H200 = 141e9  # bytes of device memory


def build(model: str, args: argparse.Namespace) -> CausalLM:
    """The own Llama, a transformers Llama of the same shape, a Qwen3.5-shaped hybrid (three gated delta-net layers of
    every four) or a Qwen3-MoE-shaped model with the auxiliary loss on; MLP and loss tiled automatically."""
    h = args.hidden
    if model == "llama":
        return LlamaLM(LlamaConfig(vocab_size=args.vocab, hidden_size=h, intermediate_size=h * 11 // 4,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads // 2, rope_theta=10000.0, mlp_tiles=None),
                       loss_tiles=None)
    import transformers

    if model in ("qwen35", "qwen3moe"):
        return HFCausalLM(hf_config(model, args), mlp_tiles=None, loss_tiles=None)
    return HFCausalLM(transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=h, intermediate_size=h * 11 // 4,
                                               num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                               num_key_value_heads=args.heads // 2, max_position_embeddings=1 << 22),
                      mlp_tiles=None, loss_tiles=None)


def hf_config(model: str, args: argparse.Namespace) -> Any:
    """The transformers config of the two 2026 shapes: Qwen3.5's layer pattern (a full attention layer after three
    gated delta-net layers; 2 key and 4 value heads of 64), Qwen3-MoE's experts (8, two per token, each of
    ``hidden x 3 / 4``) with ``output_router_logits`` and a coefficient of 0.01."""
    import transformers

    h = args.hidden
    common = dict(vocab_size=args.vocab, hidden_size=h, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                  num_key_value_heads=args.heads // 2, head_dim=h // args.heads, max_position_embeddings=1 << 22)
    if model == "qwen35":
        kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)]
        return transformers.AutoConfig.for_model(
            "qwen3_5_text", intermediate_size=h * 11 // 4, layer_types=kinds, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, **common)
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", intermediate_size=h * 11 // 4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=h * 3 // 4, output_router_logits=True, router_aux_loss_coef=0.01, **common)
    return config


def options(args: argparse.Namespace, streaming: bool, offload: bool = False) -> EstimateOptions:
    """The benchmark's run as the memory model sees it (``offload``: what frees device memory; on CPU the offload is
    emulated, and the measured figure leaves its host buffers out, as the model's ``offload=True`` does)."""
    return EstimateOptions(sequence_parallel_size=args.world, chunk_size=args.chunk_size, offload=True,
                           activation_checkpointing=True, offload_checkpoints=True, mlp_tiled=True, loss_tiled=True,
                           precision="32-true", attention_backend=args.backend, streaming=streaming)


def _run(rank: int, world: int, model: str, streaming: bool, seq: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    module = build(model, args)
    context = SequenceParallelContext(
        group=dist.group.WORLD if world > 1 else None, chunk_size=args.chunk_size, attention_backend=args.backend,
        offload=True, activation_checkpointing=True, layer_input_store=new_layer_input_store(torch.device("cpu")),
        streaming=streaming,
    )
    bind(module, context)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    batch = shard_batch({"input_ids": ids}, world, rank, args.chunk_size)

    def step() -> None:
        loss, _ = token_weighted_loss(*module.loss_terms(batch))
        loss.backward()
        for p in module.parameters():
            if world > 1:
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer state is made here
    peak = peak_step_bytes(step, module, optimizer)
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.repeats):
        step()
    seconds = (time.perf_counter() - start) / args.repeats
    with torch.device("meta"):
        shape, _ = ModelShape.from_module(build(model, args))
    return {"peak": peak, "seconds": seconds, "estimate": estimate(shape, seq, options(args, streaming)).device_peak}


def measured_table(args: argparse.Namespace) -> None:
    rows = []
    short, long = args.seq
    vector = args.hidden * 4  # one hidden vector in float32
    for model in args.models:
        for streaming in (False, True):
            got = {seq: run_on_ranks(_run, args.world, model, streaming, seq, args, timeout=None)[0]
                   for seq in args.seq}
            slope = (got[long]["peak"] - got[short]["peak"]) / ((long - short) // args.world)
            est_slope = (got[long]["estimate"] - got[short]["estimate"]) / ((long - short) // args.world)
            rows.append([model, "streamed" if streaming else "whole", *(got[s]["peak"] / 2**20 for s in args.seq),
                         *(got[s]["estimate"] / got[s]["peak"] for s in args.seq), slope / 1024, slope / vector,
                         est_slope / vector, *(got[s]["seconds"] for s in args.seq)])
            print(f"# {rows[-1]}", flush=True)
    print(f"\n## peak of live tensors per rank ({args.world} CPU processes, float32, hidden {args.hidden},"
          f" {args.layers} layers, chunks of {args.chunk_size} tokens, full stack; vectors: {vector} bytes)\n")
    print_table(["model", "layers", *(f"peak MiB {s}" for s in args.seq), *(f"est/meas {s}" for s in args.seq),
                 "KiB/token", "vectors/token", "model vectors/token", *(f"s/step {s}" for s in args.seq)], rows)


def llama3_8b_shape() -> ModelShape:
    return ModelShape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, vocab_size=128256,
                      intermediate_size=14336, num_params=8_030_261_248)


def longest(shape: ModelShape, sp: int, streaming: bool) -> tuple[int, Any]:
    """The longest sequence (a multiple of the chunk size times sp) whose estimated device peak fits an H200."""
    opts = EstimateOptions(sequence_parallel_size=sp, chunk_size=65536, offload=True, activation_checkpointing=True,
                           offload_checkpoints=True, mlp_tiled=True, loss_tiled=True, precision="bf16-mixed",
                           attention_backend="flash_attn", shard_parameters=True, offload_optimizer=True,
                           streaming=streaming)
    step = 65536 * sp
    lo, hi = 0, step
    while estimate(shape, hi, opts).device_peak <= H200:
        lo, hi = hi, hi * 2
    while hi - lo > step:  # bisect to the chunk multiple
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if estimate(shape, mid, opts).device_peak <= H200 else (lo, mid)
    return lo, estimate(shape, lo, opts)


def model_table() -> None:
    shape, rows = llama3_8b_shape(), []
    for sp in (1, 4, 8):
        for streaming in (False, True):
            seq, est = longest(shape, sp, streaming)
            rows.append([sp, "streamed" if streaming else "whole", f"{seq / 2**20:.2f}M ({seq})",
                         est.device_peak / GIB, est.host / GIB])
    print("\n## the memory model's longest Llama-3-8B sequence on H200s (141 GB each)\n")
    print_table(["GPUs (sp)", "layers", "longest sequence", "device peak GiB", "host GiB per rank"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs=2, default=[8192, 16384])
    parser.add_argument("--models", nargs="+", default=["llama", "hf", "qwen35", "qwen3moe"],
                        choices=["llama", "hf", "qwen35", "qwen3moe"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--model-only", action="store_true", help="only table 2 (no processes)")
    args = parser.parse_args()
    if not args.model_only:
        measured_table(args)
    model_table()


if __name__ == "__main__":
    main()

"""Hybrid-model benchmark: a Qwen3.5-shaped gated delta-net hybrid trained sequence-parallel, and one gated
delta-net layer's time against one attention layer's as the length doubles (CPU).

    python benchmarks/hybrid.py                      # the default run: steps at 8K/16K/32K, then the layer table
    python benchmarks/hybrid.py --quick              # tiny sizes and lengths, the default variants: the smoke run
    python benchmarks/hybrid.py --variants sp1 sp1_stack sp2 sp2_stack --seq 8192 16384

Model: ``HFCausalLM`` around transformers' Qwen3.5 text model (``model_type`` ``"qwen3_5_text"``) built from a
config with random weights (nothing downloaded): hidden 512, 4 decoder layers in Qwen3.5's 3:1 pattern (three
``linear_attention`` gated delta-nets, then one ``full_attention`` layer), delta-nets with 4 key and 8 value heads
of 64, attention with 8 heads and 2 KV heads of 64, MLP intermediate 1408, vocabulary 32000, float32, batch 1.
The gated delta-nets run through ``lightning_fpdt.hf.recurrent`` (the chunk's all-to-all to heads / P heads,
transformers' ``torch_chunk_gated_delta_rule`` from the state the chunk before left, the convolution's tail carried
across ranks), the attention layer through the FPDT pipeline (``--backend``, default ``sdpa``).

Variants (``--variants``); all but ``sp1`` are bound the way the strategy binds a model
(``lightning_fpdt.parallel.binding.bind`` with a ``SequenceParallelContext``, as ``benchmarks/training.py``
does, without a Trainer):

- ``sp1``: one process, unbound: the whole sequence in one piece, transformers' kernels called as transformers
  calls them, attention ``sdpa`` (what ``auto`` is on CPU), full logits kept for backward, no tiling, no
  checkpointing (``benchmarks/training.py``'s ``single``);
- ``sp1_stack``: one process with the memory stack: ``--chunks`` chunks, tiled MLP and loss, activation
  checkpointing of every decoder layer;
- ``sp2``: ``--world`` gloo processes, plain Ulysses (one chunk), no tiling, no checkpointing;
- ``sp2_stack``: ``--world`` processes with the memory stack (``--chunks`` chunks, so each rank holds that many
  sub-chunks; tiled MLP and loss; checkpointing).

Each (variant, length) runs in fresh processes (the cores shared evenly: 2 threads for one process, 1 each for
two): one measured step (peak resident set over the step, ``ru_maxrss`` minus the resident set before it), one
step under ``TensorMemoryTracker`` (the peak of live tensors: parameters, gradients, AdamW state, activations),
then ``--repeats`` timed steps (their mean is the step time). A step is forward, backward, gradient all-reduce and
an AdamW update. A (variant, length) listed in ``--skip`` is not run (its row says so): by default ``sp1`` at
32K, which needs more than the development machine's 23 GiB (its live tensors grow by about 0.74 MiB per token:
about 24 GiB at 32K). Before the table, one ``sp2_stack`` step of a small hybrid is checked against the unbound
model in one process (loss and every gradient, float32). The whole default run takes about 20 minutes on 2 cores.
``--quick`` replaces the sizes and lengths by tiny ones (``sp1`` and ``sp2_stack``, or the ``--variants`` given, at 256
tokens, or the ``--seq`` given; the layer table at 128 and 256, or the ``--layer-seq`` given).

Layer table (``--layer-seq``): one process (all cores), the plain transformers model of the same config with
``attn_implementation="sdpa"``: forward and backward of ``model.layers[0].linear_attn`` (a
``Qwen3_5GatedDeltaNet``) and of ``model.layers[3].self_attn`` (a ``Qwen3_5Attention``, with the position
embeddings of ``model.rotary_emb`` and no mask: causal), each called as the decoder layer calls it, on a random
``[1, S, hidden]`` input, ``--layer-repeats`` timed calls after one warm-up call at that length; "x per doubling"
is each time over the one at the length before. The chunked column is the same delta-net layer as
``lightning_fpdt.hf.recurrent`` runs it in one process with chunks of ``--layer-chunk`` tokens (each chunk's
kernel recomputed in its backward).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RANKS, print_table

from lightning_fpdt.layers.loss import token_weighted_loss
from lightning_fpdt.offload.memtrack import peak_step_bytes
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind
from lightning_fpdt.testing import run_on_ranks

VARIANTS = ("sp1", "sp1_stack", "sp2", "sp2_stack")
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]  # Qwen3.5's 3:1


def hybrid_config(args: argparse.Namespace) -> Any:
    """The Qwen3.5-shaped text config (random weights are drawn from it; nothing is downloaded)."""
    import transformers

    return transformers.AutoConfig.for_model(
        "qwen3_5_text", hidden_size=args.hidden, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
        linear_num_key_heads=args.heads // 2, linear_num_value_heads=args.heads, linear_key_head_dim=args.head_dim,
        linear_value_head_dim=args.head_dim, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, intermediate_size=args.intermediate, vocab_size=args.vocab, dtype="float32",
        max_position_embeddings=1 << 22,
    )


def world_of(variant: str, args: argparse.Namespace) -> int:
    return 1 if variant.startswith("sp1") else args.world


def stacked(variant: str) -> bool:
    return variant.endswith("_stack")


def chunk_size(variant: str, seq: int, args: argparse.Namespace) -> int | None:
    """``--chunks`` chunks of the sequence with the memory stack (a multiple of the group), else one."""
    world = world_of(variant, args)
    return max(world, seq // args.chunks // world * world) if stacked(variant) else None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _setup(rank: int, world: int, variant: str, seq: int, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The hybrid ``HFCausalLM`` bound to this variant's options, its AdamW, and a step function."""
    from lightning_fpdt.models import HFCausalLM

    torch.manual_seed(0)
    tiles = None if stacked(variant) else 1  # None: automatic tiles; 1: off (full logits, MLP kept for backward)
    module = HFCausalLM(hybrid_config(args), mlp_tiles=tiles, loss_tiles=tiles)
    chunk = chunk_size(variant, seq, args)
    if variant != "sp1":  # sp1: unbound, the model as transformers runs it in one process
        group = dist.group.WORLD if world > 1 else None
        bind(module, SequenceParallelContext(group=group, chunk_size=chunk, attention_backend=args.backend,
                                             activation_checkpointing=stacked(variant)))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, args.vocab, (1, seq), generator=g)
    batch = shard_batch({"input_ids": ids}, world, rank, chunk)

    def step() -> float:
        loss, mean = token_weighted_loss(*module.loss_terms(batch))
        loss.backward()
        if world > 1:
            for p in module.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return mean.item()

    return module, optimizer, step


def _run(rank: int, world: int, variant: str, seq: int, args: argparse.Namespace) -> dict:
    module, optimizer, step = _setup(rank, world, variant, seq, args)
    rss_before = _rss_bytes()
    began = time.perf_counter()
    loss = step()  # the measured step: optimizer state is created here too (a constant, not per token)
    first = time.perf_counter() - began
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    tensor_peak = peak_step_bytes(step, module, optimizer)
    times = []
    for _ in range(args.repeats):
        if world > 1:
            dist.barrier()
        began = time.perf_counter()
        step()
        if world > 1:
            dist.barrier()
        times.append(time.perf_counter() - began)
    return {"rss": rss_peak, "tensors": tensor_peak, "seconds": sum(times) / len(times), "times": times,
            "first": first, "loss": loss, "params": sum(p.numel() for p in module.parameters())}


def _check_exact(rank: int, world: int, args: argparse.Namespace) -> tuple[float, float]:
    """Relative differences of one ``sp2_stack`` step against the unbound one-process model, float32, on a small
    hybrid of the same pattern (512 tokens, 4 chunks): ``(loss, worst parameter gradient)``, each gradient relative
    to its own largest element, floored at 1e-3 of the model's largest."""
    small = argparse.Namespace(**{**vars(args), "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16,
                                  "intermediate": 176, "vocab": 512, "chunks": 4})

    def grads(variant: str, r: int, w: int) -> tuple[float, dict[str, torch.Tensor]]:
        module, _, _ = _setup(r, w, variant, 512, small)
        chunk = chunk_size(variant, 512, small)
        ids = torch.randint(0, small.vocab, (1, 512), generator=torch.Generator().manual_seed(1))
        loss, mean = token_weighted_loss(*module.loss_terms(shard_batch({"input_ids": ids}, w, r, chunk)))
        loss.backward()
        out = {}
        for name, p in module.named_parameters():
            if w > 1:
                dist.all_reduce(p.grad)
                p.grad /= w
            out[name] = p.grad.detach().clone()
        return mean.item(), out

    reference, expected = grads("sp1", 0, 1)  # every rank, alone
    loss, got = grads("sp2_stack", rank, world)
    floor = 1e-3 * max(g.abs().max().item() for g in expected.values())
    worst = max(((got[n] - g).abs().max() / max(g.abs().max().item(), floor)).item() for n, g in expected.items())
    return abs(loss - reference) / abs(reference), worst


def _time_layers(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    """Forward + backward seconds of one gated delta-net and one attention layer per length (one process)."""
    import transformers

    from lightning_fpdt.hf.mixer_install import install_recurrences

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hybrid_config(args), attn_implementation="sdpa")
    inner = model.model
    linear = next(layer.linear_attn for layer in inner.layers if hasattr(layer, "linear_attn"))
    attention = next(layer.self_attn for layer in inner.layers if hasattr(layer, "self_attn"))
    chunked = transformers.AutoModelForCausalLM.from_config(hybrid_config(args), attn_implementation="sdpa")
    _, failed = install_recurrences(chunked)  # its gated delta-nets' forwards as lightning_fpdt runs them
    if failed:  # timing the family's own forward twice would measure nothing
        raise SystemExit(f"benchmarks/hybrid.py: {next(iter(failed.values())).why}")
    chunked_linear = next(layer.linear_attn for layer in chunked.model.layers if hasattr(layer, "linear_attn"))
    chunked_linear.load_state_dict(linear.state_dict())

    def calls(seq: int) -> dict[str, Any]:
        x = torch.randn(1, seq, args.hidden, generator=torch.Generator().manual_seed(seq), requires_grad=True)
        position_embeddings = inner.rotary_emb(x, torch.arange(seq)[None])
        context = SequenceParallelContext(chunk_size=min(args.layer_chunk, seq))
        return {
            "linear": lambda: linear(hidden_states=x, attention_mask=None),
            "attention": lambda: attention(hidden_states=x, position_embeddings=position_embeddings,
                                           attention_mask=None)[0],
            "chunked": lambda: chunked_linear(hidden_states=x, attention_mask=None, fpdt_context=context),
        }

    def once(fn: Any) -> float:
        began = time.perf_counter()
        out = fn()
        out.backward(torch.ones_like(out))
        return time.perf_counter() - began

    rows = []
    for seq in args.layer_seq:
        fns = calls(seq)
        row: dict[str, Any] = {"seq": seq}
        for name, fn in fns.items():
            once(fn)  # warm-up at this length: the allocator's pools grow to its tensors (else page faults are timed)
            row[name] = sum(once(fn) for _ in range(args.layer_repeats)) / args.layer_repeats
        print(f"  layers S={seq}: delta-net {row['linear']:.2f} s, attention {row['attention']:.2f} s, delta-net"
              f" chunked {row['chunked']:.2f} s; load average {os.getloadavg()[0]:.1f}", flush=True)
        rows.append(row)
    return rows


def _parse_skip(items: list[str]) -> set[tuple[str, int]]:
    out = set()
    for item in items:
        variant, _, seq = item.partition(":")
        if variant not in VARIANTS or not seq.isdigit():
            raise argparse.ArgumentTypeError(f"--skip wants VARIANT:SEQ (e.g. sp1:32768), got {item!r}")
        out.add((variant, int(seq)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and short lengths (a smoke run: seconds)")
    parser.add_argument("--seq", type=int, nargs="*", default=[8192, 16384, 32768],
                        help="lengths of the step table (none: no step table)")
    parser.add_argument("--variants", nargs="+", default=["sp1", "sp2_stack"], choices=VARIANTS)
    parser.add_argument("--skip", nargs="*", default=["sp1:32768"], metavar="VARIANT:SEQ",
                        help="(variant, length) pairs not run (default: sp1 at 32K, which needs more than 23 GiB)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4, help="chunks of the sequence with the memory stack")
    parser.add_argument("--repeats", type=int, default=1, help="timed steps after the measured ones")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8, help="attention heads and delta-net value heads (key: half)")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--layer-seq", type=int, nargs="*", default=[4096, 8192, 16384, 32768],
                        help="lengths of the layer table (none: no layer table)")
    parser.add_argument("--layer-repeats", type=int, default=1)
    parser.add_argument("--layer-chunk", type=int, default=4096, help="chunk of the chunked delta-net column")
    args = parser.parse_args()
    if args.quick:  # the lengths and variants given on the command line are kept
        args.seq = args.seq if "--seq" in sys.argv else [256]
        args.skip = []
        args.variants = args.variants if "--variants" in sys.argv else ["sp1", "sp2_stack"]
        args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate, args.vocab = 64, 4, 2, 16, 176, 512
        args.layer_seq = args.layer_seq if "--layer-seq" in sys.argv else [128, 256]
        args.layer_chunk = min(args.layer_seq, default=128)  # the longer lengths in chunks of the shortest
        args.repeats, args.layer_repeats = 1, 1
    config = hybrid_config(args)
    print(f"Qwen3.5-shaped hybrid ({config.model_type}): hidden {args.hidden}, layers {config.layer_types}, delta-net"
          f" {config.linear_num_key_heads} key / {config.linear_num_value_heads} value heads of {args.head_dim},"
          f" attention {args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, intermediate"
          f" {args.intermediate}, vocab {args.vocab}, float32, batch 1; {os.cpu_count()} CPU core(s), load average"
          f" {os.getloadavg()[0]:.1f} (a run of this script adds about 2)", flush=True)
    if args.seq:
        _step_table(args, _parse_skip(args.skip))
    if args.layer_seq:
        _layer_table(args)


def _step_table(args: argparse.Namespace, skip: set[tuple[str, int]]) -> None:
    """The correctness check, then every (variant, length) in fresh processes: the step table."""
    loss_error, grad_error = run_on_ranks(_check_exact, args.world, args, **RANKS)[0]
    print(f"correctness: sp={args.world} with the memory stack (4 chunks) vs the unbound model in one process, one"
          f" step, float32: loss rel. difference {loss_error:.2e}, worst gradient {grad_error:.2e}", flush=True)
    if max(loss_error, grad_error) > 1e-4:
        raise SystemExit("sequence-parallel hybrid does not match the one-process model: not measuring.")
    rows = []
    for variant in args.variants:
        world = world_of(variant, args)
        for seq in args.seq:
            chunk = chunk_size(variant, seq, args)
            chunks = 1 if chunk is None else -(-seq // chunk)
            if (variant, seq) in skip:
                print(f"  {variant} S={seq}: skipped (--skip)", flush=True)
                rows.append([variant, seq, world, chunks, "skipped", "-", "-", "-"])
                continue
            r = run_on_ranks(_run, world, variant, seq, args, **RANKS)
            worst = {k: max(x[k] for x in r) for k in ("rss", "tensors")}  # the largest rank's
            seconds = r[0]["seconds"]
            print(f"  {variant} S={seq}: {seconds:.1f} s/step (timed {', '.join(f'{t:.1f}' for t in r[0]['times'])};"
                  f" measured step {r[0]['first']:.1f} s), loss {r[0]['loss']:.3f}, rss +{worst['rss'] / 2**20:.0f}"
                  f" MiB, tensors {worst['tensors'] / 2**20:.0f} MiB, {r[0]['params'] / 1e6:.1f}M parameters;"
                  f" load average {os.getloadavg()[0]:.1f}", flush=True)
            rows.append([variant, seq, world, chunks, seconds, seq / seconds, worst["rss"] / 2**20,
                         worst["tensors"] / 2**20])
    print_table(["variant", "seq", "procs", "chunks", "s/step", "tokens/s", "peak RSS MiB/rank",
                 "peak tensors MiB/rank"], rows)


def _layer_table(args: argparse.Namespace) -> None:
    """One process: the layer table (:func:`_time_layers`), each layer's growth against the length before."""
    layers = run_on_ranks(_time_layers, 1, args, **RANKS)[0]
    table = []
    for i, row in enumerate(layers):
        before = layers[i - 1] if i else None

        def growth(name: str, row: dict = row, before: dict | None = before) -> str:
            return f"{row[name] / before[name]:.2f}x" if before else "-"

        table.append([row["seq"], row["linear"], row["attention"], f"{row['attention'] / row['linear']:.2f}",
                      growth("linear"), growth("attention"), row["chunked"], growth("chunked")])
    print_table(["seq", "delta-net fwd+bwd s", "attention fwd+bwd s", "attention/delta-net",
                 "delta-net x per doubling", "attention x per doubling",
                 f"delta-net chunked ({args.layer_chunk}) s", "chunked x per doubling"], table)


if __name__ == "__main__":
    main()

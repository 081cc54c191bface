"""DeepSpeed's ALST recipe on the model of ``fit_memory.py``: host memory per rank, phase by phase (CPU, gloo).

    python benchmarks/alst_memory.py --zero-stage 0
    python benchmarks/alst_memory.py --zero-stage 3 --mmap-threshold 131072

For comparison with ``benchmarks/fit_memory.py``; DeepSpeed is not a dependency of this project. Run it with a
Python that has DeepSpeed besides this project's packages, e.g. a separate virtual environment::

    python -m venv /tmp/dsvenv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/dsvenv/lib/python3.11/site-packages/main.pth
    /tmp/dsvenv/bin/pip install wheel setuptools
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install --no-build-isolation deepspeed==0.19.8
    DS_ACCELERATOR=cpu PYTHONPATH=$PWD /tmp/dsvenv/bin/python benchmarks/alst_memory.py

Arctic Long Sequence Training (DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp``) on a
``transformers.LlamaForCausalLM`` of the same shape (hidden 512, 8 heads, 4 KV heads, 4 layers, intermediate
1408, vocabulary 32000, untied, float32, SDPA), ``--seq`` tokens, batch 1, on 2 ranks (sequence parallel over
both): Ulysses attention (``UlyssesSPAttentionHF``), the MLP through ``TiledMLP`` and the loss through
``TiledFusedLogitsLoss`` in ``--tiles`` tiles each (4: FPDT's automatic 1024-token tiles at 8192 tokens over 2
ranks), transformers' activation checkpointing, ``torch.optim.AdamW`` under ``deepspeed.initialize`` with ZeRO
stage ``--zero-stage`` (its partitions span both ranks: the sequence-parallel group is the data-parallel one).
Each rank gets its contiguous ``seq / 2`` tokens, with its shifted labels, as ``UlyssesSPDataLoaderAdapter``
gives them. The columns are ``fit_memory.py``'s (``host_memory.sample``); ``--tensors`` prints the peak of
live tensors in the last step, every tensor alive at its start counted (for ZeRO-3 that includes buffers
DeepSpeed allocates whole and touches in part, so only the resident set is comparable there).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_memory import MIB, fix_mmap_threshold, format_rows, sample

ROWS = [sample("script start")]
WORLD = 2


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    parser.add_argument("--tiles", type=int, default=4, help="tiles of the MLP and of the loss")
    parser.add_argument("--tensors", action="store_true", help="track live tensors in the last step (slow)")
    parser.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="glibc: mmap each allocation of at least BYTES (host_memory.fix_mmap_threshold)")
    return parser.parse_args()


def launch() -> None:
    """Run this script as ranks 0 and 1 (each its own process, as a launcher starts them) and wait."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, *sys.argv], env={
        **os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
        for r in range(WORLD)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"alst_memory.py: ranks exited with {codes}")


def _storages_mib(tensors: list) -> float:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(seen.values()) / MIB


def run_rank(args: argparse.Namespace) -> None:
    import deepspeed
    import deepspeed.comm as dist
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    import torch
    import transformers
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF
    from transformers.models.llama import modeling_llama

    ROWS.append(sample("imports"))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, rope_theta=10000.0, max_position_embeddings=args.seq, tie_word_embeddings=False,
        attn_implementation="sdpa", dtype=torch.float32,
    )

    def tiled_mlp_forward(self, x):  # ALST's tiled MLP: recomputed tile by tile in backward
        def mlp(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        weights = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp, self, x, args.tiles, weights)

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ROWS.append(sample("model created"))
    UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=world, micro_batch_size=1,
        seq_length=args.seq, seq_length_is_variable=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": args.zero_stage},
                 "sequence_parallel_size": world, "steps_per_print": 1 << 30}
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=adamw, config=ds_config, mpu=mpu)
    ROWS.append(sample("engine set up"))

    def loss_sum(head, x, y):
        logits = head(x).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), reduction="sum")

    generator = torch.Generator().manual_seed(args.seq)
    local = slice(rank * args.seq // world, (rank + 1) * args.seq // world)
    tensor_peak = None
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=generator)
        shift_labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)[:, local]
        tracker = None
        if args.tensors and step == args.steps:
            import gc

            from tensor_peak import PeakSnapshot

            alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu"]
            labels = {t.untyped_storage().data_ptr(): "other, alive at the step's start" for t in alive}
            inner = getattr(optimizer, "optimizer", optimizer)
            labels.update({t.untyped_storage().data_ptr(): "optimizer state" for s in inner.state.values()
                           for t in s.values() if isinstance(t, torch.Tensor)})
            labels.update({p.untyped_storage().data_ptr(): "parameters" for p in engine.module.parameters()})
            tracker = PeakSnapshot(labels).__enter__()
            tracker.track(*alive)
            tracker.reset_peak()
            del alive
        hidden = engine.module.model(input_ids=ids[:, local], position_ids=torch.arange(args.seq)[None, local],
                                     use_cache=False).last_hidden_state
        head = engine.module.lm_head
        loss = TiledFusedLogitsLoss.apply(loss_sum, head, hidden, shift_labels, None, args.tiles, [head.weight], "sum")
        ROWS.append(sample(f"step {step}: forward"))
        engine.backward(loss)
        ROWS.append(sample(f"step {step}: backward"))
        engine.step()
        inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer
        states = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
        ROWS.append({**sample(f"step {step}: optimizer step"), "optimizer": _storages_mib(states)})
        if tracker is not None:
            tracker.__exit__(None, None, None)
            tensor_peak = tracker.describe()

    reports = [None] * world
    torch.distributed.all_gather_object(reports, {"rank": rank, "rows": ROWS, "tensor_peak": tensor_peak})
    if rank == 0:
        print(f"\n{args}; deepspeed {deepspeed.__version__}, transformers {transformers.__version__}")
        for rep in reports:
            peak = rep["tensor_peak"]
            tensors = "" if peak is None else f", peak of live tensors in the last step {peak}"
            print(f"\nrank {rep['rank']} (MiB): peak RSS {max(r['peak'] for r in rep['rows']):.0f}{tensors}")
            print(format_rows(rep["rows"]))
    dist.barrier()


def main() -> None:
    args = parse()
    if "RANK" not in os.environ:
        launch()
        return
    if args.mmap_threshold is not None:
        fix_mmap_threshold(args.mmap_threshold)
    run_rank(args)


if __name__ == "__main__":
    main()

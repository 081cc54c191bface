"""``python -m lightning_fpdt.memory``: the memory estimate of a run from the command line.

    python -m lightning_fpdt.memory --config examples/configs/tiny_cpu.yaml
    python -m lightning_fpdt.memory --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --vocab 128256 \\
        --seq 1048576 --sp 8 --chunk-size 65536 --offload --checkpointing --precision bf16-mixed
    python -m lightning_fpdt.memory --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --vocab 128256 \\
        --seq 4194304 --sp 64 --ring 8 --chunk-size 65536 --offload --checkpointing --precision bf16-mixed

``--ring``: Ulysses ``sp / ring`` x ring ``ring``. After the memory table it prints the bytes attention moves
per step and rank (all-to-alls and ring, :func:`~lightning_fpdt.memory.communication_bytes`). With
``--config`` (an ``fpdt-train`` YAML) the model is built on the meta device from the YAML's ``model`` and read
like any module (:meth:`ModelShape.from_module`); the run's settings are read as the strategy reads them
(:meth:`EstimateOptions.from_yaml`). Without it, a Llama of the given sizes (:func:`shape_from_config`).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import yaml
from torch import nn

from lightning_fpdt.backends import BACKENDS
from lightning_fpdt.errors import FPDTError, WrongType
from lightning_fpdt.memory import EstimateOptions, ModelShape, communication_bytes, format_bytes, report
from lightning_fpdt.models import GPTConfig, LlamaConfig
from lightning_fpdt.models.convert import FAMILIES
from lightning_fpdt.models.from_config import module_from_yaml


def shape_from_config(config: LlamaConfig | GPTConfig) -> ModelShape:
    """The shape of the bundled :class:`~lightning_fpdt.models.Llama` or :class:`~lightning_fpdt.models.GPT`
    that ``config`` describes, read by :meth:`ModelShape.from_module` from the model built on the meta device
    (no memory, no weights).

    Raises:
        TypeError: ``config`` is not one of the two.
    """
    family = next((f for f in FAMILIES if type(config) is f.config_class), None)
    if family is None:
        raise WrongType(f"shape_from_config takes a LlamaConfig or GPTConfig, got {type(config).__name__};"
                        " for any other model use ModelShape.from_module(model).")
    with torch.device("meta"):
        model = family.model_class(config)
    return ModelShape.from_module(model)[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="an fpdt-train YAML; its model, data.seq_len and strategy are used")
    sizes = {"hidden": 4096, "layers": 32, "heads": 32, "kv-heads": 8, "intermediate": 14336, "vocab": 128256,
             "seq": 262144, "batch": 1, "sp": 1, "dp": 1}  # --dp: the data-parallel size (matters with --shard)
    for name, default in sizes.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--ring", type=int, default=1,
                        help="ring_size: ranks of the ring in each sequence-parallel group (--sp = ulysses x ring);"
                             " with --config, the YAML's strategy ring_size is used")
    parser.add_argument("--chunk-size", type=lambda v: v if v == "auto" else int(v), default=None)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--offload-checkpoints", action="store_true")
    parser.add_argument("--tiled", action="store_true", help="tiled MLP and loss")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--attention-backend", default="sdpa", choices=[b for b in BACKENDS if b != "auto"],
                        help="math materializes a chunk pair's scores; for a model that caps its attention logits"
                        " (Gemma-2), so do sdpa and cudnn without a FlashAttention package")
    parser.add_argument("--budget", type=float, default=None, help="GiB per rank, to resolve chunk_size 'auto'")
    parser.add_argument("--shard", action="store_true", help="shard_parameters (FSDP2 over dp x sp)")
    parser.add_argument("--offload-optimizer", action="store_true")
    args = parser.parse_args(argv)
    budget = args.budget
    try:
        if args.config:
            with open(args.config) as f:
                cfg = yaml.safe_load(f)
            module = _module_from_yaml(cfg.get("model") or {})
            shape, tiling = ModelShape.from_module(module)
            options = EstimateOptions.from_yaml(cfg, batch_size=args.batch, model=module, **tiling)
            seq = ((cfg.get("data") or {}).get("init_args") or {}).get("seq_len", args.seq)
            strategy = (cfg.get("trainer") or {}).get("strategy")
            if budget is None and isinstance(strategy, dict):
                budget = (strategy.get("init_args") or {}).get("memory_budget")
        else:
            shape = shape_from_config(LlamaConfig(
                vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads))
            options = EstimateOptions(
                batch_size=args.batch, chunk_size=args.chunk_size, sequence_parallel_size=args.sp,
                data_parallel_size=args.dp, ring_size=args.ring, offload=args.offload,
                activation_checkpointing=args.checkpointing,
                offload_checkpoints=args.offload_checkpoints, mlp_tiled=args.tiled, loss_tiled=args.tiled,
                precision=args.precision, attention_backend=args.attention_backend, shard_parameters=args.shard,
                offload_optimizer=args.offload_optimizer)
            seq = args.seq
        print(report(shape, seq, options, budget_gib=budget))
        print(communication_report(communication_bytes(shape, options, seq), options))
    except ValueError as err:
        raise SystemExit(str(err)) from None


def communication_report(moved: dict[str, float], options: EstimateOptions) -> str:
    """The lines of :func:`communication_bytes` as the CLI prints them."""
    u, r = options.ulysses_size, options.ring_size
    names = {"all_to_all_forward": f"all-to-all forward (ulysses {u})", "ring_forward": f"ring forward (ring {r})",
             "all_to_all_backward": f"all-to-all backward (ulysses {u})", "ring_backward": f"ring backward (ring {r})"}
    twice = " (forward twice: recomputed)" if options.activation_checkpointing else ""
    lines = [f"bytes moved per step per rank, attention{twice}:"]
    width = max(len(n) for n in names.values())
    lines += [f"  {names[k]:<{width}}  {format_bytes(v):>11}" for k, v in moved.items()]
    lines.append(f"  {'total':<{width}}  {format_bytes(sum(moved.values())):>11}")
    return "\n".join(lines)


def _module_from_yaml(model: dict[str, Any]) -> nn.Module:
    """The YAML's ``model`` built on the meta device as ``fpdt-train`` reads it
    (:func:`~lightning_fpdt.models.from_config.module_from_yaml`): the real module, read by
    :meth:`ModelShape.from_module`, with no memory and no weights."""
    try:
        return module_from_yaml(model, on_meta=True)
    except (ImportError, AttributeError, TypeError, ValueError, OSError) as err:
        raise FPDTError(f"model {model.get('class_path', 'LlamaLM')!r} cannot be built from the YAML's init_args on"
                        f" the meta device ({err}); give the model's sizes as flags instead (--hidden, --layers,"
                        " ...).") from None


if __name__ == "__main__":
    main()

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
(:meth:`EstimateOptions.from_yaml`), and a run flag given (``--seq``, ``--chunk-size``, ``--sp``, ...) replaces the
YAML's value ("what if"). Without it, a Llama of the given sizes (:func:`shape_from_config`).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
import yaml
from torch import nn

from lightning_fpdt.backends import BACKENDS
from lightning_fpdt.errors import FPDTError, WrongType, one_line
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


MODEL_SIZES = {"hidden": 4096, "layers": 32, "heads": 32, "kv-heads": 8, "intermediate": 14336, "vocab": 128256}
# the run's flags, with their defaults without --config (with it, a flag given replaces the YAML's value)
RUN_DEFAULTS = {"seq": 262144, "batch": 1, "sp": 1, "dp": 1, "ring": 1, "chunk_size": None, "offload": False,
                "checkpointing": False, "offload_checkpoints": False, "tiled": False, "precision": "32-true",
                "attention_backend": "sdpa", "budget": None, "shard": False, "offload_optimizer": False}
# flag -> the strategy's init_args key it replaces in a YAML
STRATEGY_KEYS = {"ring": "ring_size", "chunk_size": "chunk_size", "offload": "offload",
                 "checkpointing": "activation_checkpointing", "offload_checkpoints": "offload_checkpoints",
                 "attention_backend": "attention_backend", "budget": "memory_budget", "shard": "shard_parameters",
                 "offload_optimizer": "offload_optimizer"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_fpdt.memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="an fpdt-train YAML: its model is sized, and its data's seq_len and"
                        " batch_size, its trainer's devices, nodes and precision and its strategy are the run's; a run"
                        " flag below replaces the YAML's value")
    model = parser.add_argument_group("the model without --config: a Llama of these sizes (defaults: Llama-3-8B)")
    for name, default in MODEL_SIZES.items():
        model.add_argument(f"--{name}", type=int, default=None, help=f"default {default}")
    run = parser.add_argument_group("the run (defaults without --config)")
    run.add_argument("--seq", type=int, help=f"global tokens per sequence (default {RUN_DEFAULTS['seq']})")
    run.add_argument("--batch", type=int, help=f"sequences per batch (default {RUN_DEFAULTS['batch']})")
    run.add_argument("--sp", type=int, help=f"sequence_parallel_size (default {RUN_DEFAULTS['sp']})")
    run.add_argument("--dp", type=int, help="data-parallel size, which matters with --shard (default"
                     f" {RUN_DEFAULTS['dp']}); with --config, --sp and --dp set the world (sp x dp ranks over the"
                     " YAML's nodes)")
    run.add_argument("--ring", type=int, help="ring_size: ranks of the ring in each sequence-parallel group"
                     f" (--sp = ulysses x ring; default {RUN_DEFAULTS['ring']})")
    run.add_argument("--chunk-size", type=lambda v: v if v == "auto" else int(v), help="global tokens per attention"
                     " chunk, or auto (default: one chunk)")
    run.add_argument("--offload", action="store_true", default=None, help="offloaded attention chunks")
    run.add_argument("--checkpointing", action="store_true", default=None, help="activation checkpointing")
    run.add_argument("--offload-checkpoints", action="store_true", default=None)
    run.add_argument("--tiled", action="store_true", default=None, help="tiled MLP and loss")
    run.add_argument("--precision", help=f"Lightning's precision string (default {RUN_DEFAULTS['precision']})")
    run.add_argument("--attention-backend", choices=[b for b in BACKENDS if b != "auto"],
                     help=f"default {RUN_DEFAULTS['attention_backend']}; math materializes a chunk pair's scores; for"
                     " a model that caps its attention logits (Gemma-2), so do sdpa and cudnn without a FlashAttention"
                     " package")
    run.add_argument("--budget", type=float, help="GiB per rank, to resolve chunk_size 'auto'")
    run.add_argument("--shard", action="store_true", default=None, help="shard_parameters (FSDP2 over dp x sp)")
    run.add_argument("--offload-optimizer", action="store_true", default=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    given = {name: getattr(args, name) for name in RUN_DEFAULTS if getattr(args, name) is not None}
    try:
        if args.config:
            sizes = [f"--{name}" for name in MODEL_SIZES if getattr(args, name.replace("-", "_")) is not None]
            if sizes:
                raise FPDTError(f"{' '.join(sizes)}: the sizes of a Llama without --config; with --config the YAML's"
                                " model is sized. Drop them, or drop --config.")
            cfg = _with_flags(_read_yaml(args.config), given)
            module = _module_from_yaml(cfg.get("model") or {})
            shape, tiling = ModelShape.from_module(module)
            if given.get("tiled"):
                tiling = {"mlp_tiled": True, "loss_tiled": True}
            options = EstimateOptions.from_yaml(cfg, batch_size=1, model=module, **tiling)
            seq = ((cfg.get("data") or {}).get("init_args") or {}).get("seq_len", RUN_DEFAULTS["seq"])
            strategy = (cfg.get("trainer") or {}).get("strategy")
            budget = (strategy.get("init_args") or {}).get("memory_budget") if isinstance(strategy, dict) else None
        else:
            run = {**RUN_DEFAULTS, **given}
            size = {name: getattr(args, name.replace("-", "_")) or default for name, default in MODEL_SIZES.items()}
            shape = shape_from_config(LlamaConfig(
                vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["intermediate"],
                num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                num_key_value_heads=size["kv-heads"]))
            options = EstimateOptions(
                batch_size=run["batch"], chunk_size=run["chunk_size"], sequence_parallel_size=run["sp"],
                data_parallel_size=run["dp"], ring_size=run["ring"], offload=run["offload"],
                activation_checkpointing=run["checkpointing"], offload_checkpoints=run["offload_checkpoints"],
                mlp_tiled=run["tiled"], loss_tiled=run["tiled"], precision=run["precision"],
                attention_backend=run["attention_backend"], shard_parameters=run["shard"],
                offload_optimizer=run["offload_optimizer"])
            seq, budget = run["seq"], run["budget"]
        print(report(shape, seq, options, budget_gib=budget))
        print(communication_report(communication_bytes(shape, options, seq), options))
    except ValueError as err:
        raise SystemExit(str(err)) from None


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return yaml.safe_load(f) or {}
    except OSError as err:
        raise FPDTError(f"--config {path!r} cannot be read ({err.strerror or err}).") from None
    except yaml.YAMLError as err:
        raise FPDTError(f"--config {path!r} is not valid YAML ({one_line(err)}).") from None


def _section(mapping: dict[str, Any], key: str) -> dict[str, Any]:
    """``mapping[key]``, a dict (made empty where the YAML has nothing there)."""
    if not isinstance(mapping.get(key), dict):
        mapping[key] = {}
    return mapping[key]


def _with_flags(cfg: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` (a YAML's content) with the run flags that were given in place of its values: the data's ``seq_len``
    and ``batch_size``, the trainer's precision, and with ``--sp``/``--dp`` its devices (sp x dp ranks over its
    nodes), the strategy's options."""
    cfg = copy.deepcopy(cfg)
    trainer = _section(cfg, "trainer")
    if not isinstance(trainer.get("strategy"), dict):  # a name ("fpdt") or nothing: the strategy's defaults
        trainer["strategy"] = {"class_path": "lightning_fpdt.FPDTStrategy"}
    init, data_init = _section(trainer["strategy"], "init_args"), _section(_section(cfg, "data"), "init_args")
    for flag, key in (("seq", "seq_len"), ("batch", "batch_size")):
        if flag in given:
            data_init[key] = given[flag]
    if "precision" in given:
        trainer["precision"] = given["precision"]
    for flag, key in STRATEGY_KEYS.items():
        if flag in given:
            init[key] = given[flag]
    if "sp" in given or "dp" in given:
        nodes = int(trainer.get("num_nodes", 1))
        sp = given.get("sp") or init.get("sequence_parallel_size")
        if not isinstance(sp, int):
            raise FPDTError(f"--dp {given['dp']} needs --sp: the YAML's sequence_parallel_size is {sp!r}.")
        world = sp * given.get("dp", 1)
        if world % nodes:
            raise FPDTError(f"--sp {sp} x --dp {given.get('dp', 1)} = {world} ranks do not split over the YAML's"
                            f" {nodes} nodes; give a multiple of {nodes}.")
        init["sequence_parallel_size"], trainer["devices"] = sp, world // nodes
    return cfg


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
                        f" the meta device ({err}); drop --config and give a Llama's sizes as flags (--hidden,"
                        " --layers, ...).") from None


if __name__ == "__main__":
    main()

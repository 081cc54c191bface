"""``fpdt-train``: the LightningCLI entry point.

    fpdt-train fit --config examples/configs/tiny_cpu.yaml
    fpdt-train validate --config ... --ckpt_path ...
    fpdt-train fit --config ... --print_config

The strategy is given by name (``strategy: fpdt``) or by ``class_path: lightning_fpdt.FPDTStrategy``
with its options; the model and data by ``class_path``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml
from lightning.pytorch.cli import LightningCLI, LRSchedulerTypeTuple
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch.optim import Optimizer

from lightning_fpdt.checkpoints import files as checkpoint_files
from lightning_fpdt.data import PasskeyDataModule
from lightning_fpdt.errors import FPDTError, is_said_by_every_rank
from lightning_fpdt.memory import EstimateOptions, ModelShape, report
from lightning_fpdt.memory.planning import optimizer_spec_kind
from lightning_fpdt.models import CausalLM, LlamaLM
from lightning_fpdt.models.class_paths import class_path_of
from lightning_fpdt.models.from_config import (
    MODEL_DEFAULT,
    model_parser,
    module_from_hyperparameters,
    module_from_yaml,
    saved_class,
)
from lightning_fpdt.strategy import FPDTStrategy


class FPDTCLI(LightningCLI):
    """LightningCLI with the project's models and data modules as defaults, and LightningCLI's top-level
    ``optimizer:`` and ``lr_scheduler:`` keys given to the model (``CausalLM``'s arguments of those names), which
    makes them on the parameters the strategy set up (``auto_configure_optimizers`` would make them here, before the
    strategy shards or loads any weight, and drop the model's weight-decay groups)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        # the model key as lightning_fpdt.models.from_config.model_parser builds it (fpdt-export and the memory CLI)
        parser.set_defaults({"model": MODEL_DEFAULT,
                             "data": {"class_path": "lightning_fpdt.data.PasskeyDataModule"}})
        # LightningCLI's top-level optimizer and lr_scheduler keys, linked to the model's arguments of those names:
        # made in configure_optimizers on the parameters the strategy set up, kept in the checkpoint as plain data
        for key, bases in (("optimizer", (Optimizer,)), ("lr_scheduler", LRSchedulerTypeTuple)):
            parser.add_subclass_arguments(bases, key, instantiate=False, fail_untyped=False, required=False,
                                          skip={"params", "optimizer"})
            parser.link_arguments(key, f"model.init_args.{key}", compute_fn=_plain_spec)

    def _parse_ckpt_path(self) -> None:
        """The model of a run resumed with ``--ckpt_path`` (a file, or a sharded checkpoint's directory): the
        checkpoint's own class and hyper-parameters when the config names no model; when it names one, that model,
        after checking that it is the checkpoint's (the same class, parameter names and shapes), else the run stops
        naming both (:func:`resumed_model`). A checkpoint that cannot be read is reported by
        :func:`lightning_fpdt.checkpoints.files.read` (the file and what is wrong), one that does not exist here,
        before any process is launched."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not isinstance(ckpt_path, str) or _names_a_checkpoint_elsewhere(ckpt_path):
            return super()._parse_ckpt_path()
        path = Path(ckpt_path)
        if not path.exists():
            raise SystemExit(
                f"fpdt-train: --ckpt_path {ckpt_path!r} does not exist (no such file or directory). Give the path of"
                " a saved checkpoint (a .ckpt file, or a sharded checkpoint's directory); the newest complete one in"
                " a directory is lightning_fpdt.checkpoints.files.latest_checkpoint(dirpath). Drop --ckpt_path to"
                " start from scratch."
            )
        saved = checkpoint_files.read(path / "meta.pt" if path.is_dir() else path, mmap=path.is_file())
        hparams = dict(saved.get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        self._keep_optimizers(ckpt_path, subcommand, {k: hparams.pop(k, None) for k in ("optimizer", "lr_scheduler")})
        given = self.config[subcommand].model.as_dict()
        model = resumed_model(ckpt_path, hparams, None if given == _default_model() else given)
        if model is not None:
            self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)

    def _keep_optimizers(self, ckpt_path: str, subcommand: str, saved: dict[str, Any]) -> None:
        """A resumed run makes the optimizer and scheduler the checkpoint's state belongs to: the checkpoint's
        when the config gives none, the config's when it gives the same classes (other arguments may change).

        Raises:
            SystemExit: the config gives another optimizer or scheduler class than the checkpoint's (its state
                would not load), naming both."""
        for key, spec in saved.items():
            given = _plain_spec(self.config[subcommand].get(key))
            if given is None and spec is not None:
                self.config = self.parser.parse_object({subcommand: {key: spec}}, self.config)
                continue
            theirs, ours = (s["class_path"] if s else "the default" for s in (spec, given))
            if theirs != ours:
                raise SystemExit(
                    f"fpdt-train: --ckpt_path {ckpt_path} was trained with {key} {theirs}, whose state it holds; the"
                    f" config gives {ours}. Resume with the same {key} class (its arguments may change), or start"
                    " a new run without --ckpt_path."
                )

    def before_fit(self) -> None:
        """Refuse what the configuration alone decides about the model under the strategy (``check_binding``:
        head counts, token mixers, dropout where layers are recomputed), then print the memory estimate of the run
        (rank 0), both before any process is launched or model moved."""
        strategy, check = self.trainer.strategy, getattr(self.model, "check_binding", None)
        # what every rank refuses first, before the estimate, which assumes it; where this process launches the ranks
        # (torchrun's workers each check their own world first), and without the backend, which asks CUDA
        if isinstance(strategy, FPDTStrategy) and not strategy.cluster_environment.creates_processes_externally:
            strategy.check_run(self.model, backend=False)
        if isinstance(strategy, FPDTStrategy) and callable(check):
            check(strategy.sequence_parallel_size, strategy.options.activation_checkpointing)
        table = memory_report(self.model, self.datamodule, self.trainer)
        if table is not None:
            rank_zero_info(table)


def _plain_spec(spec: Any) -> dict[str, Any] | None:
    """A parsed optimizer or scheduler (``class_path`` and ``init_args``) as the plain dict a model keeps."""
    return None if spec is None else (spec.as_dict() if hasattr(spec, "as_dict") else dict(spec))


def _default_model() -> dict[str, Any]:
    """The model section of a config that names none (``LlamaLM`` with its defaults), as the parser fills it in."""
    return model_parser().parse_object({"model": MODEL_DEFAULT}).model.as_dict()


def resumed_model(ckpt_path: str, hparams: dict[str, Any], given: dict[str, Any] | None) -> dict[str, Any] | None:
    """The model section a run resumed from a checkpoint with these saved hyper-parameters trains: the checkpoint's
    (``_class_path``, or its class as :func:`~lightning_fpdt.models.from_config.saved_class` knows it) when the
    config names no model (``given is None``), else ``None``: the config's own, once checked to be the same model.

    Raises:
        SystemExit: the config's model is not the checkpoint's (another class, or parameters of other names or
            shapes), naming both and the fields that differ.
    """
    cls = saved_class(hparams)
    args = {k: v for k, v in hparams.items() if not k.startswith("_")}
    if given is None:
        return {"class_path": class_path_of(cls), "init_args": args}
    theirs = module_from_hyperparameters(hparams, on_meta=True)
    ours = module_from_yaml(given, on_meta=True)
    shapes = [{n: tuple(t.shape) for n, t in m.state_dict().items()} for m in (theirs, ours)]
    if type(theirs) is type(ours) and shapes[0] == shapes[1]:
        return None
    fields = [f"{key}: {a!r} in the checkpoint, {b!r} in the config" for key, a, b in _differing(args, given.get(
        "init_args") or {})][:6]
    missing = sorted(shapes[0].keys() - shapes[1].keys())[:3]
    raise SystemExit(
        f"fpdt-train: --ckpt_path {ckpt_path} holds a {type(theirs).__name__} of {_count(shapes[0])} parameters"
        f" ({len(shapes[0])} tensors); the config's model is a {type(ours).__name__} of {_count(shapes[1])}"
        f" ({len(shapes[1])} tensors){': ' + '; '.join(fields) if fields else ''}"
        f"{'; only in the checkpoint: ' + ', '.join(missing) if missing else ''}. Resume with the model the"
        " checkpoint was trained with (the run's config, or no model section: the checkpoint's own is used), or"
        " start a new run without --ckpt_path."
    )


def _count(shapes: dict[str, tuple[int, ...]]) -> str:
    total = sum(math.prod(shape) for shape in shapes.values())
    return f"{total / 1e6:.2f}M" if total >= 1e5 else str(total)


def _differing(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted key, a's value, b's value)`` of the leaves both dicts have with different values, ``b``'s ``None``
    (a default the class resolves) left out; a config may hold its object as ``class_path``/``init_args``: compared
    by its ``init_args``."""
    if isinstance(b, dict) and "init_args" in b and not (isinstance(a, dict) and "init_args" in a):
        b = b["init_args"]
    if not (isinstance(a, dict) and isinstance(b, dict)):
        same = b is None or a == b or (isinstance(a, (list, tuple)) and list(a) == list(b or []))
        return [] if same else [(prefix, a, b)]
    return [d for key in a.keys() & b.keys() for d in _differing(a[key], b[key], f"{prefix}.{key}".lstrip("."))]


def _names_a_checkpoint_elsewhere(ckpt_path: str) -> bool:
    """Lightning's names for checkpoints it finds itself ("last", "best", "hpc", "registry:...") and remote URLs."""
    return ckpt_path in ("last", "best", "hpc", "registry") or ckpt_path.startswith("registry:") or "://" in ckpt_path


def memory_report(model: pl.LightningModule, datamodule: Any, trainer: pl.Trainer) -> str | None:
    """:func:`lightning_fpdt.memory.report` for this model, the data module's ``seq_len`` and
    ``batch_size`` and an :class:`FPDTStrategy`; ``None`` when one of them is missing (a custom model
    the memory model cannot read, a data module without ``seq_len``, another strategy)."""

    seq_len = getattr(datamodule, "seq_len", None)
    if not isinstance(trainer.strategy, FPDTStrategy) or not isinstance(seq_len, int):
        return None
    try:
        shape, tiling = ModelShape.from_module(model)
    except ValueError:
        return None
    strategy = trainer.strategy
    # this model's heads resolve ring_size="auto" (the strategy holds no model before fit)
    options = EstimateOptions.from_strategy(strategy.options, strategy.num_nodes, strategy.num_processes,
                                            model=model).replace(
        batch_size=getattr(datamodule, "batch_size", 1), precision=str(trainer.precision), **tiling,
        # the optimizer the model's spec will make (a model of its own making: the estimate's default, two states)
        **({"optimizer": optimizer_spec_kind(model.optimizer_spec)} if hasattr(model, "optimizer_spec") else {}))
    try:
        return report(shape, seq_len, options, budget_gib=strategy.options.memory_budget)
    except ValueError as err:  # nothing fits the budget: the strategy raises the same at the first batch
        return f"memory estimate: {err}"


def check_config_files(args: list[str]) -> None:
    """Fail with the file's name when a ``--config`` file is missing or is not valid YAML.

    jsonargparse reports YAML errors without saying which file they come from.
    """
    paths = [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    paths += [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config", "-c")]
    for path in paths:
        if not os.path.isfile(path):
            raise SystemExit(f"fpdt-train: config file {path!r} does not exist.")
        try:
            with open(path) as f:
                yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise SystemExit(f"fpdt-train: {path!r} is not valid YAML: {err}") from None


def run(args: list[str] | None = None) -> FPDTCLI:
    """Run the CLI (``args`` defaults to ``sys.argv[1:]``) and return it."""
    check_config_files(sys.argv[1:] if args is None else args)
    return FPDTCLI(
        CausalLM,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


# messages of this package's classes start with the class (or command) name: how an FPDTError is recognised once
# jsonargparse has turned it into text (a strategy given as `str | Strategy` keeps no exception, only its words)
_OWN_ERROR = re.compile(r"^(FPDTStrategy|fpdt-train|fpdt-eval|[A-Za-z]*Config|[A-Za-z]*DataModule|[A-Za-z]*LM|"
                        r"shard_batch|LongContextEvaluation|[A-Za-z]*Task|Haystack|evaluate): ")


def own_message(err: BaseException) -> str | None:
    """The message a user must read in an error raised while the CLI builds its objects or before the ranks start:
    the package's own (an :class:`~lightning_fpdt.errors.FPDTError` in the chain of causes, or its words where
    jsonargparse wrapped them in a usage dump and, for the strategy's ``str | Strategy`` type, in a list of the
    union's subtypes); ``None`` for other errors."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        if isinstance(err, FPDTError) and text.strip():
            return text.strip().splitlines()[0]
        if "Does not validate against any of the Union subtypes" in text:
            reasons = _union_reasons(text)
            if reasons:
                return reasons[-1]
        for line in text.splitlines():
            if _OWN_ERROR.match(line.strip()):
                return line.strip()
        err = err.__cause__ or err.__context__
    return None


_UNION_NOISE = ("Expected a", "Does not validate against", "Import path ")  # the subtypes it simply is not


def _union_reasons(text: str) -> list[str]:
    """The reasons jsonargparse lists for the subtypes of a union a value did not validate against, each with its
    indented continuation (transformers' own reason under a config's validation error), without the subtypes the
    value simply is not."""
    lines, reasons = text.splitlines(), []
    for i, line in enumerate(lines):
        item = line.lstrip()
        if not item.startswith("- "):
            continue
        indent, parts = len(line) - len(item), [item[2:]]
        for following in lines[i + 1:]:
            more = following.lstrip()
            if not more or len(following) - len(more) <= indent or more.startswith(("- ", "Subtypes:", "Errors:",
                                                                                      "Given value")):
                break
            parts.append(more)
        reasons.append(" ".join(parts))
    return [r for r in reasons if not r.startswith(_UNION_NOISE)]


def console_main(program: str, run: Callable[[], Any]) -> None:
    """A console script: ``run()``, with the package's own errors (:func:`own_message`: a refusal of the objects it
    builds, of the run before or after the ranks start, a lost peer) printed as one last line, ``{program}: error:
    ...``, instead of behind a usage dump or a traceback; any other error is raised as it is.

    A refusal every rank makes alike (:func:`~lightning_fpdt.errors.said_by_every_rank`) is printed by global rank 0
    only; the other ranks exit with the same status, quietly. Under torchrun each rank also leaves the line in its
    error file, so torchrun's failure summary names it."""
    quiet_lightning()
    try:
        run()
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as err:
        message = own_message(err)
        if message is None:
            raise
        line = f"{program}: error: {message}"
        leave_for_torchrun(line)
        if is_said_by_every_rank(err) and getattr(rank_zero_only, "rank", 0) != 0:
            raise SystemExit(1) from None
        raise SystemExit(line) from None


# what Lightning and its dependencies print that says nothing about the run (a console script's output only)
_NOISE_WARNINGS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning's pytree helper on torch >= 2.10, per rank
    r"LightningCLI's args parameter is intended",  # fpdt-eval gives LightningCLI its own arguments on purpose
)


class _NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("\N{ELECTRIC LIGHT BULB} Tip:")


def quiet_lightning() -> None:
    """Silence, for a console script, what says nothing about the run: Lightning's advertisements for its cloud
    packages and the warnings of :data:`_NOISE_WARNINGS` (each naming Lightning's or the CLI's own code)."""
    for pattern in _NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoTips) for f in logger.filters):
        logger.addFilter(_NoTips())


def leave_for_torchrun(line: str) -> None:
    """Write ``line`` to this worker's error file when torchrun gave it one, in torchelastic's error-file format, with
    the line as its call stack: torchrun's failure summary then shows the line, not the console script's frames."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
    with open(path, "w") as f:
        json.dump({"message": record}, f)


def main() -> None:
    """The ``fpdt-train`` console script: LightningCLI on ``sys.argv`` (:func:`console_main`)."""
    console_main("fpdt-train", run)


__all__ = ["FPDTCLI", "LlamaLM", "PasskeyDataModule", "main", "run"]

if __name__ == "__main__":
    main()

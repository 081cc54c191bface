"""The transformers releases lightning-fpdt is tested with, and what happens on one it does not recognise.

transformers 5.25 bound the hybrids' kernels differently from 5.24 (``kernels`` ``Func`` modules, reached through
per-layer wrappers) and the families fell out of sequence parallelism without a word about why. Here: the declared
range is the one the code names and the lock pins; a release whose delta-rule kernel is renamed (simulated) is
refused once, in the launching process, before any rank starts, naming the layer, the installed release, the tested
range and the fix; what the install check catches is named, not swallowed; and the memory model sizes a layer left
unrecognised as what it then runs (its family's kernel over the whole sequence).
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402

from lightning_fpdt import FPDTStrategy  # noqa: E402
from lightning_fpdt.hf.kernel_binding import kernel_function, kernel_name, reached_kernels  # noqa: E402
from lightning_fpdt.hf.recurrent import CONV, DELTA_RULE, recurrence_core  # noqa: E402
from lightning_fpdt.hf.recurrent_memory import mixer_memory  # noqa: E402
from lightning_fpdt.hf.versions import TESTED_TRANSFORMERS  # noqa: E402
from lightning_fpdt.memory import EstimateOptions, ModelShape, estimate  # noqa: E402
from tests.helpers import TokenDataset, dataloader  # noqa: E402
from tests.hf.test_recurrent import _hybrid  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
UNTESTED = "5.99.0"


def test_declared_range_is_the_tested_one_and_the_lock_pins_inside_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra in ("hf", "dev"):
        declared = [r for r in project["optional-dependencies"][extra] if r.startswith("transformers")]
        assert declared == [f"transformers{TESTED_TRANSFORMERS}"], (extra, declared)
    pins = dict(line.split("==") for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for package in ("torch", "lightning", "transformers", "peft", "datasets", "tokenizers", "safetensors",
                    "jsonargparse"):
        assert package in pins, f".ci/constraints.txt pins no {package}"
    low, high = (tuple(int(x) for x in bound.split(".")) for bound in re.findall(r"[\d.]+", TESTED_TRANSFORMERS))
    assert low <= tuple(int(x) for x in pins["transformers"].split(".")[:2]) < high


def _module_of(module: torch.nn.Module, kind: str) -> tuple[str, torch.nn.Module]:
    return next((n, m) for n, m in module.model.named_modules() if type(m).__name__ == kind)


def test_kernels_are_recognised_by_what_they_are_however_they_are_bound() -> None:
    """The installed release's Qwen3.5 layer reaches the convolution and the delta rule (directly or through its
    wrappers, as functions or ``kernels`` modules); the same function bound under another name is recognised by
    its own; an ordinary module is no kernel."""
    _, layer = _module_of(_hybrid("qwen3_5_text", 0), "Qwen3_5GatedDeltaNet")
    reached = reached_kernels(type(layer).forward)
    assert {CONV, DELTA_RULE} <= set(reached)
    assert recurrence_core(layer) == DELTA_RULE
    bound = getattr(modeling_qwen3_5, reached[DELTA_RULE])
    assert kernel_name(bound) == DELTA_RULE and kernel_function(bound) is not None
    assert kernel_name(torch.nn.Linear(2, 2)) is None and kernel_name(3) is None


def _renamed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release whose delta-rule kernel has another name (and a version outside the tested range)."""
    original = kernel_function(modeling_qwen3_5.torch_chunk_gated_delta_rule)

    @functools.wraps(original)
    def chunk_gated_delta_rule_v2(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    del chunk_gated_delta_rule_v2.__wrapped__  # a function of its own, not a wrapper of the known one
    chunk_gated_delta_rule_v2.__name__ = "chunk_gated_delta_rule_v2"
    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", chunk_gated_delta_rule_v2)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", UNTESTED)


@pytest.mark.parametrize("start_method", ["spawn", "popen"])
def test_an_unrecognised_release_is_refused_once_before_any_rank_starts(
        start_method: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _renamed(monkeypatch)
    module = _hybrid("qwen3_5_text", 0)
    assert module.recurrences == [] and module.not_installed

    def no_process(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a rank was started before the refusal")

    steps: list[int] = []
    monkeypatch.setattr(torch.multiprocessing, "start_processes", no_process)  # spawn
    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", no_process)  # popen
    monkeypatch.setattr(type(module), "training_step", lambda self, *a, **k: steps.append(1))
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        strategy=FPDTStrategy(chunk_size=8, start_method=start_method))
    with pytest.raises(NotImplementedError) as caught:
        trainer.fit(module, dataloader(TokenDataset(2, 32, 64, seed=0), 2))
    message = str(caught.value)
    assert "\n" not in message and steps == []
    for said in ("HFCausalLM: model.model.layers.0.linear_attn (Qwen3_5GatedDeltaNet) (and 1 more layer(s) alike)",
                 "sequence_parallel_size=2", f"installed transformers {UNTESTED}", "it reaches causal_conv1d_fn.",
                 f"transformers{TESTED_TRANSFORMERS} (tested)", f"pip install 'transformers{TESTED_TRANSFORMERS}'",
                 "sequence_parallel_size=1"):
        assert said in message, (said, message)
    assert "mixes tokens" not in message


def test_one_process_still_trains_an_unrecognised_release(monkeypatch: pytest.MonkeyPatch) -> None:
    _renamed(monkeypatch)
    module = _hybrid("qwen3_5_text", 0)
    module.refuse_token_mixers(1)  # one process sees every position: accepted


def test_what_the_install_check_catches_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release whose delta rule is recognised but takes other arguments: the check's error is the reason."""
    kernel = modeling_qwen3_5.torch_chunk_gated_delta_rule

    @functools.wraps(kernel_function(kernel))
    def strict(*args: Any, initial_state: Any = None, **kwargs: Any) -> Any:
        if initial_state is not None:
            raise TypeError("initial_state is no longer an argument (state= is)")
        return kernel(*args, **kwargs)

    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", strict)
    module = _hybrid("qwen3_5_text", 0)
    assert module.recurrences == []
    with pytest.raises(NotImplementedError, match=r"raised TypeError: initial_state is no longer an argument"):
        module.refuse_token_mixers(2)


def test_the_memory_model_sizes_an_unrecognised_layer_as_its_whole_sequence_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    recognised = _hybrid("qwen3_5_text", 0)
    assert mixer_memory(_module_of(recognised, "Qwen3_5GatedDeltaNet")[1]).chunked
    _renamed(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unrecognised = _hybrid("qwen3_5_text", 0)
    memory = mixer_memory(_module_of(unrecognised, "Qwen3_5GatedDeltaNet")[1])
    assert memory is not None and not memory.chunked and memory.kept_float32() > 0
    sizes = [estimate(ModelShape.from_module(m)[0], 4096, EstimateOptions(chunk_size=512)).saved_activations
             for m in (recognised, unrecognised)]
    assert sizes[1] > 1.5 * sizes[0], sizes

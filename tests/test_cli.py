"""The fpdt-train CLI end to end: TensorBoard scalars, profiler traces, and clear errors."""

from __future__ import annotations

import glob
import math
import os
import re
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_fpdt.cli import FPDTCLI, memory_report, own_message
from lightning_fpdt.cli import main as cli_main
from lightning_fpdt.testing import free_port, run_in_fork

pytestmark = pytest.mark.distributed  # every test here starts several processes

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"


def fpdt_train(*args: str, cwd: Path, timeout: float = 240,
               variables: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``fpdt-train ARGS`` as a fresh interpreter (the console entry point, popen launcher and all), with this
    process's environment and ``variables``."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(variables or {})}
    return subprocess.run([sys.executable, "-m", "lightning_fpdt.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def fpdt_train_side_by_side(runs: dict[str, tuple[list[str], Path]]) -> dict[str, subprocess.CompletedProcess]:
    """:func:`fpdt_train` runs started together (``runs``: each one's arguments and directory), each waited for by a
    thread of its own: runs that mostly import (one core each) go side by side. Each has a ``MASTER_PORT`` of its own
    (an earlier test's Trainer may have left one in this process's environment, 309573f)."""
    ports: list[int] = []
    while len(ports) < len(runs):
        port = free_port()
        if port not in ports:
            ports.append(port)
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = {key: pool.submit(fpdt_train, *args, cwd=cwd, variables={"MASTER_PORT": str(port)})
                   for (key, (args, cwd)), port in zip(runs.items(), ports)}
        return {key: future.result() for key, future in futures.items()}


def fpdt_train_forked(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``fpdt-train ARGS`` in a child forked from this process (no interpreter start, its output captured),
    for runs whose strategy uses the fork launcher or that end before any launch: the popen launcher would
    re-run this process's own command line (pytest)."""

    def run() -> None:
        os.chdir(cwd)
        sys.argv = ["fpdt-train", *args]
        warnings.simplefilter("ignore")  # as PYTHONWARNINGS=ignore does for fpdt_train
        cli_main()

    return run_in_fork(run, ["fpdt-train", *args], timeout)


def _scalars(log_dir: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_fit_logs_to_tensorboard_and_profiles(tmp_path: Path) -> None:
    proc = fpdt_train(
        "fit", "--config", str(TINY), "--trainer.max_steps=8", "--trainer.val_check_interval=8",
        "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--data.init_args.seq_len=256", "--trainer.profiler=pytorch", cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step     1  loss" in proc.stdout + proc.stderr
    event_dirs = {os.path.dirname(p) for p in glob.glob(str(tmp_path / "tiny_cpu" / "*" / "events.out.tfevents.*"))}
    assert len(event_dirs) == 1, event_dirs
    scalars = _scalars(event_dirs.pop())
    expected = ["train/loss", "train/items_per_sec", "fpdt/seq_len", "fpdt/chunks", "fpdt/offload_bytes_to_host",
                "fpdt/prefetch_wait_s", "fpdt/pipeline_peak_device_mib", "val/loss", "val/answer_accuracy"]
    for tag in expected:
        assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
        assert scalars[tag] and all(math.isfinite(v) for v in scalars[tag]), (tag, scalars[tag])
    assert scalars["fpdt/seq_len"][-1] == 256 and scalars["fpdt/chunks"][-1] == 2
    assert scalars["train/items_per_sec"][-1] > 0
    # the attention route, said once: at setup beside attention_backend, and as text beside the figures
    said = f"attention_backend='auto' (sdpa (torch {torch.__version__}'s cpu flash kernel))"
    assert said in proc.stdout + proc.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    texts = EventAccumulator(glob.glob(str(tmp_path / "tiny_cpu" / "*"))[0], size_guidance={"tensors": 0})
    texts.Reload()
    route = [e.tensor_proto.string_val[0].decode() for e in texts.Tensors("fpdt/attention_route/text_summary")]
    assert route == [f"sdpa (torch {torch.__version__}'s cpu flash kernel)"], route
    # and what the first step's attention ran on: 2 layers x 3 blocks (2 chunks, causal), all on that kernel
    calls = "sdpa: torch's cpu flash kernel: 6 calls"
    assert f"attention calls of the first training batch: {calls}\n" in proc.stdout + proc.stderr
    said = [e.tensor_proto.string_val[0].decode() for e in texts.Tensors("fpdt/attention_calls/text_summary")]
    assert said == [calls], said
    traces = glob.glob(str(tmp_path / "**" / "*.pt.trace.json"), recursive=True)
    assert traces, f"no profiler traces under {tmp_path}"
    text = "".join(Path(t).read_text() for t in traces)
    for name in ("fpdt/all_to_all", "fpdt/attention_chunk", "fpdt/attention_chunk_backward", "fpdt/loss_tile"):
        assert name in text, f"{name} not in the profiler traces"


def fpdt_train_here(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """``fpdt-train`` in this process, for runs that end before any process is launched (bad configuration,
    ``--print_config``): saves an interpreter start per test. Returns the exit code, stdout and stderr, with
    an uncaught exception or ``SystemExit`` message in stderr as the interpreter would print it."""
    monkeypatch.setattr(sys, "argv", ["fpdt-train", *args])
    code, message = 0, ""
    try:
        cli_main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
        message = "" if isinstance(exit_.code, int) or exit_.code is None else str(exit_.code)
    except Exception as err:
        code, message = 1, f"{type(err).__name__}: {err}"
    out = capsys.readouterr()
    return code, out.out, out.err + message


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer.strategy.init_args.chunk_sise=64"], "chunk_sise"),
        (
            ["--data=lightning_fpdt.data.TokenFileDataModule", "--data.path=/nonexistent.u16"],
            "no token file at '/nonexistent.u16'",
        ),
    ],
    ids=["unknown-strategy-option", "missing-data-file"],
)
def test_bad_configuration_is_reported(monkeypatch, capsys, args: list[str], message: str) -> None:
    code, _, err = fpdt_train_here(monkeypatch, capsys, "fit", "--config", str(TINY), *args)
    assert code != 0
    assert message in err, err[-3000:]


@pytest.mark.parametrize("args, message", [
    (["--trainer.strategy.init_args.sequence_parallel_size=4"],
     "sequence_parallel_size=4 does not divide the world size 2 (1 node(s) x 2 device(s)); use one of [1, 2]."),
    (["--trainer.strategy.init_args.chunk_size=127"], "chunk_size=127 is not divisible by sequence_parallel_size=2"),
], ids=["sequence-parallel-size", "chunk-size"])
def test_a_run_the_strategy_refuses_stops_before_the_memory_estimate(tmp_path: Path, args: list[str],
                                                                     message: str) -> None:
    """What every rank would refuse first is refused before the estimate is printed (the estimate assumed it: a ring
    of 2 for 4 ranks of 2) and before any process starts, as the last line, once."""
    proc = fpdt_train_forked("fit", "--config", str(TINY), *args, cwd=tmp_path, timeout=120)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and message in proc.stderr.strip().splitlines()[-1], said[-3000:]
    assert "memory estimate" not in said and said.count(message) == 1, said[-3000:]


def test_the_check_before_launch_leaves_the_attention_backend_to_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's check asks CUDA about the device (``auto``, cuDNN, FlashAttention-3/4), which would leave ranks
    forked after it (``fpdt_fork``) unable to use CUDA: the launching process checks the rest, the ranks the backend."""
    from lightning_fpdt import options

    def asks_cuda(*args: object) -> None:
        raise AssertionError("the launching process checked the attention backend")

    monkeypatch.setattr(options, "check_attention_backend", asks_cuda)
    cli = FPDTCLI(run=False, args=["--config", str(TINY)])
    cli.before_fit()  # the world, chunk and model checks, then the estimate: no backend check
    with pytest.raises(AssertionError, match="checked the attention backend"):
        cli.trainer.strategy.check_run(cli.model)  # a rank's check (setup_environment) does check it


def test_bad_yaml_is_reported(tmp_path: Path, monkeypatch, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: [1, 2\n")
    code, _, err = fpdt_train_here(monkeypatch, capsys, "fit", "--config", str(bad))
    assert code != 0
    assert "bad.yaml' is not valid YAML" in err and "line 2" in err, err[-3000:]


def test_print_config(monkeypatch, capsys) -> None:
    code, out, err = fpdt_train_here(monkeypatch, capsys, "fit", "--config", str(TINY), "--print_config")
    assert code == 0, err[-3000:]
    assert "class_path: lightning_fpdt.FPDTStrategy" in out and "chunk_size: 128" in out


@pytest.mark.parametrize("given, expected", [
    ([], True), (["--trainer.strategy.init_args.gradient_as_bucket_view=false"], False)])
def test_the_cli_keeps_the_strategy_s_gradient_as_bucket_view(given: list[str], expected: bool) -> None:
    """LightningCLI fills a strategy's ``**kwargs`` with every argument of ``DistributedDataParallel`` at DDP's
    default (``gradient_as_bucket_view=False``): the strategy's own default (one copy of the gradients) holds from a
    YAML file as from Python, and a configuration can still turn it off."""
    cli = FPDTCLI(run=False, args=["--config", str(TINY), *given])
    strategy = cli.trainer.strategy
    assert strategy._ddp_kwargs["gradient_as_bucket_view"] is expected
    assert strategy._options.gradient_as_bucket_view is expected  # what the memory estimate counts


@pytest.mark.parametrize("given, kind, states", [
    ([], "adamw", 2), (["--optimizer", "torch.optim.SGD"], "none", 0),
    (["--optimizer", "torch.optim.SGD", "--optimizer.momentum", "0.9"], "sgd", 1)])
def test_the_printed_memory_estimate_counts_the_configured_optimizer(given: list[str], kind: str, states: int) -> None:
    """The estimate fpdt-train prints before the ranks start counts the optimizer the YAML's ``optimizer:`` key
    makes (it counted AdamW's two states whatever the key said)."""
    cli = FPDTCLI(run=False, args=["--config", str(TINY), *given])
    table = memory_report(cli.model, cli.datamodule, cli.trainer)
    assert table is not None and f"optimizer={kind}," in table, table
    parameters = sum(p.numel() for p in cli.model.parameters()) * 4 / 1024  # float32, KiB
    line = next(row for row in table.splitlines() if row.startswith("optimizer state"))
    assert float(line.split()[-2]) == pytest.approx(states * parameters, abs=1), line


def test_the_printed_memory_estimate_resolves_the_ring_from_the_model_s_heads() -> None:
    """Before the ranks start the strategy holds no model: the estimate resolves ``ring_size="auto"`` from the
    config's model as the ranks will (4 heads of 2 KV heads over 3 ranks: a ring of 3), where it assumed any heads
    fit (ring 1) and foretold a refusal of a run that then trained."""
    cli = FPDTCLI(run=False, args=["--config", str(TINY), "--trainer.devices=3",
                                   "--trainer.strategy.init_args.sequence_parallel_size=3",
                                   "--trainer.strategy.init_args.chunk_size=126"])
    table = memory_report(cli.model, cli.datamodule, cli.trainer)
    assert table is not None and "ring_size=3," in table and "refused" not in table, table


def test_fit_prints_the_memory_estimate_and_resolves_auto_chunks(tmp_path: Path) -> None:
    proc = fpdt_train_forked(
        "fit", "--config", str(TINY), "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
        "--trainer.logger=false",
        "--trainer.strategy.init_args.chunk_size=auto", "--trainer.strategy.init_args.memory_budget=1.0",
        "--trainer.strategy.init_args.start_method=fork", "--data.init_args.seq_len=256",
        "--data.init_args.batch_size=4", cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "memory estimate per rank: 0.1M parameters, seq_len 256, batch_size=4" in out
    assert "chunk_size='auto' with a budget of 1.0 GiB per rank picks None (one chunk: the whole sequence)" in out
    assert "device peak" in out
    assert "FPDTStrategy: chunk_size='auto' picked None (one chunk: the whole sequence) for batches of 4 x 256" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer.strategy.init_args.sequence_parallel_size=0"],
         "fpdt-train: error: FPDTStrategy: sequence_parallel_size must be a positive int or 'auto', got 0."),
        (["--model.init_args.config.num_attention_heads=3"],
         "fpdt-train: error: LlamaConfig: hidden_size=64 is not divisible by num_attention_heads=3."),
    ],
    ids=["strategy-argument", "model-config"],
)
def test_constructor_errors_are_the_last_line(tmp_path: Path, args: list[str], message: str) -> None:
    proc = fpdt_train_forked("fit", "--config", str(TINY), *args, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(message), proc.stderr[-3000:]
    assert "usage:" not in proc.stderr and "Given value" not in proc.stderr, proc.stderr[-3000:]


def test_own_message_finds_the_constructor_error_in_jsonargparse_wrapping() -> None:
    """The CLI's extraction, on the errors jsonargparse raises (the end-to-end cases above run the CLI)."""
    union = ValueError(
        "Does not validate against any of the Union subtypes\nSubtypes: [<class 'str'>, ...]\nErrors:\n"
        "  - Expected a <class 'str'>\n  - FPDTStrategy: chunk_size=3 is not divisible by sequence_parallel_size=2:"
        " ...\nGiven value type: <class 'jsonargparse._namespace.Namespace'>"
    )
    assert own_message(union).startswith("FPDTStrategy: chunk_size=3 is not divisible")
    wrapped = TypeError("Problem with given class_path 'lightning_fpdt.models.LlamaLM'")
    wrapped.__cause__ = ValueError("LlamaConfig: hidden_size=64 is not divisible by num_attention_heads=3.")
    assert own_message(wrapped) == "LlamaConfig: hidden_size=64 is not divisible by num_attention_heads=3."
    assert own_message(ValueError("something else")) is None


RESUME_CONFIG = """\
trainer:
  strategy:
    init_args:
      start_method: fork  # no second interpreter start per run: half the CPU of a popen launch
  max_steps: 4
  limit_val_batches: 0
  logger: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {dirpath}
        filename: "{{step}}"
        every_n_train_steps: 2
        save_top_k: -1
data:
  init_args:
    seq_len: 128
    batch_size: 2
"""


def _final_weights(path: Path) -> dict:
    """The model weights of a checkpoint file, or of a sharded checkpoint directory (converted with DCP)."""

    if path.is_dir():
        converted = path.parent / f"{path.name}.pt"
        dcp_to_torch_save(path, converted)
        return torch.load(converted, weights_only=True)["state_dict"]
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shard", [False, True], ids=["file", "sharded"])
@pytest.mark.parametrize("example", ["tiny_cpu.yaml", "gpt_cpu.yaml", "hf_sft_cpu.yaml", "hf_text_cpu.yaml"])
def test_cli_resumes_every_shipped_model(tmp_path: Path, example: str, shard: bool) -> None:
    """fit (4 steps, checkpoints at 2 and 4) then `fit --ckpt_path step=2.ckpt`: the same weights at step 4, for
    LlamaLM, GPTLM and HFCausalLM runs.

    The checkpoint names its class (a GPTLM or HFCausalLM one used to be rebuilt as the CLI's default LlamaLM:
    "LlamaConfig.__init__() got an unexpected keyword argument 'n_positions'"). LightningCLI reads it with
    torch.load(weights_only=True); the strategy's run state (RNG states, parallelism) used to hold numpy objects,
    which that loader refuses.
    """
    config = ROOT / "examples" / "configs" / example
    extra = ["--trainer.enable_checkpointing=true", "--data.init_args.seq_len=256",
             *(["--trainer.strategy.init_args.shard_parameters=true"] if shard else [])]
    for run, ckpt in (("straight", []), ("resumed", ["--ckpt_path", str(tmp_path / "straight" / "step=2.ckpt")])):
        override = tmp_path / f"{run}.yaml"
        override.write_text(RESUME_CONFIG.format(dirpath=tmp_path / run))
        # run where the example's data paths resolve; its config.yaml goes to the run's own directory
        proc = fpdt_train_forked("fit", "--config", str(config), "--config", str(override), *extra, *ckpt,
                                 f"--trainer.default_root_dir={tmp_path / run}", cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "given both args and sys.argv" not in proc.stderr  # the console script passes no duplicate args
    assert "Restored all states from the checkpoint" in proc.stdout + proc.stderr
    a, b = _final_weights(tmp_path / "straight" / "step=4.ckpt"), _final_weights(tmp_path / "resumed" / "step=4.ckpt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_resume_with_another_model_size_stops_naming_both(tmp_path: Path) -> None:
    """The config's model must be the checkpoint's: a run resumed with another size stops before any process is
    launched (it used to train the checkpoint's size silently), naming both sizes and the fields that differ."""
    config = ROOT / "examples" / "configs" / "gpt_cpu.yaml"
    override = tmp_path / "run.yaml"
    override.write_text(RESUME_CONFIG.format(dirpath=tmp_path / "run").replace("max_steps: 4", "max_steps: 2"))
    proc = fpdt_train_forked("fit", "--config", str(config), "--config", str(override), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = fpdt_train_forked("fit", "--config", str(config), "--config", str(override), "--model.init_args.config"
                             ".n_layer=3", "--ckpt_path", str(tmp_path / "run" / "step=2.ckpt"), cwd=tmp_path)
    assert proc.returncode != 0
    assert re.search(r"holds a GPTLM of 0\.13M parameters \(36 tensors\); the config's model is a GPTLM of 0\.18M"
                     r" \(52 tensors\): config\.n_layer: 2 in the checkpoint, 3 in the config\. Resume with the model",
                     proc.stderr), proc.stderr[-3000:]
    assert not (tmp_path / "run" / "step=4.ckpt").exists()


def test_a_corrupt_checkpoint_names_the_file_and_never_advises_unsafe_loading(tmp_path: Path, monkeypatch,
                                                                             capsys) -> None:
    bad = tmp_path / "broken.ckpt"
    bad.write_bytes(b"PK\x03\x04 not a whole checkpoint")
    code, _, err = fpdt_train_here(monkeypatch, capsys, "fit", "--config", str(TINY), "--trainer.max_steps=1",
                                   "--trainer.logger=false", "--ckpt_path", str(bad))
    assert code != 0
    assert f"the checkpoint {bad} is truncated or corrupt" in err, err[-3000:]
    assert "weights_only=False" not in err and "weights_only set to False" not in err


def test_a_missing_checkpoint_is_the_last_line_before_any_process_starts(tmp_path: Path, monkeypatch, capsys) -> None:
    missing = tmp_path / "runs" / "epoch=0-step=9.ckpt"
    code, _, err = fpdt_train_here(monkeypatch, capsys, "fit", "--config", str(TINY), "--trainer.max_steps=1",
                                   "--trainer.logger=false", "--ckpt_path", str(missing))
    assert code != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"fpdt-train: --ckpt_path {str(missing)!r} does not exist"), err[-3000:]
    assert "latest_checkpoint(dirpath)" in last and "Drop --ckpt_path" in last
    assert "Traceback" not in err and "[rank" not in err, err[-3000:]


def test_cli_trains_a_hugging_face_checkpoint_from_a_local_path(tmp_path: Path) -> None:
    """``fpdt-train fit --config hf_tiny_cpu.yaml --model.model PATH``: a transformers checkpoint on disk (saved
    here, as a download would be) trains under FPDT with its decoder layers checkpointed (offload emulated)."""
    checkpoint = tmp_path / "tiny-llama"
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
    proc = fpdt_train_forked(
        "fit", "--config", str(ROOT / "examples" / "configs" / "hf_tiny_cpu.yaml"), "--model.model", str(checkpoint),
        "--trainer.max_steps=5", "--trainer.limit_val_batches=0", "--data.init_args.seq_len=256",
        "--trainer.strategy.init_args.start_method=fork", "--trainer.strategy.init_args.offload_checkpoints=emulate",
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "bound 2 attention layer(s) to the sequence-parallel group (activation_checkpointing=True," in out, out
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"step +(\d+) +loss ([-\w.]+)", out)}
    assert set(losses) == {1, 5} and all(math.isfinite(v) for v in losses.values()), out[-4000:]


def test_hf_causal_lm_run_logs_flops_and_mfu_to_tensorboard(tmp_path: Path) -> None:
    """``fpdt-train fit --config hf_tiny_cpu.yaml`` with a TensorBoard logger and ``TokenThroughputMonitor``:
    ``HFCausalLM`` counts its FLOPs, so FLOP/s and MFU (against the given peak: a CPU is not in Lightning's
    table of devices) are logged."""
    overlay = tmp_path / "throughput.yaml"
    overlay.write_text(
        "trainer:\n"
        "  logger:\n"
        "    class_path: lightning.pytorch.loggers.TensorBoardLogger\n"
        f"    init_args: {{save_dir: {str(tmp_path)!r}, name: hf}}\n"
        "  callbacks:\n"
        "    - class_path: lightning_fpdt.callbacks.TokenThroughputMonitor\n"
        "      init_args: {window_size: 2, available_flops: 1.0e+12}\n"
    )
    proc = fpdt_train_forked(
        "fit", "--config", str(ROOT / "examples" / "configs" / "hf_tiny_cpu.yaml"), "--config", str(overlay),
        "--trainer.max_steps=4", "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1",
        "--data.init_args.seq_len=256", "--trainer.strategy.init_args.start_method=fork", cwd=tmp_path,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    event_dirs = {os.path.dirname(p) for p in glob.glob(str(tmp_path / "hf" / "*" / "events.out.tfevents.*"))}
    assert len(event_dirs) == 1, event_dirs
    scalars = _scalars(event_dirs.pop())
    for tag in ("train/flops_per_sec", "train/device/flops_per_sec", "train/device/mfu"):
        assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
        assert scalars[tag] and all(math.isfinite(v) and v > 0 for v in scalars[tag]), (tag, scalars[tag])
    assert scalars["train/device/mfu"][-1] == pytest.approx(scalars["train/device/flops_per_sec"][-1] / 1e12)


def test_a_model_the_strategy_would_refuse_is_the_last_line_before_any_process_starts(tmp_path: Path, monkeypatch,
                                                                                     capsys) -> None:
    """LoRA's dropout under activation checkpointing (a recomputation would draw another mask): refused by the
    model's own check in one line, in this process, before any rank is spawned or any data tokenized."""
    code, _, err = fpdt_train_here(
        monkeypatch, capsys, "fit", "--config", str(ROOT / "examples" / "configs" / "hf_tiny_cpu.yaml"),
        "--model.init_args.lora={r: 4, lora_dropout: 0.1, target_modules: [q_proj, v_proj]}",
        "--trainer.max_steps=1", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}")
    assert code != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("fpdt-train: error: HFCausalLM:") and "lora_dropout" in last, err[-3000:]
    assert "Traceback" not in err and "[rank" not in err, err[-3000:]


def test_a_transformers_config_s_own_reason_is_the_last_line(tmp_path: Path, monkeypatch, capsys) -> None:
    """A transformers config that refuses its values (hidden size not a multiple of the heads): its own reason is
    kept in the one line, not only jsonargparse's 'Class validation error' heading."""
    code, _, err = fpdt_train_here(
        monkeypatch, capsys, "fit", "--config", str(ROOT / "examples" / "configs" / "hf_tiny_cpu.yaml"),
        "--model.init_args.model.init_args.num_attention_heads=5", "--trainer.max_steps=1", "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}")
    assert code != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("fpdt-train: error: Class validation error") and \
        "The hidden size (64) is not a multiple of the number of attention heads (5)" in last, err[-3000:]


def test_recurrent_heads_the_group_cannot_split_are_named_before_any_process_starts(tmp_path: Path, monkeypatch,
                                                                                    capsys) -> None:
    """A hybrid of 3 value and 1 key delta-net heads at sp=2: the head counts and the sizes that work, one line."""
    hybrid = tmp_path / "hybrid.yaml"
    hybrid.write_text(yaml.safe_dump({"model": {"class_path": "lightning_fpdt.models.HFCausalLM", "init_args": {
        "model": {"class_path": "transformers.Qwen3_5TextConfig", "init_args": dict(
            vocab_size=256, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_value_heads=3, linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8)}}}}))
    code, _, err = fpdt_train_here(
        monkeypatch, capsys, "fit", "--config", str(ROOT / "examples" / "configs" / "hf_tiny_cpu.yaml"), "--config",
        str(hybrid), "--trainer.max_steps=1", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}")
    assert code != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("fpdt-train: error: HFCausalLM: Qwen3_5GatedDeltaNet (layer 0) has 1 key heads and 3"
                           " value heads, which sequence_parallel_size=2 cannot split"), err[-3000:]
    assert last.endswith("Use a sequence_parallel_size in [1, 3]."), last

"""The long-context evaluation (lightning_fpdt.evaluation): its samples, its scores through FPDT against one
process without it, a trained model against an untrained one, the heatmap in TensorBoard, and ``fpdt-eval``."""

from __future__ import annotations

import copy
import io
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, Dataset

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.data import PasskeyDataset
from lightning_fpdt.data.byte_tokenizer import ByteTokenizer
from lightning_fpdt.data.passkey import passkey_sample
from lightning_fpdt.data.tokenizing import load_tokenizer
from lightning_fpdt.evaluation import (
    RULER_TASKS,
    LongContextEvaluation,
    NeedleTask,
    PasskeyTask,
    evaluate,
    sample_grid,
    task_named,
)
from lightning_fpdt.evaluation.command import main
from lightning_fpdt.evaluation.images import heatmap_image
from lightning_fpdt.evaluation.results import EvaluationResult, PositionLoss, TaskResult
from lightning_fpdt.evaluation.runner import schedule
from lightning_fpdt.evaluation.scoring import answer_scores
from lightning_fpdt.evaluation.tokenizer import encoder
from lightning_fpdt.models import GPTLM, GPTConfig, LlamaConfig, LlamaLM

ROOT = Path(__file__).resolve().parents[1]
BYTES = encoder(ByteTokenizer())


def tiny_model(seed: int = 0) -> LlamaLM:
    torch.manual_seed(seed)
    config = LlamaConfig.tiny(num_hidden_layers=1, hidden_size=32, intermediate_size=64, rope_theta=1e6)
    return LlamaLM(config, loss_tiles=1)


@pytest.fixture(scope="module")
def trained() -> tuple[LlamaLM, LlamaLM]:
    """``(trained, untrained)``: one tiny Llama before and after 60 AdamW steps on 96-token pass-key samples (a
    one-digit key written 8 times, the loss on the answer; about 1-3 s of one CPU core)."""
    model = tiny_model()
    untrained = copy.deepcopy(model)
    data = PasskeyDataset(60 * 16, 96, None, digits=1, seed=1, loss_on="answer", key_repeats=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    for batch in DataLoader(data, batch_size=16):
        loss_sum, count = model.loss_terms({"input_ids": batch["input_ids"], "labels": batch["labels"]})
        optimizer.zero_grad()
        (loss_sum / count).backward()
        optimizer.step()
    return model, untrained


# ---- samples ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(RULER_TASKS))
@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_needle_tasks_hide_their_needles(name: str, tokenizer: str) -> None:
    tok = ByteTokenizer() if tokenizer == "bytes" else load_tokenizer(str(ROOT / "examples/data/tokenizer"))
    encode, decode = encoder(tok), tok.decode
    task = task_named(name)
    length = 1400 if tokenizer == "bytes" else 700
    for depth in (0.0, 0.5, 1.0):
        s = task.sample(encode, length, depth, 3)
        assert len(s.input_ids) == s.length == length
        assert list(s.input_ids[s.answer_start:]) == encode(" " + s.answer)  # the answer ends the sample
        text = decode(s.input_ids[: s.answer_start])
        values = s.answer.split(", ")
        assert len(values) == RULER_TASKS[name].get("values", 1) * RULER_TASKS[name].get("queries", 1)
        for value in values:  # each asked value is in a needle of the context, once
            assert text.count(f"is: {value}.") == 1, (value, text)
        assert text.rstrip().endswith("mentioned in the provided text are")
        assert abs(s.needle_depth - depth) < 0.2 and s == task.sample(encode, length, depth, 3)  # pure function
    if RULER_TASKS[name].get("keys", 1) > RULER_TASKS[name].get("queries", 1):
        assert text.count("One of the special magic") == RULER_TASKS[name]["keys"] * RULER_TASKS[name].get("values", 1)


def test_the_passkey_task_is_the_data_sets_task() -> None:
    data = PasskeyDataset(1, 300, depth=0.25, digits=1, seed=5, key_repeats=8)
    s = PasskeyTask().resolved(None)
    assert (s.digits, s.key_repeats) == (5, 1)  # the data set's defaults without a data module
    sample = PasskeyTask(digits=1, key_repeats=8).sample(BYTES, 300, 0.25, 0)
    assert len(sample.input_ids) == 300 and sample.answer_start == 299 and sample.answer.isdigit()
    assert ByteTokenizer().decode(sample.input_ids).endswith(f"What is the pass key? #{sample.answer}")
    ids, answer_len, _, key = passkey_sample(BYTES, 300, random.Random(5 * 1_000_003), 0.25, 1, 8)
    assert torch.equal(data[0]["input_ids"], torch.tensor(ids)) and answer_len == 1  # one generator for both


def test_refusals() -> None:
    with pytest.raises(ValueError,
                       match=r"NeedleTask: length=100 is too short for .* of 'niah_single_2'; use at least \d+"):
        task_named("niah_single_2").sample(BYTES, 100, 0.5, 0)
    with pytest.raises(ValueError, match=r"PasskeyTask: seq_len=20 is too short for the task; use at least \d+"):
        PasskeyTask(digits=5).sample(BYTES, 20, 0.5, 0)
    with pytest.raises(ValueError, match="unknown task 'niah'; use one of passkey, niah_single_1"):
        task_named("niah")
    with pytest.raises(ValueError, match=r"queries=2 asks for more keys than the 1 hidden; use keys >= 2"):
        NeedleTask(keys=1, queries=2)
    with pytest.raises(FileNotFoundError, match="neither a shipped haystack"):
        NeedleTask(haystack="no/such/file.txt")
    with pytest.raises(ValueError, match="lengths=None takes the data module's seq_len"):
        LongContextEvaluation()._lengths(L.Trainer(logger=False))


def test_heatmap_image() -> None:
    image = heatmap_image([[0.0, 1.0], [math.nan, 0.5]], [0.0, 1.0], [256, 2048], "t")
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    assert image.shape[0] > 2 * 32 and image.shape[1] > 2 * 64  # a cell is 64 x 32 pixels
    title = "niah_multivalue: exact match (teacher forcing), step 12000"
    narrow = heatmap_image([[1.0]], [0.5], [4096], title)  # one column: the title sets the width
    ink = np.argwhere((narrow[:20] < 128).all(axis=2))[:, 1]  # the title's dark pixels, in the top rows
    assert ink.min() > 0 and ink.max() < narrow.shape[1] - 1, (ink.min(), ink.max(), narrow.shape)


def test_the_batches_are_split_over_data_parallel_groups() -> None:
    """Every group runs as many batches (repeats unscored), and every batch is scored by exactly one group."""
    groups = [[0, 1, 2], [3, 4], [5]]  # three lengths
    runs = [schedule(groups, 2, 3, rank) for rank in range(3)]
    assert len({len(r) for r in runs}) == 1
    scored = sorted(i for r in runs for batch, keep in r if keep for i in batch)
    assert scored == list(range(6))
    assert schedule([], 2, 3, 0) == [] and schedule(groups, 8, 1, 0) == [([0, 1, 2], True), ([3, 4], True),
                                                                         ([5], True)]


# ---- scores -----------------------------------------------------------------------------------------------


class Documents(Dataset):
    """Held-out token documents: some samples are two packed documents (``position_ids`` restarting at 0)."""

    def __init__(self, n: int, seq_len: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (n, seq_len), generator=g)
        self.cuts = [0 if i % 2 == 0 else int(torch.randint(8, seq_len - 8, (1,), generator=g)) for i in range(n)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        positions = torch.arange(self.ids.shape[1])
        if self.cuts[i]:
            positions[self.cuts[i]:] -= self.cuts[i]
        return {"input_ids": self.ids[i], "position_ids": positions}

    def documents(self) -> list[torch.Tensor]:
        return [d for i, ids in enumerate(self.ids) for d in ((ids[: self.cuts[i]], ids[self.cuts[i]:])
                                                            if self.cuts[i] else (ids,))]


def one_process_scores(module: LlamaLM, samples: list) -> list[tuple[float, bool]]:
    """``(log-likelihood, exact match)`` of each sample: the plain model on the whole sequence, no FPDT."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.input_ids])
            log_probs = torch.log_softmax(module(ids)[0, :-1].double(), -1)  # [seq - 1, vocab]: predicts t + 1
            rows, targets = torch.arange(s.answer_start - 1, s.length - 1), ids[0, s.answer_start:]
            out.append((float(log_probs[rows, targets].sum()), bool((log_probs[rows].argmax(-1) == targets).all())))
    return out


def one_process_position_loss(module: LlamaLM, documents: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Summed loss and count per position, each document alone through the plain model."""
    size = max(len(d) for d in documents) - 1
    sums, counts = np.zeros(size), np.zeros(size)
    with torch.no_grad():
        for d in documents:
            log_probs = torch.log_softmax(module(d[None])[0, :-1].double(), -1)
            losses = -log_probs[torch.arange(len(d) - 1), d[1:]]
            sums[: len(d) - 1] += losses.numpy()
            counts[: len(d) - 1] += 1
    return sums, counts


@pytest.mark.distributed
def test_sequence_parallel_evaluation_equals_one_process(trained: tuple[LlamaLM, LlamaLM], tmp_path: Path) -> None:
    """``Trainer.validate`` at sp=2 with 32-token chunks, offload emulated (float64, ``math``): every sample's
    exact-match decision and log-likelihood (1e-10) and the loss of every position bucket equal the plain model's in
    one process, at lengths that are not multiples of sp x chunk = 64 (96, 200 and 420: each sample padded, its pad
    tokens scored nowhere); the heatmap and the curve are images in the TensorBoard event file, the results in JSON,
    CSV, PNG."""
    model = trained[0]
    tasks = [PasskeyTask(digits=1, key_repeats=8), NeedleTask(haystack="noise", name="niah_noise")]
    grids = {"passkey": ([96, 200], [0.0, 0.5, 1.0]), "niah_noise": ([420], [0.0, 1.0])}
    # the issue-45 case (200 tokens at sp=2, 32-token chunks) among them
    assert [n % (2 * 32) for n in (96, 200, 420)] == [32, 8, 36]
    documents = Documents(4, 72, seed=3)
    evaluation = [LongContextEvaluation([t], grids[t.name][0], grids[t.name][1], samples_per_cell=2,
                                        position_data="validation" if t.name == "passkey" else None,
                                        position_buckets=72,  # passkey: the default, trainer.log_dir (a broadcast)
                                        output_dir=None if t.name == "passkey" else str(tmp_path / t.name))
                  for t in tasks]
    trainer = L.Trainer(
        accelerator="cpu", devices=2, precision="64-true", logger=TensorBoardLogger(tmp_path, name="tb"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=evaluation,
        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size=32, attention_backend="math", offload="emulate",
                              start_method="fork"),
    )
    trainer.validate(copy.deepcopy(model), DataLoader(documents, batch_size=2))
    reference = copy.deepcopy(model).double()
    where = {"passkey": tmp_path / "tb" / "version_0" / "evaluation", "niah_noise": tmp_path / "niah_noise"}
    for task in tasks:
        result = json.loads((where[task.name] / "validate-step0" / "results.json").read_text())
        got = result["tasks"][task.name]["samples"]
        expected = one_process_scores(reference, sample_grid(task, BYTES, *grids[task.name], 2))
        assert [bool(s["exact_match"]) for s in got] == [e[1] for e in expected]
        for s, (log_likelihood, _) in zip(got, expected):
            assert s["log_likelihood"] == pytest.approx(log_likelihood, rel=1e-10, abs=1e-12)
    passkey = json.loads((where["passkey"] / "validate-step0" / "results.json").read_text())
    assert 0 < passkey["tasks"]["passkey"]["exact_match"] < 1  # some right, some wrong: the decisions are tested
    sums, counts = one_process_position_loss(reference, documents.documents())
    curve = passkey["position_loss"]
    assert curve["tokens"] == counts.astype(int).tolist()  # one bucket per position
    np.testing.assert_allclose(curve["loss"], sums / counts, rtol=1e-10)
    for name in ("results.json", "passkey_samples.csv", "passkey_cells.csv", "position_loss.csv",
                 "passkey_heatmap.png", "position_loss.png"):
        assert (where["passkey"] / "validate-step0" / name).is_file(), name
    events = EventAccumulator(str(next((tmp_path / "tb").rglob("events.out.tfevents.*")).parent),
                              size_guidance={"images": 0})
    events.Reload()
    assert {"eval/passkey/heatmap", "eval/niah_noise/heatmap", "eval/position_loss"} <= set(events.Tags()["images"])
    logged = np.asarray(Image.open(io.BytesIO(events.Images("eval/passkey/heatmap")[-1].encoded_image_string)))
    np.testing.assert_array_equal(logged, LongContextEvaluation.images(_result(where["passkey"]))["passkey_heatmap"])
    assert "eval/passkey/exact_match" in events.Tags()["scalars"]


def _result(directory: Path) -> EvaluationResult:
    """The passkey result as the rank-zero process wrote it (the callback in this process never ran: fork)."""
    data = json.loads((directory / "validate-step0" / "results.json").read_text())
    task = data["tasks"]["passkey"]
    position = PositionLoss(**data["position_loss"])
    return EvaluationResult(0, {"passkey": TaskResult("passkey", task["lengths"], task["depths"], task["samples"])},
                            position)


def test_a_trained_model_scores_above_an_untrained_one(trained: tuple[LlamaLM, LlamaLM]) -> None:
    """60 steps on 96-token pass-key samples: teacher-forced exact match at 96-384 tokens, any depth, far above
    the untrained model's (which never puts a digit first), and the answer far likelier."""
    scores = {}
    for name, module in zip(("trained", "untrained"), trained):
        result = evaluate(module, [PasskeyTask(digits=1, key_repeats=8)], lengths=[96, 192, 384],
                          depths=[0.0, 0.5, 1.0], samples_per_cell=8, batch_size=8)
        scores[name] = result.tasks["passkey"]
    assert scores["trained"].mean() >= 0.7 and scores["untrained"].mean() <= 0.1, (scores["trained"].grid(),)
    assert scores["trained"].mean("log_likelihood") > scores["untrained"].mean("log_likelihood") + 3


def test_fpdt_eval_runs_the_evaluation_on_a_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fpdt-eval`` is ``fpdt-train validate`` with the evaluation on: the quick start's config, one process."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["fpdt-eval"])
    main([
        "--config", "examples/configs/tiny_cpu.yaml", "--trainer.devices=1", "--trainer.strategy=auto",
        "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}", "--trainer.limit_val_batches=1",
        "--data.init_args.val_seq_len=128", "--data.init_args.batch_size=2",
        "--evaluation.tasks=[passkey]", "--evaluation.lengths=[96,128]", "--evaluation.depths=[0.0,1.0]",
        "--evaluation.samples_per_cell=1", "--evaluation.position_samples=2", f"--evaluation.output_dir={tmp_path}",
    ])
    result = json.loads((tmp_path / "validate-step0" / "results.json").read_text())
    assert [(s["length"], s["depth"]) for s in result["tasks"]["passkey"]["samples"]] == [
        (96, 0.0), (96, 1.0), (128, 0.0), (128, 1.0)]
    assert sum(result["position_loss"]["tokens"]) == 2 * 127  # every next token of two held-out samples
    with pytest.raises(SystemExit, match="fpdt-eval: error: NeedleTask: length=96 is too short"):
        main(["--config", "examples/configs/tiny_cpu.yaml", "--trainer.devices=1", "--trainer.strategy=auto",
              "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}", "--trainer.limit_val_batches=1",
              "--data.init_args.val_seq_len=128", "--evaluation.tasks=[niah_single_1]", "--evaluation.lengths=[96]"])


def test_evaluation_settings_that_would_be_silently_wrong_are_refused_or_said(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """fpdt-eval on a run whose validation is off, or with a depth outside [0, 1]: one line, before any process
    starts; lengths beyond the model's positions: a warning naming both where RoPE extends them, a refusal where a
    learned position table has no row for them."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["fpdt-eval"])
    base = ["--config", "examples/configs/tiny_cpu.yaml", "--trainer.devices=1", "--trainer.strategy=auto",
            "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}", "--evaluation.tasks=[passkey]",
            "--evaluation.lengths=[96]", f"--evaluation.output_dir={tmp_path}"]
    with pytest.raises(SystemExit, match=r"fpdt-eval: error: fpdt-eval: trainer.limit_val_batches=0 runs no"
                                         r" validation, so the evaluation .* would never run"):
        main([*base, "--trainer.limit_val_batches=0"])
    with pytest.raises(SystemExit, match=r"fpdt-eval: error: LongContextEvaluation: depths \[1.5\] are not"
                                         r" fractions of the haystack in \[0, 1\]"):
        main([*base, "--trainer.limit_val_batches=1", "--evaluation.depths=[0.5,1.5]"])
    assert not list(tmp_path.rglob("results.json"))
    with pytest.raises(ValueError, match=r"lengths \[0\] are not positive whole numbers"):
        LongContextEvaluation(lengths=[0])

    task = PasskeyTask(digits=1, key_repeats=8)
    torch.manual_seed(0)
    rope = LlamaLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=112))
    with pytest.warns(UserWarning, match=r"evaluate: lengths \[128\] exceed the model's max_position_embeddings=112"):
        evaluate(rope, [task], lengths=[96, 128], depths=[0.5], samples_per_cell=1, tokenizer=ByteTokenizer())
    learned = GPTLM(GPTConfig(vocab_size=256, n_embd=32, n_layer=1, n_head=2, n_positions=112))
    with pytest.raises(ValueError, match=r"lengths \[128\] exceed the model's 112 positions, and its learned position"
                                         r" table \(model.wpe\) has no row beyond them"):
        evaluate(learned, [task], lengths=[128], depths=[0.5], samples_per_cell=1, tokenizer=ByteTokenizer())


def test_answer_scores_take_the_log_softmax_in_float32_or_wider() -> None:
    """bf16 logits (a bf16 model's head): each answer token's log-probability equals the float64 log-softmax of those
    same logits to float32's precision; a log-softmax in bf16 is ~5e-2 off per token."""
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(2, 12, 1000, generator=g)).bfloat16()

    class Head(torch.nn.Module):
        def logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return logits.reshape(-1, 1000)[hidden[:, 0].long()]  # each row's own logits, in bf16

    hidden = torch.arange(24, dtype=torch.bfloat16).reshape(2, 12, 1).expand(2, 12, 4).contiguous()
    targets = torch.randint(0, 1000, (2, 12), generator=g)
    targets[:, :5] = -100
    got = answer_scores(Head(), hidden, targets, tile_tokens=5)[:, 0]
    exact = torch.log_softmax(logits.double(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    expected = torch.where(targets >= 0, exact, 0.0).sum(-1)
    assert torch.allclose(got, expected, rtol=0, atol=1e-4), (got, expected)


def test_a_length_too_short_for_a_task_is_refused_before_the_validation_runs(tmp_path: Path) -> None:
    """The evaluation makes each task's shortest sample when it is set up: a needle task at 96 tokens is refused
    before the first validation step, not after a whole validation pass."""
    torch.manual_seed(0)
    module = LlamaLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1))
    steps = []
    module.validation_step = lambda batch, idx: steps.append(idx)  # type: ignore[method-assign]
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[LongContextEvaluation(["niah_single_1"], lengths=[96])])
    with pytest.raises(ValueError, match=r"NeedleTask: length=96 is too short"):
        trainer.validate(module, DataLoader(Documents(2, 72, seed=0), batch_size=2))
    assert steps == []


def test_default_lengths_are_those_the_tasks_can_make(caplog: pytest.LogCaptureFixture) -> None:
    """lengths=None: a quarter, half and all of seq_len, less those too short for a needle task (377 tokens for
    niah_single_2 in bytes); with none left, the shortest doubling of seq_len that fits; the choice is said."""
    module = LlamaLM(LlamaConfig.tiny(vocab_size=256, num_hidden_layers=1))

    def chosen(seq_len: int, tasks: list[str]) -> list[int]:
        callback = LongContextEvaluation(tasks, depths=[0.0, 1.0], samples_per_cell=1, position_data=None)
        trainer = type("Trainer", (), {"datamodule": type("Data", (), {"seq_len": seq_len})()})()
        callback.setup(trainer, module, "validate")
        return callback._lengths(trainer)

    assert chosen(2048, ["niah_single_2"]) == [512, 1024, 2048]
    assert chosen(1024, ["niah_single_2"]) == [512, 1024]
    assert "lengths [256] are too short for the tasks; evaluating at [512, 1024]" in caplog.text
    assert chosen(256, ["niah_single_2"]) == [512]
    assert chosen(256, ["passkey"]) == [128, 256]  # its 5-digit key written once needs 85 tokens


@pytest.mark.distributed
def test_fpdt_eval_on_a_run_s_checkpoint_writes_into_that_run(tmp_path: Path) -> None:
    """fpdt-eval on <save_dir>/<name>/version_0/checkpoints/last.ckpt: the results, images and scalars go to that
    run (no version_1), its config.yaml is kept, and the console holds no warning."""
    from tests.test_console import _environment

    env = _environment()
    env.pop("PYTHONWARNINGS")
    common = ["--config", str(ROOT / "examples" / "configs" / "tiny_cpu.yaml"), "--trainer.devices=1",
              "--trainer.strategy.init_args.sequence_parallel_size=1", "--trainer.limit_val_batches=1",
              f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}", "--data.init_args.val_seq_len=128"]
    fit = subprocess.run([sys.executable, "-m", "lightning_fpdt.cli", "fit", *common, "--trainer.max_steps=2",
                          "--trainer.val_check_interval=2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=200)
    assert fit.returncode == 0, fit.stderr[-3000:]
    run = tmp_path / "runs" / "tiny_cpu" / "version_0"
    config = (run / "config.yaml").read_text()
    evaluation = subprocess.run(
        [sys.executable, "-m", "lightning_fpdt.evaluation", *common, "--ckpt_path",
         str(run / "checkpoints" / "last.ckpt"), "--evaluation.tasks=[passkey]", "--evaluation.samples_per_cell=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    output = evaluation.stdout + evaluation.stderr
    assert evaluation.returncode == 0, output[-3000:]
    assert not [line for line in output.splitlines() if "warn" in line.lower()], output[-3000:]
    assert (run / "evaluation" / "validate-step2" / "results.json").is_file()
    assert (run / "evaluation.yaml").is_file() and (run / "config.yaml").read_text() == config
    assert sorted(p.name for p in (tmp_path / "runs" / "tiny_cpu").iterdir()) == ["version_0"]


def test_fpdt_eval_s_help_says_what_it_does(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """``fpdt-eval --help`` describes the long-context evaluation, not Lightning's validate subcommand."""
    monkeypatch.setattr(sys, "argv", ["fpdt-eval"])
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code in (0, None)
    assert "Long-context evaluation of a trained model" in out and "--evaluation.tasks" in out, out[:3000]
    assert out.index("Long-context evaluation") < out.index("options:")  # the description, above the options


def test_every_task_s_samples_are_made_before_the_first_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A length too short for the second task is refused before the first task's forwards (it was refused after the
    first task had been scored whole)."""
    import importlib

    evaluate_module = importlib.import_module("lightning_fpdt.evaluation.evaluate")

    forwards = []
    monkeypatch.setattr(evaluate_module, "score_samples", lambda *args, **kwargs: forwards.append(args))
    module = LlamaLM(LlamaConfig.tiny())
    with pytest.raises(ValueError, match=r"NeedleTask: length=128 is too short for .* of 'niah_single_2'"):
        evaluate_module.evaluate(module, [PasskeyTask(digits=1), "niah_single_2"], lengths=[128], depths=[0.5],
                                 samples_per_cell=1, tokenizer=ByteTokenizer())
    assert forwards == []

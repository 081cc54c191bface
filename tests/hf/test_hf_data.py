"""``HFDataModule``: chat fine-tuning under FPDT equals plain transformers on each conversation alone; text
samples are exactly the tokenizer's encoding; a killed run resumes to the same batches; every bad input is
refused with its file, row or field.

The tokenizer is a byte-level BPE with a Llama-3-style chat template without ``{% generation %}`` markers,
built in code (:mod:`lightning_fpdt.data.toy`): nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.data.hf_datamodule import HFDataModule, load_tokenizer
from lightning_fpdt.data.packing import DataError, chat_tokens, pack_whole
from lightning_fpdt.data.toy import build_tokenizer, conversations, documents, sentence, write_jsonl
from lightning_fpdt.models import HFCausalLM
from lightning_fpdt.testing import run_in_fork
from tests.helpers import CaptureStep, assert_same_step, step_errors
from tests.hf.test_hf_causal_lm import _config, _mean_ce, _plain, _redraw


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return str(path)


def _module(tokenizer_dir: str, seed: int, **kwargs) -> HFCausalLM:
    config = _config("llama", kv_heads=1, vocab_size=len(load_tokenizer(tokenizer_dir)))
    module = HFCausalLM(config, learning_rate=1e-3, warmup_steps=1, mlp_tiles=1, loss_tiles=1, **kwargs)
    _redraw(module.model, seed)
    return module


def _short_chats(n: int, seed: int) -> list[dict]:
    """Conversations of 20 to 120 tokens: 1 or 2 exchanges, some with a system prompt, one without a reply. The first
    is one exchange without a system prompt (about 20 tokens), so that it shares a sample of 128 tokens with
    another whatever the draw (best-fit decreasing places it last, into a sample with room; one seed drew none)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "Be brief."}] if i and rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 2) if i else 1):
            messages += [{"role": "user", "content": sentence(rng, rng.randint(2, 6))},
                         {"role": "assistant", "content": sentence(rng, rng.randint(1, 5))}]
        rows.append({"messages": messages})
    rows.append({"messages": [{"role": "user", "content": "No reply to this one."}]})  # skipped and counted
    return rows


class CaptureBatch(CaptureStep):
    """CaptureStep for batches without an ``index``: records the batch's shapes."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.indices = []
        self.seq_keys = {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}


@pytest.mark.distributed
def test_packed_chat_step_equals_each_conversation_alone(tokenizer_dir: str, tmp_path: Path, fresh_seed: int) -> None:
    """sp=2, 4 chunks of 16 tokens per rank, float64: the loss and every gradient of one step on the packed
    batch equal plain transformers run on each conversation alone, with the loss on its assistant tokens,
    averaged over all assistant tokens of the batch."""
    torch.manual_seed(fresh_seed)
    rows = _short_chats(8, fresh_seed)
    write_jsonl(tmp_path / "chat.jsonl", iter(rows))
    data = HFDataModule(str(tmp_path / "chat.jsonl"), tokenizer=tokenizer_dir, format="chat", seq_len=128,
                        cache_dir=str(tmp_path / "cache"), seed=fresh_seed)
    data.prepare_data()
    data.setup("fit")
    n = len(data.train_set)
    data.batch_size = n  # the whole packed set in one step
    assert data.stats["train_skipped"] == 1 and data.stats["train"]["documents"] == len(rows) - 1
    assert n < len(rows) - 1, "conversations were meant to share samples"
    module = _module(tokenizer_dir, fresh_seed)
    ref = _plain(module)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, precision="64-true", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[CaptureBatch(str(tmp_path))],
        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size=16, attention_backend="math", start_method="fork"),
    )
    trainer.fit(module, datamodule=data)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    tokenizer = load_tokenizer(tokenizer_dir)
    alone = [chat_tokens(tokenizer, row["messages"]) for row in rows]
    samples = [(torch.tensor([ids]), torch.tensor([labels])) for ids, labels in (a for a in alone if a is not None)]
    ref_loss, ref_grads = _mean_ce(ref, samples)
    assert results[0]["shapes"]["input_ids"] == (n, 128 // 2)  # this rank's half of each sample
    error = max(e for _, _, e in step_errors(results, ref_loss, ref_grads))
    print(f"packed chat: {n} samples, max rel. error {error:.2e}")
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"packed chat seed={fresh_seed}")


def test_chat_labels_are_the_assistant_turns(tokenizer_dir: str) -> None:
    tokenizer = load_tokenizer(tokenizer_dir)
    for row in conversations(20, seed=3):
        ids, labels = chat_tokens(tokenizer, row["messages"])
        labelled = tokenizer.decode([t for t, label in zip(ids, labels) if label != -100])
        replies = "".join(m["content"] + "<|eot_id|>" for m in row["messages"] if m["role"] == "assistant")
        assert labelled == replies
        assert all(label in (-100, t) for t, label in zip(ids, labels))
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_text_samples_are_the_tokenizers_encoding_in_order(tokenizer_dir: str, tmp_path: Path) -> None:
    rows = list(documents(30, seed=5, max_sentences=8))
    write_jsonl(tmp_path / "a.jsonl", iter(rows[:10]))
    write_jsonl(tmp_path / "b.jsonl", iter(rows[10:]))
    data = HFDataModule(str(tmp_path / "*.jsonl"), tokenizer=tokenizer_dir, format="text", seq_len=64,
                        cache_dir=str(tmp_path / "cache"))
    data.setup("fit")
    tokenizer = load_tokenizer(tokenizer_dir)
    docs = [tokenizer(r["text"])["input_ids"] + [tokenizer.eos_token_id] for r in rows]
    assert all(d[0] == tokenizer.bos_token_id for d in docs)
    stream = [t for d in docs for t in d]
    expected_pos = [p for d in docs for p in range(len(d))]
    arrays = data.train_set.arrays
    ids, labels, pos = (torch.tensor(arrays[k]).reshape(-1) for k in ("input_ids", "labels", "position_ids"))
    n = len(stream)
    assert ids[:n].tolist() == stream and labels[:n].tolist() == stream
    assert (labels[n:] == -100).all() and ids.numel() - n < 64  # only the last sample's tail is padding
    for start in range(0, n, 64):  # a document cut by a sample's end continues as a new document
        cut = expected_pos[start]
        for i in range(start, min(n, start + 64)):
            if expected_pos[i] == 0:
                cut = 0
            expected_pos[i] -= cut
    assert pos[:n].tolist() == expected_pos
    first = next(iter(data.train_dataloader()))
    assert set(first) == {"input_ids", "labels", "position_ids"} and first["input_ids"].dtype == torch.long


def test_bin_packing_keeps_conversations_whole_and_fills(tokenizer_dir: str, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "chat.jsonl", conversations(200, seed=7))
    data = HFDataModule(str(tmp_path / "chat.jsonl"), tokenizer=tokenizer_dir, format="chat", seq_len=512,
                        cache_dir=str(tmp_path / "cache"))
    data.setup("fit")
    pos = torch.tensor(data.train_set.arrays["position_ids"])
    conversations_seen = int((pos == 0).sum()) - int((torch.tensor(data.train_set.arrays["labels"]) == -100)
                                                      .all(-1).sum())
    assert data.stats["train"]["fill"] > 0.95, data.stats
    assert conversations_seen >= 200 - len(pos)  # at most one padding segment per sample
    assert pack_whole([5, 3, 3, 2, 7], 8) == [[4], [0, 1], [2, 3]]


# ---- resume ----------------------------------------------------------------------------------------------

class Record(L.Callback):
    """Appends each step's first input ids to ``batches.txt``; SIGKILLs the process group at ``die_at``."""

    def __init__(self, out: Path, die_at: int | None) -> None:
        self.out, self.die_at = out, die_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.die_at is not None and trainer.global_step == self.die_at:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        with open(self.out / "batches.txt", "a") as f:
            f.write(f"{trainer.global_step} {json.dumps(batch['input_ids'][:, :12].tolist())}\n")


def _resume_job(out: Path, tokenizer_dir: str, data_file: Path, die_at: int | None, ckpt: str | None) -> None:
    torch.manual_seed(0)
    module = _module(tokenizer_dir, 0)
    data = HFDataModule(str(data_file), tokenizer=tokenizer_dir, format="text", seq_len=32, batch_size=2,
                        cache_dir=str(out.parent / "cache"), seed=11)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=8, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Record(out, die_at), ModelCheckpoint(
            dirpath=out.parent / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")],
        strategy=FPDTStrategy(sequence_parallel_size=1, attention_backend="math"),
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)


def _batches(out: Path) -> dict[int, str]:
    return dict(line.split(" ", 1) for line in (out / "batches.txt").read_text().splitlines())


@pytest.mark.distributed
def test_killed_run_resumes_to_the_same_batches(tokenizer_dir: str, tmp_path: Path) -> None:
    data_file = write_jsonl(tmp_path / "text.jsonl", documents(12, seed=2, max_sentences=3))
    runs = {name: tmp_path / name for name in ("whole", "killed")}
    for out in runs.values():
        out.mkdir()

    def job(name: str, die_at: int | None, ckpt: str | None = None):
        run = lambda: _resume_job(runs[name], tokenizer_dir, data_file, die_at, ckpt)  # noqa: E731
        return run_in_fork(run, ["resume"], timeout=240)

    assert job("whole", None).returncode == 0
    whole = _batches(runs["whole"])
    for f in (tmp_path / "ckpt").iterdir():
        f.unlink()
    assert job("killed", die_at=5).returncode == -signal.SIGKILL
    assert job("killed", None, str(tmp_path / "ckpt" / "step=4.ckpt")).returncode == 0
    resumed = _batches(runs["killed"])
    assert len(whole) == 8 and resumed == whole  # steps 4 and 5 ran twice: the second time with the same batch


# ---- bad input: each named, at setup -----------------------------------------------------------------------

def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


BAD = {  # name -> (files to write, HFDataModule options, message)
    "missing file": ({}, dict(train_files="nowhere/*.jsonl"), r"train_files 'nowhere/\*\.jsonl' does not exist"),
    "missing field": ({"d.jsonl": '{"body": "x"}\n'}, {}, r"d\.jsonl' has no field 'text' .*'body'.*Set text_field"),
    "empty dataset": ({"d.jsonl": ""}, {}, r"d\.jsonl' is empty \(0 bytes, no rows\)"),
    "row with no tokens": ({"d.jsonl": '{"text": "a b"}\n{"text": ""}\n'}, {},
                           r"d\.jsonl' row 1 \(field 'text'\) has no tokens"),
    "malformed jsonl line": ({"d.jsonl": '{"text": "a"}\n{"text": "b"}\n{"text": oops}\n'}, {},
                             r"d\.jsonl:3: line 3 is not valid JSON"),
    "no assistant turn anywhere": ({"d.jsonl": '{"messages": [{"role": "user", "content": "hi"}]}\n'},
                                   dict(format="chat"), r"1 conversations without an assistant turn"),
    "messages not a list": ({"d.jsonl": '{"messages": "hi"}\n'}, dict(format="chat"),
                            r"row 0 \(field 'messages'\) is not a non-empty list"),
    "tokenizer without chat template": ({"d.jsonl": '{"messages": []}\n'}, dict(format="chat", tokenizer="plain"),
                                        r"format='chat' needs a chat template"),
    "template that renders a turn differently": (
        {"d.jsonl": json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                             {"role": "user", "content": "c"},
                                             {"role": "assistant", "content": "d"}]})},
        dict(format="chat", tokenizer="last-turn"), r"row 0 .*assistant turn 1 .*does not tokenize as the start"),
    "no tokenizer for an own model": ({"d.jsonl": '{"text": "a"}\n'}, dict(tokenizer=None), r"no tokenizer: give data"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_named(case: str, tokenizer_dir: str, tmp_path: Path) -> None:
    files, options, message = BAD[case]
    for name, text in files.items():
        _write(tmp_path / name, text)
    tokenizers = {"plain": ("chat_template", None), "last-turn": ("chat_template", (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% if loop.last %} LAST{% endif %}"
        "{{ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"))}
    options = {"train_files": str(tmp_path / "d.jsonl"), "tokenizer": tokenizer_dir, **options}
    if options["tokenizer"] in tokenizers:  # the test tokenizer with another chat template (or none)
        attribute, value = tokenizers[options["tokenizer"]]
        tokenizer = load_tokenizer(tokenizer_dir)
        setattr(tokenizer, attribute, value)
        tokenizer.save_pretrained(tmp_path / "tok")
        options["tokenizer"] = str(tmp_path / "tok")
    data = HFDataModule(cache_dir=str(tmp_path / "cache"), **options)
    data.prepare_data()
    with pytest.raises(DataError, match=message):
        data.setup("fit")
    with pytest.raises(DataError, match=message):  # every rank: a process that did not prepare raises it too
        HFDataModule(cache_dir=str(tmp_path / "cache"), **options).setup("fit")


def test_tokenizer_larger_than_the_embedding_is_refused(tokenizer_dir: str, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", documents(3, seed=0))
    data = HFDataModule(str(tmp_path / "d.jsonl"), tokenizer=tokenizer_dir, cache_dir=str(tmp_path / "cache"))
    small = HFCausalLM(_config("llama", vocab_size=100))
    data.trainer = SimpleNamespace(lightning_module=small, strategy=None)
    with pytest.raises(DataError, match=r"has 384 tokens but the model embeds 100.*vocab_size >= 384"):
        data.setup("fit")


def test_tokenizer_comes_from_the_models_path(tokenizer_dir: str, tmp_path: Path) -> None:
    module = HFCausalLM(_config("llama", vocab_size=384))
    module.save_pretrained(str(tmp_path / "model"))
    load_tokenizer(tokenizer_dir).save_pretrained(str(tmp_path / "model"))
    loaded = HFCausalLM(str(tmp_path / "model"))
    write_jsonl(tmp_path / "d.jsonl", documents(3, seed=0))
    data = HFDataModule(str(tmp_path / "d.jsonl"), cache_dir=str(tmp_path / "cache"))
    data.trainer = SimpleNamespace(lightning_module=loaded, strategy=None)
    assert data.tokenizer_path() == str(tmp_path / "model")
    data.setup("fit")
    assert len(data.train_set) >= 1


def test_cache_is_reused_and_keyed_by_files_and_options(tokenizer_dir: str, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", documents(5, seed=0))
    make = lambda **kw: HFDataModule(str(path), tokenizer=tokenizer_dir, cache_dir=str(tmp_path / "c"), **kw)  # noqa: E731
    key = make().cache_key()
    make().setup("fit")
    assert (tmp_path / "c" / key / "meta.json").is_file() and make().cache_key() == key
    assert make(seq_len=128).cache_key() != key and make(seed=1).cache_key() != key
    write_jsonl(path, documents(6, seed=0))
    assert make().cache_key() != key

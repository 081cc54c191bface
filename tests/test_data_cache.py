"""``HFDataModule``'s cache and splits hold what they claim: the samples follow a tokenizer saved again at the same
path and a data file edited in place (same size: only its modification time tells), held-out documents are never
trained on, and a chat template without a generation prompt still trains on the replies alone.

Each test compares token ids with the tokenizer's own encoding of the rows (loaded afresh from its files, not from
this process's cache), so a stale cache, a leaked document or a labelled header fails it. The tokenizer is the
byte-level BPE of :mod:`lightning_fpdt.data.toy`, built in code: nothing is downloaded.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from lightning_fpdt.data import HFDataModule  # noqa: E402
from lightning_fpdt.data.packing import IGNORE, chat_tokens  # noqa: E402
from lightning_fpdt.data.toy import CHAT_TEMPLATE, build_tokenizer, conversations, documents, write_jsonl  # noqa: E402

GENERATION_PROMPT = "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return str(path)


def fresh(path: str | Path):
    """The tokenizer saved at ``path``, read from its files now."""
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def encoded(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Each text row as HFDataModule tokenizes it: the tokenizer's encoding (with its BOS) and the EOS."""
    return [tokenizer(r["text"])["input_ids"] + [tokenizer.eos_token_id] for r in rows]


def trained_stream(data: HFDataModule, split: str = "train") -> list[int]:
    """The token ids of a text split's samples in order, padding left out (its labels are ignored)."""
    arrays = (data.train_set if split == "train" else data.val_set).arrays
    ids, labels = np.asarray(arrays["input_ids"]).reshape(-1), np.asarray(arrays["labels"]).reshape(-1)
    return ids[labels != IGNORE].tolist()


def split_documents(stream: list[int], eos: int) -> list[tuple[int, ...]]:
    docs, start = [], 0
    for i, token in enumerate(stream):
        if token == eos:
            docs.append(tuple(stream[start: i + 1]))
            start = i + 1
    assert start == len(stream), "the stream does not end with a document's EOS"
    return docs


def test_samples_follow_a_tokenizer_saved_again_at_the_same_path(tmp_path: Path) -> None:
    """A cache (ours, or ``datasets``' map cache) written with one tokenizer must not serve another saved at the
    same path: the second run's samples are the second tokenizer's ids."""
    tokenizer = tmp_path / "tokenizer"
    rows = list(documents(8, seed=1, max_sentences=3))
    path = write_jsonl(tmp_path / "d.jsonl", iter(rows))
    make = lambda: HFDataModule(str(path), tokenizer=str(tokenizer), seq_len=64,  # noqa: E731
                                cache_dir=str(tmp_path / "cache"))
    build_tokenizer(tokenizer, vocab_size=384, seed=0)
    first = make()
    first.setup("fit")
    assert trained_stream(first) == sum(encoded(fresh(tokenizer), rows), [])
    shutil.rmtree(tokenizer)
    build_tokenizer(tokenizer, vocab_size=320, seed=1)  # another BPE, same path
    second_ids = sum(encoded(fresh(tokenizer), rows), [])
    assert second_ids != trained_stream(first), "the two tokenizers were meant to encode the rows differently"
    second = make()
    second.setup("fit")
    assert trained_stream(second) == second_ids, "samples of the tokenizer saved earlier at this path"


def test_samples_follow_an_edit_of_a_data_file_of_the_same_size(tokenizer_dir: str, tmp_path: Path) -> None:
    """A row edited in place, the file's size unchanged (one number for another): the next run's samples hold the
    new text. The modification time is moved on by a second, as an edit made later would; file systems with coarse
    timestamps could otherwise give the rewrite its predecessor's time."""
    rows = [{"text": f"The river {n} runs to the sea {n + 1}."} for n in (123, 456, 789)]
    path = write_jsonl(tmp_path / "d.jsonl", iter(rows))
    make = lambda: HFDataModule(str(path), tokenizer=tokenizer_dir, seq_len=32,  # noqa: E731
                                cache_dir=str(tmp_path / "cache"))
    tokenizer = fresh(tokenizer_dir)
    first = make()
    first.setup("fit")
    assert trained_stream(first) == sum(encoded(tokenizer, rows), [])
    before = os.stat(path)
    rows[1]["text"] = rows[1]["text"].replace("456", "654")
    write_jsonl(path, iter(rows))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert os.stat(path).st_size == before.st_size
    second = make()
    second.setup("fit")
    assert trained_stream(second) == sum(encoded(tokenizer, rows), []), "samples of the file before its edit"


def test_held_out_documents_are_not_trained_on(tokenizer_dir: str, tmp_path: Path, fresh_seed: int) -> None:
    """val_fraction=0.25 of 40 documents: 10 whole documents validate, the other 30 train (in file order), none in
    both and none lost."""
    rows = list(documents(40, seed=fresh_seed % 1000, max_sentences=4))
    path = write_jsonl(tmp_path / "d.jsonl", iter(rows))
    data = HFDataModule(str(path), tokenizer=tokenizer_dir, seq_len=64, val_fraction=0.25, seed=fresh_seed,
                        cache_dir=str(tmp_path / "cache"))
    data.setup("fit")
    tokenizer = fresh(tokenizer_dir)
    docs = [tuple(d) for d in encoded(tokenizer, rows)]
    assert len(set(docs)) == len(docs), "the test needs distinct documents"
    train = split_documents(trained_stream(data, "train"), tokenizer.eos_token_id)
    val = split_documents(trained_stream(data, "val"), tokenizer.eos_token_id)
    both = set(train) & set(val)
    assert not both, f"{len(both)} of the {len(val)} held-out documents are also trained on"
    assert len(val) == 10 and sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d not in set(val)]


# ---- a chat template without a generation prompt --------------------------------------------------------------

@pytest.fixture(scope="module")
def no_prompt_dir(tokenizer_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The test tokenizer with its chat template less the generation-prompt branch."""
    assert GENERATION_PROMPT in CHAT_TEMPLATE
    tokenizer = fresh(tokenizer_dir)
    tokenizer.chat_template = CHAT_TEMPLATE.replace(GENERATION_PROMPT, "")
    path = tmp_path_factory.mktemp("no-generation-prompt")
    tokenizer.save_pretrained(str(path))
    return str(path)


def assistant_first(seed: int) -> list[dict]:
    """A conversation that opens with the assistant (nothing before its first turn to render a prompt after)."""
    rng = random.Random(seed)
    return [{"role": "assistant", "content": f"Hello {rng.randrange(1000)}."},
            {"role": "user", "content": "What is 7?"}, {"role": "assistant", "content": "It is 7."}]


def test_template_without_generation_prompt_labels_the_replies_alone(tokenizer_dir: str, no_prompt_dir: str) -> None:
    with_prompt, without = fresh(tokenizer_dir), fresh(no_prompt_dir)
    probe = [{"role": "user", "content": "hi"}]
    assert (without.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
            == without.apply_chat_template(probe, tokenize=False, add_generation_prompt=False))
    rows = [row["messages"] for row in conversations(20, seed=3)] + [assistant_first(4)]
    for messages in rows:
        ids, labels = chat_tokens(without, messages)
        labelled = without.decode([t for t, label in zip(ids, labels) if label != IGNORE])
        replies = "".join(m["content"] + "<|eot_id|>" for m in messages if m["role"] == "assistant")
        assert labelled == replies, f"labelled {labelled[:120]!r}, not the replies alone"
        assert (ids, labels) == chat_tokens(with_prompt, messages)  # the same rendering, the same labels


def test_template_ignoring_the_content_is_refused(tokenizer_dir: str) -> None:
    tokenizer = fresh(tokenizer_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] + '<|eot_id|>' }}{% endfor %}"
    with pytest.raises(ValueError, match=r"assistant turn 1 whose header cannot be found.*gives the same text"):
        chat_tokens(tokenizer, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_data_module_warns_of_a_template_without_generation_prompt(tokenizer_dir: str, no_prompt_dir: str,
                                                                   tmp_path: Path) -> None:
    """Both templates give the same samples; the one without a generation prompt is named in a warning."""
    path = write_jsonl(tmp_path / "chat.jsonl", conversations(30, seed=5))
    made = {}
    for name, tokenizer in (("with", tokenizer_dir), ("without", no_prompt_dir)):
        data = HFDataModule(str(path), tokenizer=tokenizer, format="chat", seq_len=256,
                            cache_dir=str(tmp_path / "cache"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data.setup("fit")
        made[name] = (data, [str(w.message) for w in caught if "add_generation_prompt" in str(w.message)])
    assert made["with"][1] == []
    assert len(made["without"][1]) == 1 and f"the tokenizer at {no_prompt_dir!r}" in made["without"][1][0]
    for key in ("input_ids", "labels", "position_ids"):
        a, b = (np.asarray(made[name][0].train_set.arrays[key]) for name in ("with", "without"))
        assert a.shape == b.shape and (a == b).all(), f"{key}: {int((a != b).sum())} of {a.size} differ"

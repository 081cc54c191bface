"""``HFDataModule`` at the product's edge: nothing stale, nothing rendered wrongly, nothing lost (issue 30).

- the samples follow what determines the tokens, whatever the file system says: a data file (jsonl, csv, or a
  ``save_to_disk`` directory) rewritten with its size and modification time kept, a chat template edited in
  place; ``datasets``' own caches never serve an earlier content, and nothing is written into the data;
- chat content given as a list of parts (the OpenAI format) is its text, not the list's repr; a part that is not
  text is refused, naming the row, the message and the part;
- a tokenizer path that does not exist, a file of blank lines, an unwritable ``cache_dir``: each refused with the
  documented message, on every rank (a second process that did not prepare raises it too);
- held-out documents are never trained on, duplicated documents included; validation files that repeat training
  documents are counted in a warning.

Token ids are compared with the tokenizer's own encoding, loaded afresh from its files. The tokenizer is the
byte-level BPE of :mod:`lightning_fpdt.data.toy`, built in code: nothing is downloaded.
"""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from lightning_fpdt.data import HFDataModule, cache  # noqa: E402
from lightning_fpdt.data.packing import IGNORE, DataError  # noqa: E402
from lightning_fpdt.data.toy import CHAT_TEMPLATE, build_tokenizer, conversations, documents, write_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return str(path)


def fresh(path: str | Path):
    """The tokenizer saved at ``path``, read from its files now."""
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def encoded(tokenizer, texts: list[str]) -> list[int]:
    """The texts as one stream of HFDataModule's text documents: each encoding (with its BOS) and the EOS."""
    return sum((tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts), [])


def trained(data: HFDataModule, split: str = "train") -> list[int]:
    """The ids of a split's samples at their trained (not ignored) labels, in order."""
    arrays = (data.train_set if split == "train" else data.val_set).arrays
    ids, labels = np.asarray(arrays["input_ids"]).reshape(-1), np.asarray(arrays["labels"]).reshape(-1)
    return ids[labels != IGNORE].tolist()


def listing(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


# ---- stale tokens ---------------------------------------------------------------------------------------------

def write_rows(path: Path, kind: str, texts: list[str]) -> Path:
    """The rows ``{"text": ...}`` as a jsonl or csv file, or a ``save_to_disk`` directory."""
    if kind == "jsonl":
        return write_jsonl(path.with_suffix(".jsonl"), iter({"text": t} for t in texts))
    if kind == "csv":
        with open(path.with_suffix(".csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerows([["text"], *[[t] for t in texts]])
        return path.with_suffix(".csv")
    shutil.rmtree(path, ignore_errors=True)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "csv", "save_to_disk"])
def test_samples_follow_a_file_rewritten_with_its_size_and_mtime_kept(kind: str, tokenizer_dir: str,
                                                                      tmp_path: Path) -> None:
    """``cp -p`` / ``rsync -t`` of another file of the same size: only its bytes tell; neither our cache nor
    ``datasets``' (keyed by path and mtime) may serve the old samples, and nothing is written into the data."""
    texts = [f"The river {n} runs to the sea {n + 1}." for n in (123, 456, 789)]
    path = write_rows(tmp_path / "data", kind, texts)
    make = lambda: HFDataModule(str(path), tokenizer=tokenizer_dir, seq_len=32,  # noqa: E731
                                cache_dir=str(tmp_path / "cache"))
    tokenizer = fresh(tokenizer_dir)
    before = listing(path) if path.is_dir() else {path.name: (path.stat().st_size, path.stat().st_mtime_ns)}
    first = make()
    first.setup("fit")
    assert trained(first) == encoded(tokenizer, texts)
    if path.is_dir():
        assert listing(path) == before, "the data module wrote into the data directory"
    texts[1] = texts[1].replace("456", "654")
    write_rows(tmp_path / "data", kind, texts)
    for name, (size, mtime) in before.items():  # the old sizes and modification times, as cp -p would keep
        f = path / name if path.is_dir() else path
        assert f.stat().st_size == size
        os.utime(f, ns=(mtime, mtime))
    second = make()
    second.setup("fit")
    assert trained(second) == encoded(tokenizer, texts), "samples of the file before it was rewritten"


def test_a_memoized_hash_follows_a_rewrite(tokenizer_dir: str, tmp_path: Path, monkeypatch) -> None:
    """The content hash memoized under a file's status (here even for a file just written) is not served for a
    rewrite with the same size and mtime: the rewrite moves the file's ctime."""
    monkeypatch.setattr(cache, "SETTLED_S", -1.0)
    memo = tmp_path / "hashes"
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one 123"}\n')
    first = cache.file_hash(path, memo)
    assert len(list(memo.iterdir())) == 1 and cache.file_hash(path, memo) == first  # memoized, served
    stat = path.stat()
    path.write_text('{"text": "one 321"}\n')
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert cache.file_hash(path, memo) != first


@pytest.mark.parametrize("num_proc", [1, 2])
def test_samples_follow_a_chat_template_edited_at_the_same_path(num_proc: int, tokenizer_dir: str,
                                                                tmp_path: Path) -> None:
    """The template's role header edited and saved over the tokenizer: ids and labels are the new template's (in
    every tokenizer worker too)."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, tokenizer)
    rows = list(conversations(6, seed=2, max_turns=2))
    path = write_jsonl(tmp_path / "chat.jsonl", iter(rows))
    make = lambda: HFDataModule(str(path), tokenizer=str(tokenizer), format="chat", seq_len=512,  # noqa: E731
                                num_proc=num_proc, cache_dir=str(tmp_path / "cache"))
    first = make()
    first.setup("fit")
    edited = fresh(tokenizer)
    edited.chat_template = CHAT_TEMPLATE.replace("<|end_header_id|>\n\n", ":<|end_header_id|>\n")  # and the prompt's
    assert edited.chat_template != CHAT_TEMPLATE
    edited.save_pretrained(str(tokenizer))
    second = make()
    second.setup("fit")
    new = fresh(tokenizer)
    assert new.chat_template == edited.chat_template
    text = new.decode(np.asarray(second.train_set.arrays["input_ids"]).reshape(-1).tolist())
    assert "user:<|end_header_id|>\n" in text and "user<|end_header_id|>\n\n" not in text, "the old template's ids"
    labelled = new.decode(trained(second))
    replies = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert all(reply in labelled for reply in replies) and "<|start_header_id|>" not in labelled


def test_the_tokenizer_key_reads_no_weights_and_follows_the_template(tokenizer_dir: str, tmp_path: Path) -> None:
    """A model directory used as the tokenizer: its weights are not read into the key (a new checkpoint in the
    same directory keeps the samples), its chat template is."""
    model = tmp_path / "model"
    shutil.copytree(tokenizer_dir, model)
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    path = write_jsonl(tmp_path / "d.jsonl", documents(3, seed=0))
    key = lambda: HFDataModule(str(path), tokenizer=str(model), cache_dir=str(tmp_path / "c")).cache_key()  # noqa: E731
    before = key()
    (model / "model.safetensors").write_bytes(b"\1" * 1000)
    assert key() == before
    tokenizer = fresh(model)
    tokenizer.chat_template = CHAT_TEMPLATE + "{{ '' }}"
    tokenizer.save_pretrained(str(model))
    assert key() != before


# ---- chat content as a list of parts -----------------------------------------------------------------------------

def as_parts(messages: list[dict], split: bool) -> list[dict]:
    """Each content as OpenAI-style text parts: one part, or (``split``) cut into two at its middle."""
    out = []
    for m in messages:
        text, half = m["content"], len(m["content"]) // 2
        pieces = [text[:half], text[half:]] if split else [text]
        out.append({**m, "content": [{"type": "text", "text": p} for p in pieces]})
    return out


def test_content_parts_are_their_text(tokenizer_dir: str, tmp_path: Path) -> None:
    """Rows whose contents are lists of text parts give the samples of the same rows with string contents."""
    rows = list(conversations(12, seed=7))
    plain = write_jsonl(tmp_path / "plain.jsonl", iter(rows))
    parts = write_jsonl(tmp_path / "parts.jsonl", iter({"messages": as_parts(r["messages"], split=i % 2 == 1)}
                                                        for i, r in enumerate(rows)))
    made = []
    for path in (plain, parts):
        data = HFDataModule(str(path), tokenizer=tokenizer_dir, format="chat", seq_len=512,
                            cache_dir=str(tmp_path / "cache"))
        data.setup("fit")
        made.append(data)
    text = fresh(tokenizer_dir).decode(np.asarray(made[1].train_set.arrays["input_ids"]).reshape(-1).tolist())
    assert "'type'" not in text, "a part list rendered as its repr"
    for key in ("input_ids", "labels", "position_ids"):
        a, b = (np.asarray(m.train_set.arrays[key]) for m in made)
        assert a.shape == b.shape and (a == b).all(), f"{key}: {int((a != b).sum())} of {a.size} differ"


# ---- each refused with the documented message, on every rank ---------------------------------------------------

IMAGE_ROW = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                       {"type": "image_url", "image_url": {"url": "x.png"}}]},
                          {"role": "assistant", "content": "A cat."}]}

REFUSED = {  # name -> (files to write, HFDataModule options, message)
    "image content part": (
        {"d.jsonl": json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "yo"}]}) + "\n"
         + json.dumps(IMAGE_ROW) + "\n"},
        dict(format="chat"),
        r"d\.jsonl' row 1 \(field 'messages'\) has message 0 \(user\) whose content part 1 is of type 'image_url':"
        r" only text parts .* can be tokenized"),
    "tokenizer path that does not exist": (
        {"d.jsonl": '{"text": "a"}\n'}, dict(tokenizer="no/such/tokenizer"),
        r"no tokenizer could be loaded from 'no/such/tokenizer' \(no such file or directory; working directory .*"
        r"Give data\.tokenizer: a local directory"),
    "jsonl of blank lines": ({"d.jsonl": "\n\n   \n\t\n"}, {},
                             r"d\.jsonl' has no rows: its 8 bytes are blank lines or spaces; remove it"),
    "csv of blank lines": ({"d.csv": "\n\n"}, dict(train_files="d.csv"),
                           r"d\.csv' has no rows: its 2 bytes are blank lines or spaces"),
    "cache_dir that cannot be written": (
        {"d.jsonl": '{"text": "a"}\n', "a-file": "x"}, dict(cache_dir="a-file/cache"),
        r"the cache directory '.*a-file/cache' cannot be written \(NotADirectoryError: Not a directory\); the"
        r" tokenized samples are kept there\. Set cache_dir"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_with_the_documented_message(case: str, tokenizer_dir: str, tmp_path: Path) -> None:
    files, options, message = REFUSED[case]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    options = {"train_files": "d.jsonl", "tokenizer": tokenizer_dir, "cache_dir": "cache", **options}
    for name in ("train_files", "cache_dir"):
        options[name] = str(tmp_path / options[name])
    data = HFDataModule(**options)
    data.prepare_data()
    with pytest.raises(DataError, match=message):
        data.setup("fit")
    with pytest.raises(DataError, match=message):  # every rank: a process that did not prepare raises it too
        HFDataModule(**options).setup("fit")


def test_a_built_cache_is_read_without_writing(tokenizer_dir: str, tmp_path: Path, monkeypatch) -> None:
    """A cache built earlier is used where it cannot be written (read-only storage): writing is checked only
    when something must be built."""
    path = write_jsonl(tmp_path / "d.jsonl", documents(4, seed=0))
    make = lambda: HFDataModule(str(path), tokenizer=tokenizer_dir, seq_len=64,  # noqa: E731
                                cache_dir=str(tmp_path / "cache"))
    make().setup("fit")

    def refuse(directory: Path) -> None:
        raise DataError(f"{directory} is read-only")

    monkeypatch.setattr(cache, "check_writable", refuse)
    data = make()
    data.setup("fit")
    assert trained(data) == encoded(fresh(tokenizer_dir), [r["text"] for r in documents(4, seed=0)])


# ---- train and validation are disjoint ---------------------------------------------------------------------------

def test_held_out_documents_are_disjoint_from_training_with_duplicates(tokenizer_dir: str, tmp_path: Path,
                                                                       fresh_seed: int) -> None:
    """16 distinct documents, each 1 to 3 times, in a shuffled file; val_fraction=0.5: 8 distinct documents are
    held out with all their copies, and none of them is trained on."""
    rng = random.Random(fresh_seed)
    distinct = [r["text"] for r in documents(16, seed=fresh_seed % 1000, max_sentences=2)]
    assert len(set(distinct)) == 16
    texts = [t for t in distinct for _ in range(rng.randint(1, 3))]
    rng.shuffle(texts)
    path = write_jsonl(tmp_path / "d.jsonl", iter({"text": t} for t in texts))
    data = HFDataModule(str(path), tokenizer=tokenizer_dir, seq_len=64, val_fraction=0.5, seed=fresh_seed,
                        cache_dir=str(tmp_path / "cache"))
    data.setup("fit")
    tokenizer = fresh(tokenizer_dir)
    doc = {tuple(encoded(tokenizer, [t])): t for t in distinct}

    def split_texts(split: str) -> list[str]:
        stream, out, start = trained(data, split), [], 0
        for i, token in enumerate(stream):
            if token == tokenizer.eos_token_id:
                out.append(doc[tuple(stream[start: i + 1])])
                start = i + 1
        return out

    train, val = split_texts("train"), split_texts("val")
    assert not set(train) & set(val), f"{len(set(train) & set(val))} held-out documents are also trained on"
    assert len(set(val)) == 8 and sorted(train + val) == sorted(texts)
    assert train == [t for t in texts if t not in set(val)]  # in file order


def test_validation_files_repeating_training_documents_are_counted(tokenizer_dir: str, tmp_path: Path) -> None:
    rows = list(documents(6, seed=3))
    train = write_jsonl(tmp_path / "train.jsonl", iter(rows))
    val = write_jsonl(tmp_path / "val.jsonl", iter(rows[:2] + list(documents(3, seed=9))))
    data = HFDataModule(str(train), val_files=str(val), tokenizer=tokenizer_dir, seq_len=64,
                        cache_dir=str(tmp_path / "cache"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data.setup("fit")
    said = [str(w.message) for w in caught if "validation documents" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("HFDataModule: 2 of the 5 validation documents (val_files) are"
                                                 " also training documents (train_files)")

"""``HFDataModule`` mixtures: datasets of other row formats (ShareGPT, Alpaca, OpenAI messages, text) mixed into one
set of samples by weight or count, each dataset's documents exactly those of its rows rendered as messages, the loss
on assistant turns only; refusals name the dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_fpdt.data.hf_datamodule import HFDataModule, load_tokenizer
from lightning_fpdt.data.packing import IGNORE, chat_tokens
from lightning_fpdt.data.sources import DataSource, as_documents, chosen
from lightning_fpdt.data.toy import alpaca_rows, build_tokenizer, sharegpt_rows, write_jsonl
from lightning_fpdt.errors import FPDTError


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return str(path)


def as_messages_sharegpt(row: dict) -> list[dict]:
    names = {"system": "system", "human": "user", "gpt": "assistant"}
    return [{"role": names[t["from"]], "content": t["value"]} for t in row["conversations"]]


def as_messages_alpaca(row: dict) -> list[dict]:
    prompt = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]


def _documents(data: HFDataModule, split: str = "train") -> list[tuple[list[int], list[int]]]:
    """The samples' documents (ids and labels), cut where the positions restart, the pads at their ends left out."""
    out = []
    tokenizer = load_tokenizer(data.tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    arrays = (data.train_set if split == "train" else data.val_set).arrays
    for ids, labels, positions in zip(arrays["input_ids"], arrays["labels"], arrays["position_ids"]):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        for a, b in zip(starts, starts[1:]):
            if all(int(t) == pad for t in ids[a:b]) and all(int(t) == IGNORE for t in labels[a:b]):
                continue
            out.append((list(map(int, ids[a:b])), list(map(int, labels[a:b]))))
    return out


def test_a_sharegpt_and_an_alpaca_file_mix_by_weight_and_count(tokenizer_dir: str, tmp_path: Path) -> None:
    """12 ShareGPT rows at weight 1.5 (every one once, half of them twice) and 10 Alpaca rows of which 4 are drawn:
    the samples hold exactly those documents, each the chat template's rendering of its row as messages, with labels
    on the assistant turns only; the counts are kept and logged."""
    share, alpaca = sharegpt_rows(12, 1), alpaca_rows(10, 2)
    write_jsonl(tmp_path / "share.jsonl", iter(share))
    write_jsonl(tmp_path / "alpaca.jsonl", iter(alpaca))
    mixture = [{"path": str(tmp_path / "share.jsonl"), "format": "sharegpt", "weight": 1.5},
               {"path": str(tmp_path / "alpaca.jsonl"), "format": "alpaca", "samples": 4}]
    data = HFDataModule(mixture=mixture, tokenizer=tokenizer_dir, format="chat", seq_len=256,
                        cache_dir=str(tmp_path / "cache"), seed=5)
    data.prepare_data()
    data.setup("fit")
    assert data.stats["mixture"] == [
        {"name": "share.jsonl", "format": "sharegpt", "split": "train", "documents": 12, "chosen": 18},
        {"name": "alpaca.jsonl", "format": "alpaca", "split": "train", "documents": 10, "chosen": 4}]
    tokenizer = load_tokenizer(tokenizer_dir)
    picked = [as_messages_sharegpt(share[i]) for i in chosen(12, DataSource("s", weight=1.5), 5, 0)]
    picked += [as_messages_alpaca(alpaca[i]) for i in chosen(10, DataSource("a", samples=4), 5, 1)]
    expected = sorted(chat_tokens(tokenizer, m) for m in picked)
    got = _documents(data)
    assert len(got) == 22 and sorted(got) == expected
    for ids, labels in got:  # loss on assistant tokens only: every label is its token or ignored, some are tokens
        assert all(label in (IGNORE, token) for token, label in zip(ids, labels))
        assert any(label != IGNORE for label in labels)
    assert sum(1 for ids, labels in got for label in labels if label != IGNORE) < sum(len(ids) for ids, _ in got) / 2


def test_the_draw_is_the_weight_or_count_and_repeats_whole_copies() -> None:
    assert list(chosen(4, DataSource("x", weight=2.0), 0, 0)) == [0, 1, 2, 3, 0, 1, 2, 3]
    half = chosen(10, DataSource("x", weight=0.5), 0, 0)
    assert len(half) == 5 and len(set(half.tolist())) == 5 and list(half) == sorted(half)
    assert len(chosen(3, DataSource("x", samples=7), 0, 0)) == 7
    assert not np.array_equal(chosen(100, DataSource("x", samples=5), 0, 0), chosen(100, DataSource("x", samples=5),
                                                                                     0, 1))  # per dataset


def test_rows_become_messages() -> None:
    rows = {"conversations": [[{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]]}
    spec = DataSource("x", "sharegpt").resolved(True, 0).spec()
    assert as_documents(rows, spec) == [[{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]]
    spec = DataSource("x", "sharegpt", roles={"bot": "assistant"}).resolved(True, 0).spec()
    assert as_documents(rows, spec)[0][1] == {"role": "assistant", "content": "yo"}
    rows = {"prompt": ["Add.", "Sum"], "context": ["1 2", None], "answer": ["3", "x"], "sys": ["Be exact.", ""]}
    spec = DataSource("x", "alpaca", field="prompt", columns={"input": "context", "output": "answer",
                                                              "system": "sys"}).resolved(True, 0).spec()
    assert as_documents(rows, spec) == [
        [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Add.\n\n1 2"},
         {"role": "assistant", "content": "3"}],
        [{"role": "user", "content": "Sum"}, {"role": "assistant", "content": "x"}]]
    # messages rows whose speakers have other names: roles renames them too (it was read only for sharegpt)
    rows = {"dialogue": [[{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo", "name": "b"}]]}
    spec = DataSource("x", "messages", field="dialogue", roles={"bot": "assistant"}).resolved(True, 0).spec()
    assert as_documents(rows, spec) == [[{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "yo", "name": "b"}]]


@pytest.mark.parametrize(("source", "chat", "message"), [
    (DataSource("x", "alpaca"), False, "format='alpaca' rows are conversations, but the data module's format is text"),
    (DataSource("x", "text"), True, "format='text' rows are text, but the data module's format is chat"),
    (DataSource("x", weight=1.0, samples=3), True, "weight=1.0 and samples=3: give one of them"),
    (DataSource("x", weight=0), True, "weight=0 must be a positive number"),
    (DataSource("x", samples=2.5), True, "samples=2.5 must be a positive whole number"),
    (DataSource("x", roles={"gpt": "model"}), True, "roles {'gpt': 'model'} must map to"),
    (DataSource("x", "alpaca", columns={"answer": "a"}), True, "columns ['answer'] are not alpaca columns"),
])
def test_bad_mixture_entries_are_refused_naming_the_dataset(source: DataSource, chat: bool, message: str) -> None:
    with pytest.raises(FPDTError, match=r"HFDataModule: mixture\[3\] \('x'\): " + message.replace("[", r"\[")
                       .replace("(", r"\(").replace(")", r"\)").replace("{", r"\{").replace("}", r"\}")):
        source.resolved(chat, 3)


def test_a_mixture_replaces_the_files_and_needs_training_data(tmp_path: Path) -> None:
    with pytest.raises(FPDTError, match="give train_files .and val_files., or a mixture"):
        HFDataModule("a.jsonl", mixture=[{"path": "b.jsonl"}], format="chat")
    with pytest.raises(FPDTError, match="give train_files .and val_files., or a mixture"):
        HFDataModule()
    with pytest.raises(FPDTError, match="the mixture has no dataset of split 'train'"):
        HFDataModule(mixture=[{"path": "b.jsonl", "split": "val"}], format="chat")


def test_a_mixture_s_validation_dataset_is_the_validation_set(tokenizer_dir: str, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", iter(sharegpt_rows(6, 3)))
    write_jsonl(tmp_path / "val.jsonl", iter(alpaca_rows(3, 4)))
    data = HFDataModule(mixture=[{"path": str(tmp_path / "train.jsonl"), "format": "sharegpt"},
                                 {"path": str(tmp_path / "val.jsonl"), "format": "alpaca", "split": "val"}],
                        tokenizer=tokenizer_dir, format="chat", seq_len=256, cache_dir=str(tmp_path / "cache"))
    data.prepare_data()
    data.setup("fit")
    assert len(_documents(data, "train")) == 6 and len(_documents(data, "val")) == 3


def test_a_dataset_without_its_format_s_columns_is_named(tokenizer_dir: str, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "share.jsonl", iter([{"dialogue": [{"from": "human", "value": "hi"}]}]))
    data = HFDataModule(mixture=[{"path": str(tmp_path / "share.jsonl"), "format": "sharegpt"}],
                        tokenizer=tokenizer_dir, format="chat", seq_len=256, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(FPDTError, match=r"share.jsonl' has no field 'conversations' \(its fields are \['dialogue'\]\)."
                                        r" Set a mixture dataset's field to the field that holds the data"):
        data.setup("fit")

"""The datasets of an ``HFDataModule`` mixture: which files, in which row format, how many of their documents.

A :class:`DataSource` names local files (globs, ``save_to_disk`` directories), the format of their rows, and its
share of the mixture. Each row is read as what the data module tokenizes: a text (``format="text"``) or a list of
``{"role", "content"}`` messages (every chat format):

- ``"messages"``: OpenAI-style ``{"messages": [{"role": "user", "content": ...}, ...]}`` (``roles`` renames roles
  that are not system/user/assistant);
- ``"sharegpt"``: ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}``, its speakers
  mapped to roles (``human``/``user`` -> user, ``gpt``/``assistant``/``chatgpt``/``bing``/``bard`` -> assistant,
  ``system`` -> system; ``roles`` adds or replaces names);
- ``"alpaca"``: ``{"instruction", "input", "output"}`` (and an optional ``system``) as one user turn (the
  instruction, then the input after a blank line when there is one) and the assistant's reply.

``weight`` multiplies a dataset's documents (0.5: half of them, 2: each twice) and ``samples`` asks for that many;
the documents are drawn from the data module's ``seed`` and the dataset's place in the list (a whole copy for each
full multiple, the rest drawn without repetition), so the same mixture gives the same documents on every run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from lightning_fpdt.data.packing import OWNER
from lightning_fpdt.errors import FPDTError, is_positive_int

RowFormat = Literal["text", "messages", "sharegpt", "alpaca"]

DEFAULT_FIELDS = {"text": "text", "messages": "messages", "sharegpt": "conversations", "alpaca": "instruction"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}
ALPACA_COLUMNS = ("instruction", "input", "output", "system")


@dataclass(frozen=True)
class DataSource:
    """One dataset of a mixture.

    Args:
        path: jsonl, json, parquet or csv files (globs allowed), or ``save_to_disk`` directories.
        format: the rows' format (module docstring); ``None``: ``"text"`` for a text data module, ``"messages"``
            for a chat one.
        field: the column that holds the text, the messages or the conversation (default: ``text``,
            ``messages``, ``conversations``); for ``"alpaca"``, the instruction's column.
        roles: names of the rows' speakers mapped to ``system``, ``user`` or ``assistant`` (chat formats; added to
            the ShareGPT names).
        columns: for ``"alpaca"``, the columns of ``input``, ``output`` and ``system`` when named otherwise.
        weight: a multiplier of its documents (0.5: half, 2.0: each twice); ``None`` with ``samples`` unset: 1.
        samples: the number of its documents to use (fewer: drawn; more: repeated), instead of ``weight``.
        split: ``"train"``, or ``"val"`` for a dataset that is validation data.
    """

    path: str | list[str]
    format: RowFormat | None = None
    field: str | None = None
    roles: dict[str, str] = dataclasses.field(default_factory=dict)
    columns: dict[str, str] = dataclasses.field(default_factory=dict)
    weight: float | None = None
    samples: int | None = None
    split: Literal["train", "val"] = "train"

    def resolved(self, chat: bool, index: int) -> DataSource:
        """This source with its format and field filled in for a chat (or text) data module, checked.

        Raises:
            FPDTError: a format the data module's ``format`` cannot take, a weight or sample count out of range,
                both given, an unknown split, or roles that are not system/user/assistant; naming the dataset.
        """
        where = f"{OWNER}mixture[{index}] ({self.path!r}): "
        fmt = self.format or ("messages" if chat else "text")
        if fmt not in DEFAULT_FIELDS:
            raise FPDTError(f"{where}format={fmt!r} must be one of {list(DEFAULT_FIELDS)}.")
        if (fmt == "text") == chat:
            raise FPDTError(f"{where}format={fmt!r} rows are {'text' if fmt == 'text' else 'conversations'}, but the"
                            f" data module's format is {'chat' if chat else 'text'}; set the data module's format to"
                            f" {'text' if fmt == 'text' else 'chat'} or give this dataset a"
                            f" {'chat' if chat else 'text'} format.")
        if self.weight is not None and self.samples is not None:
            raise FPDTError(f"{where}weight={self.weight} and samples={self.samples}: give one of them.")
        if self.weight is not None and not (isinstance(self.weight, (int, float)) and self.weight > 0):
            raise FPDTError(f"{where}weight={self.weight!r} must be a positive number (1: every document once).")
        if self.samples is not None and not is_positive_int(self.samples):
            raise FPDTError(f"{where}samples={self.samples!r} must be a positive whole number of documents.")
        if self.split not in ("train", "val"):
            raise FPDTError(f"{where}split={self.split!r} must be 'train' or 'val'.")
        wrong = {k: v for k, v in self.roles.items() if v not in ("system", "user", "assistant")}
        if wrong:
            raise FPDTError(f"{where}roles {wrong} must map to 'system', 'user' or 'assistant'.")
        unknown = sorted(set(self.columns) - set(ALPACA_COLUMNS))
        if unknown:
            raise FPDTError(f"{where}columns {unknown} are not alpaca columns; name some of {list(ALPACA_COLUMNS)}.")
        paths = [self.path] if isinstance(self.path, str) else list(self.path)
        return DataSource(paths, fmt, self.field or DEFAULT_FIELDS[fmt], dict(self.roles), dict(self.columns),
                          self.weight, self.samples, self.split)

    def spec(self) -> dict[str, Any]:
        """What of this source changes the tokens of its rows (a cache key's part)."""
        return {"format": self.format, "field": self.field, "roles": sorted(self.roles.items()),
                "columns": sorted(self.columns.items())}

    def needed_columns(self) -> list[str]:
        """The columns its rows must have."""
        if self.format != "alpaca":
            return [self.field or DEFAULT_FIELDS[self.format or "text"]]
        return [self.field or "instruction", self.columns.get("output", "output")]


def as_documents(rows: dict[str, list[Any]], source: dict[str, Any]) -> list[Any]:
    """The batch's rows as the tokenizer's input: texts, or lists of ``{"role", "content"}`` messages.

    ``source``: :meth:`DataSource.spec` (what a ``datasets`` map worker gets). A row that cannot be read is given
    as it is, so the tokenizer names its problem with the file and row."""
    fmt, column = source["format"], source["field"]
    if fmt == "text" or (fmt == "messages" and not source["roles"]):
        return list(rows[column])
    if fmt == "messages":
        return [_renamed(messages, dict(source["roles"])) for messages in rows[column]]
    if fmt == "sharegpt":
        names = {**SHAREGPT_ROLES, **dict(source["roles"])}
        return [_sharegpt(turns, names) for turns in rows[column]]
    columns = dict(source["columns"])
    count = len(rows[column])
    get = {name: rows.get(columns.get(name, name), [None] * count) for name in ("input", "output", "system")}
    return [_alpaca(rows[column][i], get["input"][i], get["output"][i], get["system"][i]) for i in range(count)]


def _sharegpt(turns: Any, names: dict[str, str]) -> Any:
    if not isinstance(turns, list) or not all(isinstance(t, dict) and "from" in t and "value" in t for t in turns):
        return turns  # the tokenizer names it: not a list of messages
    return [{"role": names.get(t["from"], t["from"]), "content": t["value"]} for t in turns]


def _renamed(messages: Any, names: dict[str, str]) -> Any:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        return messages  # the tokenizer names it: not a list of messages
    return [{**m, "role": names.get(m["role"], m["role"])} for m in messages]


def _alpaca(instruction: Any, extra: Any, output: Any, system: Any) -> list[dict[str, Any]]:
    prompt = instruction if not extra else f"{instruction}\n\n{extra}"
    turns = [{"role": "system", "content": system}] if system else []
    return [*turns, {"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


def chosen(count: int, source: DataSource, seed: int, index: int) -> np.ndarray:
    """Indices of the ``count`` documents a source gives to the mixture, in the documents' order (a document
    repeated for a weight above 1 comes once per copy): ``weight x count`` or ``samples`` of them."""
    want = source.samples if source.samples is not None else round((source.weight or 1.0) * count)
    copies, rest = divmod(want, count) if count else (0, 0)
    rng = np.random.default_rng([seed, index])
    drawn = np.sort(rng.choice(count, size=rest, replace=False)) if rest else np.zeros(0, dtype=np.int64)
    return np.concatenate([np.tile(np.arange(count), copies), drawn]).astype(np.int64)


def mixture_report(counts: Sequence[dict[str, Any]]) -> str:
    """One line per dataset of the mixture: its documents and what the mixture took of them."""
    return "; ".join(f"{c['name']} ({c['format']}, {c['split']}): {c['chosen']} documents from its {c['documents']}"
                     for c in counts)

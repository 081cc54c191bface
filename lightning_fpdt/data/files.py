"""Local data files read with the ``datasets`` library, each bad input named by file, row or field.

Nothing is downloaded: ``datasets`` builds the jsonl/json/parquet/csv files (or loads a ``save_to_disk``
directory) from local paths only. Each file is loaded on its own, so a row is named by its file and its
index in that file.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import datasets

from lightning_fpdt.data.packing import OWNER, DataError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def resolve(patterns: str | list[str], what: str) -> list[str]:
    """The files (or ``save_to_disk`` directories) that ``patterns`` name, globs expanded, in order.

    Raises:
        DataError: a pattern that matches nothing, or a file of a format ``datasets`` is not asked to read.
    """
    found: list[str] = []
    for pattern in [patterns] if isinstance(patterns, str) else list(patterns):
        matches = sorted(glob.glob(os.path.expanduser(pattern))) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if os.path.exists(m)]
        if not matches:
            raise DataError(
                f"{OWNER}{what} {pattern!r} does not exist (no file or directory matches it, working directory"
                f" {os.getcwd()!r}). Give local jsonl, json, parquet or csv files (globs allowed) or a directory"
                " written by datasets.Dataset.save_to_disk; nothing is downloaded."
            )
        for path in matches:
            if os.path.isdir(path) and not _is_saved_dataset(path):
                raise DataError(
                    f"{OWNER}{what} {path!r} is a directory but not one written by datasets.Dataset.save_to_disk"
                    " (no dataset_info.json / state.json). Name its files instead, e.g. a glob 'dir/*.jsonl'."
                )
            if os.path.isfile(path) and Path(path).suffix.lower() not in BUILDERS:
                raise DataError(
                    f"{OWNER}{what} {path!r} has the extension {Path(path).suffix!r}; use .jsonl, .json, .parquet or"
                    " .csv files, or a save_to_disk directory."
                )
            found.append(path)
    return found


def _is_saved_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def load(path: str, cache_dir: str) -> datasets.Dataset:
    """One file or ``save_to_disk`` directory as a ``datasets.Dataset``.

    Raises:
        DataError: a file ``datasets`` cannot parse (for jsonl, the line that is not JSON), or a saved
            ``DatasetDict`` (name its split's directory).
    """
    if os.path.isdir(path):
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            raise DataError(
                f"{OWNER}{path!r} holds a DatasetDict with splits {list(loaded)}; name one split's directory"
                f" (e.g. {os.path.join(path, next(iter(loaded), 'train'))!r})."
            )
        return loaded
    builder = BUILDERS[Path(path).suffix.lower()]
    if os.path.getsize(path) == 0:
        raise DataError(f"{OWNER}{path!r} is empty (0 bytes, no rows); remove it from the files or give it data.")
    try:
        return datasets.load_dataset(builder, data_files=[os.path.abspath(path)], split="train", cache_dir=cache_dir)
    except PermissionError as err:  # not a parse error: the file, or the cache datasets writes, is not accessible
        raise DataError(f"{OWNER}{path!r} could not be read: {type(err).__name__}: {err}. Make the file readable and"
                        f" cache_dir ({cache_dir!r} here) writable.") from None
    except Exception as err:  # datasets' own parser errors name neither the line nor the fix
        if builder != "parquet":
            _raise_blank(path)
        if builder == "json":
            _raise_bad_json_line(path)
        raise DataError(f"{OWNER}{path!r} could not be read as {builder}: {type(err).__name__}: {err}") from None


def _raise_blank(path: str) -> None:
    # datasets: 'Instruction "train" corresponds to no data!' (json), 'No columns to parse from file' (csv)
    with open(path, "rb") as f:
        data = f.read()
    if not data.strip():
        raise DataError(f"{OWNER}{path!r} has no rows: its {len(data)} bytes are blank lines or spaces; remove it"
                        " from the files or give it data.")


def _raise_bad_json_line(path: str) -> None:
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, list):
        return  # a valid JSON array: not a line problem
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{OWNER}{path}:{number}: line {number} is not valid JSON ({err.msg} at column {err.colno}): "
                f"{line[:120]!r}. Each line of a jsonl file must be one JSON object; fix or remove that line."
            ) from None
        if not isinstance(row, dict):
            raise DataError(
                f"{OWNER}{path}:{number}: line {number} is a JSON {type(row).__name__}, not an object; each line of"
                " a jsonl file must be one JSON object such as {\"text\": ...}."
            )


def check_field(data: datasets.Dataset, field: str, option: str, path: str) -> None:
    """Refuse a dataset without the column ``field``, naming the file, the columns it has and the option."""
    if field not in data.column_names:
        raise DataError(
            f"{OWNER}{path!r} has no field {field!r} (its fields are {data.column_names}). Set {option} to the"
            " field that holds the data, or fix the file."
        )

"""What ``HFDataModule``'s caches are keyed by: the content of everything that determines the tokens.

- The data: each file's bytes (SHA-256; every file of a ``save_to_disk`` directory). Size and modification time
  cannot tell a file rewritten with its mtime kept (``cp -p``, ``rsync -t``, ``os.utime``) from the old one.
  A file's hash is memoized in ``cache_dir/hashes/`` under its status (path, size, mtime, ctime, inode): any
  write moves the ctime, which no copy tool can set back, so an unchanged file is not read again (one changed
  in the last :data:`SETTLED_S` seconds is read every time: a coarse clock could give a second write its ctime).
- The tokenizer: every file of its directory a tokenizer can read (its chat template and special tokens among
  them; weights and hidden files left out, so a model directory is not read through).
- The libraries that turn rows into tokens (their versions), and the options.

``datasets`` keys its own caches of a local file by its path and mtime (``data_files._get_single_origin_metadata``)
and a ``map`` by the function and its arguments: :func:`datasets_dir` gives each content of a file a directory of
its own for both, so neither can return the arrow file of an earlier content, and nothing is written next to the
data (a ``save_to_disk`` directory). There the tokens' file is named by the tokenizer's hash, the libraries and
the format, so a new ``seq_len`` or ``seed`` packs again without tokenizing again.

:func:`check_writable` is called only where something must be written: a cache built earlier is read from
read-only storage.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from lightning_fpdt.data.packing import OWNER, DataError

LIBRARIES = ("datasets", "jinja2", "tokenizers", "transformers")  # parsing, chat templates, tokenization
WEIGHTS = frozenset({".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx"})
SETTLED_S = 2.0  # seconds: a file changed more recently is not memoized (file timestamps tick in jiffies or seconds)
_CHUNK = 1 << 20

VERSION = 5  # of the samples made from the same inputs: bump when they change (2: headers of templates without a
# generation prompt; 3: content parts joined, duplicates held out together; 4: datasets of a mixture, their formats;
# 5: a messages dataset's roles applied)


def digest(value: Any) -> str:
    """The first 16 hex digits of the SHA-256 of ``value`` as sorted JSON: a cache directory's name."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _files(path: str) -> list[Path]:
    if not os.path.isdir(path):
        return [Path(path)]
    return sorted(p for p in Path(path).rglob("*") if p.is_file())


def file_hash(path: Path, memo: Path) -> str:
    """SHA-256 of the file's bytes, memoized in ``memo`` under the file's status (best effort: an unwritable
    ``memo`` only means the file is read again next time)."""
    stat = os.stat(path)
    status = [os.path.abspath(path), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]
    entry = memo / hashlib.sha256(json.dumps(status).encode()).hexdigest()[:32]
    try:
        held = entry.read_text()
        if len(held) == 64:
            return held
    except OSError:
        pass
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    value = sha.hexdigest()
    if time.time() - max(stat.st_mtime_ns, stat.st_ctime_ns) / 1e9 > SETTLED_S:
        try:
            memo.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=memo, delete=False) as f:
                f.write(value)
            os.replace(f.name, entry)
        except OSError:
            pass
    return value


def source_hash(path: str, memo: Path) -> str:
    """The content hash of a data file, or of a ``save_to_disk`` directory (its files' names and bytes)."""
    if not os.path.isdir(path):
        return file_hash(Path(path), memo)
    return hashlib.sha256(json.dumps([[str(f.relative_to(path)), file_hash(f, memo)]
                                      for f in _files(path)]).encode()).hexdigest()


def no_tokenizer(path: str, reason: str) -> DataError:
    """The error of a tokenizer that cannot be loaded from ``path`` (docs/troubleshooting.md)."""
    return DataError(
        f"{OWNER}no tokenizer could be loaded from {path!r} ({reason}). Give data.tokenizer: a local directory with"
        " tokenizer.json / tokenizer_config.json (the model's directory usually has them); nothing is downloaded."
    )


def tokenizer_hash(path: str, memo: Path) -> str:
    """SHA-256 of the names and bytes of every file under ``path`` a tokenizer can read.

    Raises:
        DataError: ``path`` does not exist.
    """
    if not os.path.exists(path):
        raise no_tokenizer(path, f"no such file or directory; working directory {os.getcwd()!r}")
    root = path if os.path.isdir(path) else os.path.dirname(path)
    sha = hashlib.sha256()
    for f in _files(path):
        name = f.relative_to(root)
        if f.suffix.lower() in WEIGHTS or any(part.startswith(".") for part in name.parts):
            continue
        sha.update(json.dumps([str(name), file_hash(f, memo)]).encode())
    return sha.hexdigest()


def versions() -> dict[str, str | None]:
    """The installed versions of :data:`LIBRARIES` (``None``: not installed)."""
    found: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def datasets_dir(cache_dir: Path, content: str) -> Path:
    """Where ``datasets`` keeps what it makes of one content of a file: its parsed rows and their tokens."""
    return cache_dir / "datasets" / content[:32]


def check_writable(directory: Path) -> None:
    """Create ``directory`` and a file in it, or raise why not.

    Raises:
        DataError: the directory cannot be created or written (naming it and ``cache_dir``).
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".writable-"):
            pass
    except OSError as err:
        raise DataError(
            f"{OWNER}the cache directory {str(directory)!r} cannot be written ({type(err).__name__}:"
            f" {err.strerror or err}); the tokenized samples are kept there. Set cache_dir (data.cache_dir in a"
            " config) to a writable directory, or make this one writable."
        ) from None

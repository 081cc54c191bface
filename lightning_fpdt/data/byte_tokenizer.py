"""A byte-level tokenizer: ids 0..255 are the UTF-8 bytes. No files, no downloads."""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """``encode(str) -> list[int]`` over UTF-8 bytes; ``vocab_size`` is 256."""

    vocab_size = 256
    pad_token_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

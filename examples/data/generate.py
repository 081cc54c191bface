"""Regenerate the example data of examples/configs/hf_sft_cpu.yaml and hf_text_cpu.yaml (no download):

    python examples/data/generate.py

writes ``examples/data/tokenizer/`` (a byte-level BPE of 384 tokens with a Llama-3-style chat template,
:func:`lightning_fpdt.data.toy.build_tokenizer`), ``chat.jsonl`` (conversations, ``{"messages": [...]}``) and
``text.jsonl`` (documents, ``{"text": ...}``). The files ship with the repository; the output is the same
every time.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from lightning_fpdt.data.toy import build_tokenizer, conversations, documents, write_jsonl  # noqa: E402


def main() -> None:
    build_tokenizer(HERE / "tokenizer")
    write_jsonl(HERE / "chat.jsonl", conversations(120, seed=1, max_turns=2))
    write_jsonl(HERE / "text.jsonl", documents(100, seed=2, max_sentences=8))


if __name__ == "__main__":
    main()

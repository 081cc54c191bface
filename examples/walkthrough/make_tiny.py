"""The walkthrough's stand-ins for your own files (docs/walkthrough.md), made in code, nothing downloaded:

    python examples/walkthrough/make_tiny.py --out .

writes ``tiny-chat/`` (a Hugging Face checkpoint: a 2-layer Qwen3 config with random weights saved by
``save_pretrained``, and a byte-level BPE tokenizer with a chat template), ``data/sharegpt.jsonl`` (ShareGPT
conversations, ``{"conversations": [{"from": "human", ...}, {"from": "gpt", ...}]}``) and ``data/alpaca.jsonl``
(``{"instruction", "input", "output"}`` rows). The same files every time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from lightning_fpdt.data.toy import alpaca_rows, build_tokenizer, sharegpt_rows, write_jsonl


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="the directory to write tiny-chat/ and data/ into")
    out = Path(parser.parse_args(argv).out)
    tokenizer = build_tokenizer(out / "tiny-chat")
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out / "tiny-chat")
    (out / "data").mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "data" / "sharegpt.jsonl", iter(sharegpt_rows(90, seed=1)))
    write_jsonl(out / "data" / "alpaca.jsonl", iter(alpaca_rows(60, seed=2)))
    print(f"wrote {out / 'tiny-chat'} and {out / 'data'}")


if __name__ == "__main__":
    main()

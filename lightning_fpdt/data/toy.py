"""A small tokenizer with a Llama-3-style chat template, and generated text and chat corpora (messages, ShareGPT and
Alpaca rows), all made in code:
the tests, the CPU example configs (``examples/data/generate.py``) and ``benchmarks/data.py`` need no download.

The tokenizer is a byte-level BPE trained on generated sentences, with Llama-3's pre-tokenizer pattern, its
special tokens and a chat template in Llama-3's style *without* ``{% generation %}`` markers (as the released
Llama-3 and Qwen3 templates are), saved as a ``PreTrainedTokenizerFast`` that ``AutoTokenizer`` loads.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|pad|>"]
# Llama-3's pre-tokenizer: "\n\n" after a header is one piece whatever follows, so a conversation's prefix
# tokenizes as the start of the whole conversation
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

WORDS = ("the a one two three river stone cloud green blue small large quick slow tree house light dark "
         "sky sun moon star road hill city field word number count answer question why how what where "
         "sits runs falls rises holds turns reads writes opens closes is was has had will can may").split()


def sentence(rng: random.Random, words: int = 12) -> str:
    """A generated sentence of ``words`` words from a small vocabulary, with a number in it."""
    body = " ".join(rng.choice(WORDS) for _ in range(words - 1))
    return f"{body.capitalize()} {rng.randrange(1000)}."


def build_tokenizer(path: str | Path, vocab_size: int = 384, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on generated sentences and save it (with the chat template) to ``path``.

    Returns:
        the tokenizer, as ``AutoTokenizer.from_pretrained(path)`` loads it (BOS ``<|begin_of_text|>``
        prepended, EOS ``<|end_of_text|>``, pad ``<|pad|>``).
    """
    rng = random.Random(seed)
    corpus = [sentence(rng) for _ in range(2000)]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=SPECIAL[0], eos_token=SPECIAL[1], pad_token=SPECIAL[5],
        add_bos_token=True, chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(str(path))
    return tokenizer


def conversations(n: int, seed: int, max_turns: int = 3) -> Iterator[dict[str, Any]]:
    """``n`` rows ``{"messages": [...]}``: an optional system prompt, then 1 to ``max_turns`` user/assistant
    exchanges of different lengths (the assistant repeats the question's number back)."""
    rng = random.Random(seed)
    for _ in range(n):
        messages = [{"role": "system", "content": "Answer with the number."}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, max_turns)):
            number = rng.randrange(1000)
            question = sentence(rng, rng.randint(3, 20))
            messages.append({"role": "user", "content": f"{question} What is {number}?"})
            messages.append({"role": "assistant", "content": f"It is {number}. {sentence(rng, rng.randint(2, 8))}"})
        yield {"messages": messages}


def sharegpt_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` ShareGPT rows ``{"id", "conversations": [{"from": "human" | "gpt" | "system", "value"}]}``: one or two
    exchanges, a third of them after a system prompt."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = [{"from": "system", "value": "Answer in one sentence."}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 2)):
            turns += [{"from": "human", "value": sentence(rng, rng.randint(3, 8))},
                      {"from": "gpt", "value": sentence(rng, rng.randint(2, 6))}]
        rows.append({"id": f"conv-{i}", "conversations": turns})
    return rows


def alpaca_rows(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` Alpaca rows ``{"instruction", "input", "output"}``, every other one with an input."""
    rng = random.Random(seed)
    return [{"instruction": sentence(rng, 5), "input": sentence(rng, 4) if i % 2 else "",
             "output": sentence(rng, rng.randint(2, 6))} for i in range(n)]


def documents(n: int, seed: int, max_sentences: int = 12) -> Iterator[dict[str, str]]:
    """``n`` rows ``{"text": ...}`` of 1 to ``max_sentences`` generated sentences."""
    rng = random.Random(seed)
    for _ in range(n):
        yield {"text": " ".join(sentence(rng) for _ in range(rng.randint(1, max_sentences)))}


def write_jsonl(path: str | Path, rows: Iterator[dict[str, Any]]) -> Path:
    """Write ``rows`` to ``path``, one JSON object a line."""
    path = Path(path)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path

"""Documents to training samples: tokenization of text and chat rows, the held-out split, and packing into
``seq_len`` samples.

- text: a document is ``tokenizer(text)`` (with the BOS the tokenizer adds) plus its EOS; documents are laid
  back to back in file order and cut into ``seq_len`` samples, so a document longer than what is left of a
  sample continues in the next sample as a new document.
- chat: a conversation is its chat-template rendering; its labels are the tokens of the assistant turns
  (the reply and the template's end of turn), found by rendering the prefixes of the conversation and
  checking that each prefix tokenizes as the start of the whole (:func:`chat_tokens`); a template without a
  generation prompt has its assistant header found from two renderings of the turn (:func:`_reply_start`). A
  content given as a list of text parts (the OpenAI format) is their text joined.
  Conversations are bin-packed whole (best-fit decreasing, :func:`pack_whole`).
- held out (``val_fraction``): :func:`hold_out` draws distinct documents, each with all its copies, so training
  and validation share none.

In every sample ``position_ids`` restart at 0 where a document starts (and at the sample's start), which
``FPDTStrategy`` and ``CausalLM`` read as document starts: attention and targets stay inside a document.
The free tail of a sample is padding: ``pad_id`` tokens, ignored labels, positions restarting at 0.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from lightning_fpdt.errors import FPDTError

IGNORE = -100
OWNER = "HFDataModule: "


class DataError(FPDTError):
    """Bad input data or options; the message names the file, row or field and the fix."""


def text_tokens(tokenizer: Any, text: Any) -> list[int]:
    """The ids of one text document: ``tokenizer(text)`` (BOS where the tokenizer adds it) and the EOS.

    Raises:
        ValueError: ``text`` is not a non-empty string (the caller adds the row).
    """
    if not isinstance(text, str) or not text:
        raise FPDTError(f"has no tokens (the text is {text!r}); remove the row or give it text")
    ids = list(tokenizer(text)["input_ids"])
    return ids + [tokenizer.eos_token_id]


def _text(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _ids(tokenizer: Any, text: str) -> list[int]:
    # the template writes its own special tokens (BOS included): do not add them again
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def has_generation_prompt(tokenizer: Any) -> bool:
    """Whether the chat template renders something for ``add_generation_prompt=True`` after a user turn (a
    template without that branch renders nothing; ``True`` when the probe cannot be rendered)."""
    probe = [{"role": "user", "content": "A"}]
    try:
        return _text(tokenizer, probe, True) != _text(tokenizer, probe, False)
    except Exception:  # a template that refuses the probe: chat_tokens checks each turn on its own anyway
        return True


def _reply_start(tokenizer: Any, messages: list[dict[str, Any]], i: int) -> str:
    """The text before assistant turn ``i``'s reply: the rendering of ``messages[:i]`` and the turn's header.

    That is the generation prompt's rendering when it adds something. A template without a generation-prompt
    branch renders nothing for it (the header would be trained as part of the reply), and ``messages[:0]`` is
    not rendered at all (an empty conversation breaks many templates): then the turn is rendered with the
    replies ``"A"`` and ``"B"``, and the header ends where the two renderings part.

    Raises:
        ValueError: the two renderings are the same (the template ignores the content) or do not start with
            the rendering of ``messages[:i]``.
    """
    before = _text(tokenizer, messages[:i], False) if i else ""
    if i:
        prompted = _text(tokenizer, messages[:i], True)
        if prompted != before:
            return prompted
    one, other = (_text(tokenizer, [*messages[:i], {**messages[i], "content": reply}], False) for reply in "AB")
    start = os.path.commonprefix([one, other])
    if one == other or not start.startswith(before):
        raise FPDTError(
            f"has assistant turn {i} whose header cannot be found: the chat template renders nothing for"
            " add_generation_prompt=True, and rendering the turn with two different replies"
            f" {'gives the same text' if one == other else 'does not start with the conversation before it'}."
            " Use a chat template with a generation prompt ({% if add_generation_prompt %}...{% endif %})"
        )
    return start


TEXT_PARTS = ("text", "input_text", "output_text")  # the OpenAI formats' text parts


def _text_content(message: dict[str, Any], i: int) -> dict[str, Any]:
    """``message`` with a content given as a list of parts (``[{"type": "text", "text": ...}]``, the OpenAI format)
    as one string: its text parts joined in order, without a separator, as templates that take lists render
    text-only content (Qwen2-VL's); a template written for strings, given the list, would render its Python repr.

    Raises:
        ValueError: a part that is not text (an image, audio), naming the message and the part's type.
    """
    content = message["content"]
    if not isinstance(content, list):
        return message
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            what = f"is of type {kind!r}" if kind not in TEXT_PARTS else f"has no text string ({part.get('text')!r})"
            raise FPDTError(
                f"has message {i} ({message['role']}) whose content part {j} {what}: only text parts"
                " ({'type': 'text', 'text': ...}) can be tokenized here; remove that part or the row, or give the"
                " content as a string"
            )
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


def chat_tokens(tokenizer: Any, messages: Any) -> tuple[list[int], list[int]] | None:
    """Ids and labels of one conversation rendered with the tokenizer's chat template.

    Labels are the ids at the assistant turns' tokens and ``-100`` elsewhere (unshifted: ``labels[t]`` is
    token ``t``). An assistant turn ``i`` spans from the end of the rendering of ``messages[:i]`` with the
    generation prompt to the end of the rendering of ``messages[:i + 1]``: its reply and the template's end
    of turn. Both renderings must tokenize as the start of the whole conversation's ids, so a template that
    renders a turn differently once it is followed by others, or a tokenizer that merges across the turn's
    edge, is refused rather than labelled wrongly. Where the generation prompt renders nothing (a template
    without that branch, or a conversation that opens with the assistant), the turn's header is found by
    :func:`_reply_start` instead, so it is not labelled either.

    A content given as a list of text parts is their text joined (:func:`_text_content`).

    Returns:
        ``(ids, labels)``, or ``None`` for a conversation without an assistant turn.

    Raises:
        ValueError: messages that are not a list of ``{"role", "content"}`` dicts, a content part that is not
            text, or a turn whose rendering is not a prefix of the whole (the caller adds the row).
    """
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages):
        raise FPDTError(f"is not a non-empty list of {{'role': ..., 'content': ...}} messages: {messages!r:.200}")
    messages = [_text_content(m, i) for i, m in enumerate(messages)]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        return None
    ids = _ids(tokenizer, _text(tokenizer, messages, generation_prompt=False))
    labels = [IGNORE] * len(ids)
    for i in turns:
        start = _ids(tokenizer, _reply_start(tokenizer, messages, i))
        end = _ids(tokenizer, _text(tokenizer, messages[: i + 1], generation_prompt=False))
        for what, part in (("up to its reply", start), ("through it", end)):
            if ids[: len(part)] != part:
                raise FPDTError(
                    f"has assistant turn {i} whose rendering of the conversation {what} does not tokenize as the"
                    " start of the whole conversation (the chat template renders a turn differently when it is"
                    " the last one, or the tokenizer merges tokens across the turn's edge), so its tokens cannot"
                    " be found. Use a chat template that renders each turn the same whatever follows it"
                )
        labels[len(start): len(end)] = ids[len(start): len(end)]
    return ids, labels


def pack_stream(lengths: Sequence[int], seq_len: int) -> list[list[tuple[int, int, int]]]:
    """Documents back to back, cut into samples of ``seq_len`` tokens.

    Args:
        lengths: tokens of each document, in order.
        seq_len: tokens per sample.

    Returns:
        per sample, its pieces ``(document, first token, tokens)``; a document cut by a sample's end
        continues as the first piece of the next sample.
    """
    samples: list[list[tuple[int, int, int]]] = [[]]
    room = seq_len
    for doc, n in enumerate(lengths):
        first = 0
        while first < n:
            if room == 0:
                samples.append([])
                room = seq_len
            take = min(room, n - first)
            samples[-1].append((doc, first, take))
            first, room = first + take, room - take
    return samples if samples[0] else []


def pack_whole(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Documents of at most ``seq_len`` tokens packed whole into samples, best-fit decreasing.

    The longest document goes first, each into the sample with the least room that still holds it (a new
    sample when none does); ties by document index, so the result is a pure function of ``lengths``.

    Returns:
        per sample, its documents (indices into ``lengths``) in the order they were placed.
    """
    order = sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room, sample), sorted
    for doc in order:
        n = lengths[doc]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, sample = free.pop(at)
        else:
            room, sample = seq_len, len(bins)
            bins.append([])
        bins[sample].append(doc)
        if room - n > 0:
            bisect.insort(free, (room - n, sample))
    return bins


def _document(ids: Sequence[int]) -> bytes:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).digest()


def hold_out(ids: Sequence[Sequence[int]], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """The training and held-out documents (indices, in order): ``int(n * fraction)`` of the ``n`` distinct
    documents, drawn from ``seed``, are held out with every copy of each, so no document is in both."""
    first: dict[bytes, int] = {}
    group = [first.setdefault(_document(d), len(first)) for d in ids]
    held = set(np.random.default_rng(seed).permutation(len(first))[:int(len(first) * fraction)].tolist())
    return [i for i, g in enumerate(group) if g not in held], [i for i, g in enumerate(group) if g in held]


def shared(ids: Sequence[Sequence[int]], others: Sequence[Sequence[int]]) -> int:
    """How many documents of ``ids`` are also documents of ``others`` (the same token ids)."""
    seen = {_document(d) for d in others}
    return sum(_document(d) in seen for d in ids)


def fill(samples: np.ndarray, pad_mask: np.ndarray) -> float:
    """The fraction of the sample tokens ``[n, seq_len]`` that are not padding (``pad_mask`` True)."""
    return 1.0 - float(pad_mask.sum()) / max(samples.size, 1)


def build_samples(
    ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]] | None, seq_len: int, whole: bool, pad_id: int
) -> dict[str, np.ndarray]:
    """Packed samples of tokenized documents.

    Args:
        ids: each document's token ids (for ``whole``, at most ``seq_len`` each).
        labels: each document's unshifted labels, or ``None`` for the ids themselves.
        seq_len: tokens per sample.
        whole: bin-pack documents whole (:func:`pack_whole`) instead of back to back (:func:`pack_stream`).
        pad_id: the id of padding tokens.

    Returns:
        ``input_ids``, ``labels``, ``position_ids`` (``[n, seq_len]`` int32) and ``pad`` (``[n, seq_len]``
        bool, True at padding).
    """
    lengths = [len(d) for d in ids]
    if whole:
        pieces = [[(d, 0, lengths[d]) for d in bin_] for bin_ in pack_whole(lengths, seq_len)]
    else:
        pieces = pack_stream(lengths, seq_len)
    n = len(pieces)
    out_ids = np.full((n, seq_len), pad_id, dtype=np.int32)
    out_labels = np.full((n, seq_len), IGNORE, dtype=np.int32)
    positions = np.zeros((n, seq_len), dtype=np.int32)
    pad = np.ones((n, seq_len), dtype=bool)
    for s, sample in enumerate(pieces):
        at = 0
        for doc, first, take in sample:
            out_ids[s, at: at + take] = ids[doc][first: first + take]
            out_labels[s, at: at + take] = (labels or ids)[doc][first: first + take]
            positions[s, at: at + take] = np.arange(take)  # a piece is a document of its own
            pad[s, at: at + take] = False
            at += take
        positions[s, at:] = np.arange(seq_len - at)  # padding: one more document, all targets ignored
    return {"input_ids": out_ids, "labels": out_labels, "position_ids": positions, "pad": pad}

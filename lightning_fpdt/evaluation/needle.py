"""Needle in a haystack, after RULER's ``niah`` tasks (Hsieh et al., "RULER: What's the Real Context Size of Your
Long-Context Language Models?", 2024): key/value needles hidden in a haystack, the question at the end.

Contract: :meth:`NeedleTask.sample` writes exactly ``length`` ids with the model's tokenizer::

    Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you
    about the numbers afterwards.
    <haystack ...> One of the special magic numbers for quiet-harbor is: 4817293. <... haystack>
    What are all the special magic numbers for quiet-harbor mentioned in the provided text? The special magic
    numbers for quiet-harbor mentioned in the provided text are 4817293

The needles of the queried keys (``queries`` keys, ``values`` needles each) sit together between two sentences
of the haystack at the cell's depth; the other keys' needles (distractors) at random sentence boundaries. The
answer is every queried value, in the order of the question's keys and, per key, of the text, joined by
``", "``: the order greedy decoding must write it in to match under teacher forcing. The names and the
settings of :data:`RULER_TASKS` are RULER's (``synthetic.yaml``); the haystacks are
:mod:`lightning_fpdt.evaluation.haystack`'s, or ``"needles"``: a haystack of distractor needles only.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import Any, Literal

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.evaluation.haystack import Haystack, haystack_text
from lightning_fpdt.evaluation.samples import EvalSample

Kind = Literal["words", "numbers", "uuids"]

HEADER = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz"
          " you about the {kind} afterwards.\n")
NEEDLE = " One of the special magic {kind} for {key} is: {value}."
QUESTION = ("\nWhat are all the special magic {kind} for {query} mentioned in the provided text? The special magic"
            " {kind} for {query} mentioned in the provided text are")

# RULER's niah tasks (synthetic.yaml): haystack, key and value kinds, keys, values per key, queried keys
RULER_TASKS: dict[str, dict[str, Any]] = {
    "niah_single_1": {"haystack": "noise", "key_kind": "words", "value_kind": "numbers"},
    "niah_single_2": {"haystack": "essay", "key_kind": "words", "value_kind": "numbers"},
    "niah_single_3": {"haystack": "essay", "key_kind": "words", "value_kind": "uuids"},
    "niah_multikey_1": {"haystack": "essay", "key_kind": "words", "value_kind": "numbers", "keys": 4},
    "niah_multikey_2": {"haystack": "needles", "key_kind": "words", "value_kind": "numbers"},
    "niah_multikey_3": {"haystack": "needles", "key_kind": "uuids", "value_kind": "uuids"},
    "niah_multivalue": {"haystack": "essay", "key_kind": "words", "value_kind": "numbers", "values": 4},
    "niah_multiquery": {"haystack": "essay", "key_kind": "words", "value_kind": "numbers", "keys": 4, "queries": 4},
}

_ADJECTIVES = (
    "quiet amber brave calm clever dusty eager faint gentle golden hollow humble icy jolly kind lively lucky mellow"
    " misty noble pale proud rapid rustic silent silver sleepy sturdy swift tender vivid wandering wild young"
).split()
_NOUNS = (
    "anchor badger beacon blossom bridge canyon castle cedar comet compass harbor falcon feather forest garden"
    " glacier hammer island lantern meadow mirror orchard otter pebble quarry raven river saddle summit thistle"
    " valley willow"
).split()


def _word(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _draw(kind: Kind, rng: random.Random) -> str:
    if kind == "words":
        return _word(rng)
    if kind == "numbers":
        return str(rng.randrange(1_000_000, 10_000_000))  # seven digits, as RULER's
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _listed(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


class NeedleTask:
    """Needles of keys and values hidden in a haystack, the values of some keys asked for at the end (see the
    module docstring; :data:`RULER_TASKS` holds RULER's eight settings by name).

    Args:
        keys: keys with needles in the haystack (the queried ones and distractors); at least ``queries``.
        values: needles (values) per key.
        queries: keys asked for.
        key_kind / value_kind: ``"words"`` (``quiet-harbor``), ``"numbers"`` (seven digits) or ``"uuids"``.
        haystack: ``"essay"``, ``"noise"`` (:mod:`~lightning_fpdt.evaluation.haystack`), ``"needles"``
            (distractor needles only) or the path of a UTF-8 text file.
        seed: samples are a pure function of ``(name, seed, length, depth, index)``.
        name: the name results are logged under.

    Raises:
        ValueError: a count below 1, fewer keys than queries, an unknown kind.
        FileNotFoundError: a haystack path that does not exist.
    """

    def __init__(self, keys: int = 1, values: int = 1, queries: int = 1, key_kind: Kind = "words",
                 value_kind: Kind = "numbers", haystack: str = "essay", seed: int = 0, name: str = "niah") -> None:
        for field, value in (("keys", keys), ("values", values), ("queries", queries)):
            if value < 1:
                raise FPDTError(f"NeedleTask: {field}={value} must be at least 1.")
        if queries > keys:
            raise FPDTError(f"NeedleTask: queries={queries} asks for more keys than the {keys} hidden; use"
                            f" keys >= {queries}.")
        for field, kind in (("key_kind", key_kind), ("value_kind", value_kind)):
            if kind not in ("words", "numbers", "uuids"):
                raise FPDTError(f"NeedleTask: {field}={kind!r} must be 'words', 'numbers' or 'uuids'.")
        self.keys, self.values, self.queries = keys, values, queries
        self.key_kind, self.value_kind, self.haystack, self.seed, self.name = key_kind, value_kind, haystack, seed, name
        self._text = None if haystack == "needles" else haystack_text(haystack)  # a missing file fails here
        self._tokenized: tuple[Callable[[str], list[int]], Haystack] | None = None  # the last tokenizer's haystack

    def _haystack(self, encode: Callable[[str], list[int]]) -> Haystack:
        if self._tokenized is None or self._tokenized[0] is not encode:
            assert self._text is not None
            self._tokenized = encode, Haystack(self._text, encode)
        return self._tokenized[1]

    def _fill(self, encode: Callable[[str], list[int]], n_tokens: int, rng: random.Random,
              taken: set[str]) -> list[list[int]]:
        """The haystack's sentences, ``n_tokens`` ids in all; ``"needles"``: distractor needles of new keys."""
        if self._text is not None:
            return self._haystack(encode).fill(n_tokens, rng)
        out, total, kind = [], 0, self.value_kind
        while total < n_tokens:
            key = _draw(self.key_kind, rng)
            if key in taken:
                continue
            ids = encode(NEEDLE.format(kind=kind, key=key, value=_draw(kind, rng)))[: n_tokens - total]
            out.append(ids)
            total += len(ids)
        return out

    def sample(self, encode: Callable[[str], list[int]], length: int, depth: float, index: int) -> EvalSample:
        """The ``index``-th sample of ``length`` ids with the queried needles at ``depth``.

        Raises:
            ValueError: ``depth`` outside [0, 1]; ``length`` too short for the header, the needles, the question
                and the answer (the minimum named).
        """
        if not 0.0 <= depth <= 1.0:
            raise FPDTError(f"NeedleTask: depth={depth} must be in [0, 1].")
        rng = random.Random(f"{self.name}/{self.seed}/{length}/{depth}/{index}")
        keys: list[str] = []
        while len(keys) < self.keys:
            key = _draw(self.key_kind, rng)
            if key not in keys:
                keys.append(key)
        values = [[_draw(self.value_kind, rng) for _ in range(self.values)] for _ in keys]
        kind, queried = self.value_kind, keys[: self.queries]

        def needles(i: int) -> list[list[int]]:
            return [encode(NEEDLE.format(kind=kind, key=keys[i], value=v)) for v in values[i]]

        asked = [ids for i in range(self.queries) for ids in needles(i)]  # together, at the cell's depth
        distractors = [ids for i in range(self.queries, len(keys)) for ids in needles(i)]
        header = encode(HEADER.format(kind=kind))
        question = encode(QUESTION.format(kind=kind, query=_listed(queried)))
        answer_text = ", ".join(v for i in range(self.queries) for v in values[i])
        answer = encode(" " + answer_text)
        fixed = len(header) + sum(map(len, asked + distractors)) + len(question) + len(answer)
        if length < fixed:
            raise FPDTError(f"NeedleTask: length={length} is too short for the header, needles, question and"
                            f" answer of {self.name!r}; use at least {fixed}.")
        sentences = self._fill(encode, length - fixed, rng, set(keys))
        ends = [0]
        for s in sentences:
            ends.append(ends[-1] + len(s))
        n_hay = ends[-1]
        at = min(range(len(ends)), key=lambda b: abs(ends[b] - depth * n_hay))  # the nearest sentence boundary
        placed: dict[int, list[list[int]]] = {}
        for ids in distractors:
            placed.setdefault(rng.randrange(len(ends)), []).append(ids)
        placed.setdefault(at, []).extend(asked)  # after any distractor at the same boundary
        ids_out = list(header)
        for b in range(len(ends)):
            for needle in placed.get(b, []):
                ids_out += needle
            if b < len(sentences):
                ids_out += sentences[b]
        ids_out += question + answer
        return EvalSample(self.name, length, depth, index, tuple(ids_out), length - len(answer), answer_text,
                          ends[at] / max(n_hay, 1))

    def __repr__(self) -> str:
        return (f"NeedleTask(name={self.name!r}, keys={self.keys}, values={self.values}, queries={self.queries},"
                f" key_kind={self.key_kind!r}, value_kind={self.value_kind!r}, haystack={self.haystack!r})")

"""The haystack a needle hides in: a text cut into sentences, tokenized once, repeated to any length.

Contract: :meth:`Haystack.fill` returns whole sentences (token lists) from a seeded start sentence, cycling
through the text, whose lengths add up to exactly the requested count (the last one cut short), so a needle
can be inserted between two sentences, as RULER's needle-in-a-haystack tasks insert theirs. Sentences are
tokenized one at a time, each with a leading space: the ids are the model's own tokenizer's, and the same
sentence always gives the same ids wherever it lands.

Two haystacks ship: ``"essay"`` (:data:`ESSAY`, plain prose written for this package, no digits) and
``"noise"`` (the pass-key task's repeated filler, RULER's ``niah_single_1`` haystack). Any other string is the
path of a UTF-8 text file of the user's.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from pathlib import Path

from lightning_fpdt.data.passkey import FILLER
from lightning_fpdt.errors import FPDTError

ESSAY = """\
The old town sits where two slow rivers meet, and most of its streets still follow the paths that carts once \
took down to the water. In the mornings a thin mist lies over the fields, and the bakers open their shutters \
before the first bell. Nobody remembers who built the stone bridge, but everyone has an opinion about it. Some \
say it was raised by a guild of masons who never signed their work; others say it simply grew there, like the \
moss on its railings. The market square fills early on the last day of each week. Farmers bring pears, \
cabbages and jars of honey, and the fishmonger calls out the names of the fish as if they were old friends. \
Children are sent to buy bread and come back with ribbons, marbles and stories. A good market, people say, is \
one where you leave with something you did not plan to buy. Beyond the square the streets narrow and climb \
toward the library. The library was once a granary, and on warm afternoons the floorboards still smell \
faintly of wheat. Its reading room has tall windows that face north, so the light is even and kind to old \
paper. The librarian keeps a ledger of every book that has been borrowed and never returned. She does not \
complain about the missing books; she says they are simply being read somewhere else. Learning a craft takes \
longer than most apprentices expect. A carpenter may spend a whole season planing boards before anyone lets \
him cut a joint. The first chairs an apprentice makes are always a little crooked, and the master keeps one of \
them by the door as a reminder. Patience, the masters say, is a tool like any other, and it must be sharpened \
every day. In spring the river rises and the meadows along its banks turn to shallow lakes. Herons stand in the \
new water as still as fence posts, waiting for frogs. The ferryman charges more when the current is strong, \
and nobody argues with him. By midsummer the water has gone back to its bed and the grass grows thick and \
sweet. Travellers who arrive in the evening often stay longer than they meant to. The inn by the east gate has \
a long table where strangers are expected to sit together. Over soup and dark bread they trade news of the \
roads, the weather in the passes and the prices in distant towns. More than one partnership has begun at that \
table, and more than one quarrel. The town has a clock tower, but the clock has not agreed with the sun for \
many years. Some people set their watches by the tower and some by the bakers, and the two groups are always a \
little late for each other. A committee was formed to repair the clock, and it has met faithfully ever since. \
Its members say that progress is being made, slowly, in the way of all good things. Autumn brings the apple \
harvest and the smell of smoke from the drying sheds. Everyone who can climb a ladder is asked to help in the \
orchards. The best apples are wrapped in paper and stored in cellars, and the bruised ones become cider. On the \
last evening of the harvest there is music in the square until the lamps burn out. Winter is quiet, and the \
town turns inward. People mend nets, write letters and read the books they meant to read in summer. Snow \
softens every sound, so that a cart crossing the bridge seems to pass in a dream. When the thaw finally comes, \
the first person to hear the river moving under the ice runs to tell the others. Maps of the region disagree \
about almost everything. One shows a forest where another shows a lake, and a third shows nothing at all. \
Walkers learn to trust the shape of the hills more than the lines on paper. The hills, after all, have not \
moved in living memory, even if the roads have. There is a saying in the valley that a question asked at \
dawn will be answered by dusk. It is not always true, but it makes people bolder about asking. Teachers repeat \
it to shy pupils, and merchants repeat it to nervous customers. Perhaps the saying survives because it is \
hopeful rather than because it is right. Far upstream the river begins as a spring under a flat grey stone. \
Shepherds drink from it and say the water tastes of iron and rain. Few people from the town have ever walked \
that far, though many say they will, one summer soon. The spring does not mind; it has been waiting a long \
time and can wait a while longer.
"""

NOISE = FILLER  # "The grass is green. The sky is blue. ...": RULER's noise haystack, the pass-key filler

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def haystack_text(source: str = "essay") -> str:
    """The text of a haystack: ``"essay"`` (:data:`ESSAY`), ``"noise"`` (:data:`NOISE`), or a text file's path.

    Raises:
        FileNotFoundError: ``source`` is neither a shipped name nor an existing file.
        ValueError: the text holds no sentence.
    """
    if source == "essay":
        text = ESSAY
    elif source == "noise":
        text = NOISE
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(
                f"Haystack: {source!r} is neither a shipped haystack ('essay', 'noise') nor a text file; give the"
                " path of a UTF-8 text file to hide the needles in."
            )
        text = path.read_text(encoding="utf-8")
    if not split_sentences(text):
        raise FPDTError(f"Haystack: {source!r} holds no sentence; give a text with some prose in it.")
    return text


def split_sentences(text: str) -> list[str]:
    """``text`` cut after each ``.``, ``!`` or ``?`` followed by white space; white space runs become one space."""
    return [" ".join(s.split()) for s in _SENTENCE_END.split(text) if s.strip()]


class Haystack:
    """A text's sentences as token lists, repeated to any length.

    Args:
        text: the haystack's text (see :func:`haystack_text`).
        encode: the model's tokenizer, text to ids (:func:`~lightning_fpdt.evaluation.tokenizer.encoder`).

    Raises:
        ValueError: a text whose sentences all tokenize to nothing.
    """

    def __init__(self, text: str, encode: Callable[[str], list[int]]) -> None:
        self.sentences = [ids for ids in (encode(" " + s) for s in split_sentences(text)) if ids]
        if not self.sentences:
            raise FPDTError("Haystack: every sentence of the text tokenizes to no ids; check the tokenizer.")

    def fill(self, n_tokens: int, rng: random.Random) -> list[list[int]]:
        """Sentences from a start drawn with ``rng``, cycling through the text, ``n_tokens`` ids in all.

        Returns:
            token lists whose lengths sum to ``n_tokens`` (the last one cut to fit; empty for ``n_tokens=0``).
        """
        out, total, i = [], 0, rng.randrange(len(self.sentences))
        while total < n_tokens:
            sentence = self.sentences[i % len(self.sentences)][: n_tokens - total]
            out.append(sentence)
            total += len(sentence)
            i += 1
        return out

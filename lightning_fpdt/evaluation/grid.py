"""The evaluation grid, checked before any forward: depths are fractions of the haystack (0 at its start, 1 at its
end), lengths whole numbers of tokens, and lengths against the positions the model was made for.

A length beyond the model's ``max_position_embeddings`` is scored with a warning naming both where its positions
extend (rotary embeddings compute any position; how well the model reads them is what the evaluation measures), and
refused where they cannot: a learned table of absolute positions has no row for them.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_fpdt.errors import FPDTError

_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings", "pos_emb")  # learned absolute positions


def check_grid(lengths: Sequence[int] | None, depths: Sequence[float], where: str) -> None:
    """Refuse a depth outside ``[0, 1]`` and a length that is not a positive whole number of tokens (``lengths``
    ``None``: taken from the data later), naming the values.

    Raises:
        FPDTError: naming ``where``, the values and the fix.
    """
    outside = [d for d in depths if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0]
    if outside:
        raise FPDTError(f"{where}: depths {outside} are not fractions of the haystack in [0, 1] (0: the needle at its"
                        f" start, 1: at its end); give depths such as [0.0, 0.5, 1.0].")
    bad = [n for n in (lengths or []) if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad:
        raise FPDTError(f"{where}: lengths {bad} are not positive whole numbers of tokens.")


def position_limit(module: nn.Module) -> int | None:
    """The ``max_position_embeddings`` (``n_positions``) of ``module``'s config (a transformers model's, or an own
    model's), or ``None``."""
    for holder in (getattr(module, "model", None), module):
        config = getattr(holder, "config", None)
        fields = ["max_position_embeddings"]
        if getattr(config, "position_embedding", "learned") == "learned":  # the own GPT's table (rotary: no limit)
            fields.append("n_positions")
        for field in fields:
            value = getattr(config, field, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def check_positions(module: nn.Module, lengths: Sequence[int], where: str) -> None:
    """Warn (once, from rank 0) about lengths beyond ``module``'s ``max_position_embeddings``, naming both; refuse
    them where the model learns a table of absolute positions.

    Raises:
        FPDTError: a length beyond a learned position table's rows.
    """
    limit = position_limit(module)
    beyond = [n for n in lengths if limit is not None and n > limit]
    if not beyond:
        return
    table = next((name for name, m in module.named_modules()
                  if isinstance(m, nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES
                  and m.num_embeddings <= max(beyond)), None)
    if table is not None:
        raise FPDTError(f"{where}: lengths {beyond} exceed the model's {limit} positions, and its learned position"
                        f" table ({table}) has no row beyond them; evaluate at lengths up to {limit}.")
    rank_zero_warn(f"{where}: lengths {beyond} exceed the model's max_position_embeddings={limit}; they are scored"
                   " at positions the model was not made for (extend its RoPE to evaluate there on purpose).")


__all__ = ["check_grid", "check_positions", "position_limit"]

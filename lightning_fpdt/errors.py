"""Where the strategy's errors start: every message of ``FPDTStrategy`` and the modules it delegates to
(options, batches, planning, the non-finite guard) begins with :data:`PREFIX`, so a user sees which
component refused the run, and the CLI (``lightning_fpdt.cli``) can find the message behind a usage dump.

This module imports nothing of the package, so any module can raise in the strategy's name (and check a count with
:func:`is_positive_int`) without loading the others.
"""

from typing import Any

PREFIX = "FPDTStrategy: "


class FPDTError(ValueError):
    """A refusal of this package: a setting, a model, a batch or a file it cannot run as asked. The message is one
    line that names the component, the numbers and the fix; ``fpdt-train``, ``fpdt-eval`` and ``fpdt-export`` print
    it as their last line instead of a traceback. A ``ValueError``, so ``except ValueError`` still catches it."""


class Unsupported(NotImplementedError, FPDTError):
    """A model, layer or setting this package does not run as asked (a family's mechanism, a LoRA option, a release
    of transformers): the message names it, the real reason and what runs instead. Also a ``NotImplementedError``."""


class WrongType(TypeError, FPDTError):
    """A value of a type this package cannot use (a batch that is not a dict, a tokenizer without ``encode``): the
    message names what was given and what is expected. Also a ``TypeError``."""


_SAID_BY_EVERY_RANK = "_fpdt_said_by_every_rank"


def said_by_every_rank(error: BaseException) -> BaseException:
    """Mark ``error`` as one that every rank raises alike (a refusal of the configuration, the model or the data
    files made before the first batch): a console script prints it once, from global rank 0, and the other ranks
    exit with the same status without a word. Returns ``error``."""
    setattr(error, _SAID_BY_EVERY_RANK, True)
    return error


def is_said_by_every_rank(error: BaseException) -> bool:
    """Whether :func:`said_by_every_rank` marked ``error``."""
    return bool(getattr(error, _SAID_BY_EVERY_RANK, False))


def _message_line(error: BaseException) -> str:
    """The first non-empty line of ``error``'s message without a trailing colon; ``""`` for an error without one."""
    line = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return line.rstrip(":").rstrip()


def first_line(error: BaseException) -> str:
    """The first non-empty line of ``error``'s message, without a trailing colon (its class name where it has none):
    how a message of this package quotes another library's error and stays one line (torch's argument errors list
    every overload on lines of their own, after a line that ends in a colon)."""
    return _message_line(error) or type(error).__name__


def described(error: BaseException) -> str:
    """``"<class>: <first line>"``, or the class name alone for an error without a message."""
    line = _message_line(error)
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def one_line(error: BaseException) -> str:
    """``error``'s whole message on one line (each run of whitespace, line breaks included, one space), or its class
    name where it has none: how a message quotes an error whose detail is on its later lines (a YAML error's
    position, the Hugging Face Hub's link or hint), where :func:`first_line` would drop it."""
    return " ".join(str(error).split()) or type(error).__name__


def is_positive_int(value: Any) -> bool:
    """The one rule for a count a user gives (a size, a number of tiles): an ``int`` above 0, and not a ``bool``
    (``True`` is an ``int`` to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0

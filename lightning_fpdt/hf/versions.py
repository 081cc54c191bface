"""The transformers releases :class:`~lightning_fpdt.models.HFCausalLM` is tested with, and how a refusal names them.

The range is the one ``pyproject.toml``'s ``hf`` and ``dev`` extras declare (``tests/test_versions.py`` holds the
two equal) and CI's lock pins (``.ci/constraints.txt``); ``bash .ci/run --latest`` runs the suite against the
newest releases, which is how a new release is tried before the upper bound is raised (docs/hf-support.md).
"""

from __future__ import annotations

import sys

import transformers  # noqa: F401 (read through sys.modules, below)

TESTED_TRANSFORMERS = ">=5.24,<5.26"
"""The transformers releases the suite passes on (5.24.0 and 5.25.0 at the time of writing)."""


def installed_transformers() -> str:
    """The installed transformers release, as it reports itself (read from the module in ``sys.modules``:
    transformers replaces its module object while it imports)."""
    return sys.modules["transformers"].__version__


def untested_release_fix() -> str:
    """The fix a refusal caused by a transformers release names: a tested release, or one process."""
    return (f"Install a tested release (pip install 'transformers{TESTED_TRANSFORMERS}') or train with"
            " sequence_parallel_size=1 (exact: one process sees every position)")

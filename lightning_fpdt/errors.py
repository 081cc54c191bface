"""Where the strategy's errors start: every message of ``FPDTStrategy`` and the modules it delegates to
(options, batches, planning, the non-finite guard) begins with :data:`PREFIX`, so a user sees which
component refused the run, and the CLI (``lightning_fpdt.cli``) can find the message behind a usage dump.

This module imports nothing, so any module can raise in the strategy's name without loading the others.
"""

PREFIX = "FPDTStrategy: "

"""The rich console every command prints its tables on.

On a terminal a table fits the terminal's width. Written to a file or a pipe it keeps whole lines instead of
rich's 80-column default, so ``prfaas plan capacity > plan.txt`` holds every column and digit; ``--json`` stays
the way to read results from a program.
"""

from __future__ import annotations

import sys

from rich.console import Console

UNBOUNDED = 1_000  # columns: wider than any table prfaas prints, so none is cut or folded


def console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else UNBOUNDED)

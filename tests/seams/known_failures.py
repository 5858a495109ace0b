"""Cells that fail today, each for a known defect: strict xfails.

Not a test module. Every entry names the defect (issue 21's list, or "new:"
for one this matrix found) and the cells it breaks, as a shell pattern on
the cell id (`wrapper-mode-strategy-format`, `wrapper-strategy-refused`).
A cell marked here that passes fails the run (strict): the fix merged, and
its entry must go.
"""

import dataclasses
import fnmatch
from typing import Optional

import pytest

from tests.support import backends

ALL_BACKENDS = ("tensorflow", "jax", "torch")


class ReferenceMismatch(AssertionError):
    """Training differs from the float32 reference kmp claims it equals."""


@dataclasses.dataclass(frozen=True)
class Known:
    pattern: str
    reason: str
    backends: tuple = ALL_BACKENDS
    # Where set, the cell must fail with this exception (and only it).
    raises: Optional[type] = None


# None today: every cell of the matrix passes on every backend.
KNOWN = []


# The callback cells' ids: `callback-optimizer-mode-strategy`.
KNOWN_CALLBACKS = []


def marks(cell_id, known=None):
    """The xfail mark for `cell_id` on this backend, in a list (or [])."""
    entries = [
        entry
        for entry in (KNOWN if known is None else known)
        if backends.NAME in entry.backends
        and fnmatch.fnmatchcase(cell_id, entry.pattern)
    ]
    if not entries:
        return []
    raises = None
    if all(entry.raises is not None for entry in entries):
        raises = tuple(entry.raises for entry in entries)
    reason = "; ".join(entry.reason for entry in entries)
    return [pytest.mark.xfail(strict=True, reason=reason, raises=raises)]

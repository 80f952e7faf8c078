"""Errors that repeat: each cause logged once, then only counted.

A failure that recurs (a checkpoint directory gone, a clock stuck at NaN)
would otherwise log a warning, or a traceback, every time its job runs.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

# Causes remembered; past this many, no new cause is logged either (the log
# stays bounded whatever varies in the errors).
MAX_CAUSES = 64


@dataclass
class CauseLog:
    """The causes already logged."""

    _seen: set[Hashable] = field(default_factory=set, repr=False)

    def first(self, cause: Hashable) -> bool:
        """Whether ``cause`` is to be logged: new, and room left (it is remembered)."""
        if cause in self._seen or len(self._seen) >= MAX_CAUSES:
            return False
        self._seen.add(cause)
        return True

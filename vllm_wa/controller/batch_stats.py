"""Paired hit-rate comparisons over batches of sampled requests.

The tuner compares two miniature caches on the same sampled requests, and
the real-cache check compares LRU's miniature cache with the real cache on
the same sampled blocks; both are a ratio of summed per-batch hit
differences to the batches' lookups, with a batch-means standard error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Comparison:
    """Hit-rate lead of one candidate over another on the same sampled requests."""

    lead: float
    stderr: float
    batches: int
    requests: int
    lookups: int

    def lower(self, z: float) -> float:
        return self.lead - z * self.stderr


def batch_lead(lookups: Any, diffs: Any, requests: int) -> Comparison:
    """The ratio of the batches' summed hit differences to their lookups, with its batch-means error."""
    n = np.asarray(lookups, dtype=np.float64)
    if not len(n):
        return Comparison(0.0, math.inf, 0, 0, 0)
    d = np.asarray(diffs, dtype=np.float64)
    total = float(n.sum())
    k = len(n)
    if total <= 0:
        return Comparison(0.0, math.inf, k, requests, 0)
    lead = float(d.sum()) / total
    if k < 2:
        return Comparison(lead, math.inf, k, requests, int(total))
    resid = d - lead * n
    se = math.sqrt(k / (k - 1) * float(resid @ resid)) / total
    return Comparison(lead, se, k, requests, int(total))

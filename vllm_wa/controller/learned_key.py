"""A learned class assignment: feature cells merged into K delay classes.

A fixed key (``tag+outcome+think``) makes one class per combination of
bucketed features, chosen by hand.  A learned key starts from the same kind
of cells (every combination of its request features, bucketed) and lets the
data merge them: at each fit every cell with enough reuses is placed by its
censoring-correct (Kaplan-Meier) probability of coming back within
``split_s`` seconds, and cells that behave alike are clustered into K
classes.  Each class then gets its reuse model as any
class does, so the per-class free lists and their ordering invariant hold.
Cells with too few reuses share one fallback class.

The assignment is a table from cell name to class name, compiled here; the
engine thread only buckets a request's features and looks its cell up, once
per request (only request features are allowed: block features would make
it once per block).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_wa.controller.features import BLOCK_FEATURES, FeatureKey
from vllm_wa.controller.survival import SurvivalData, reuse_within

MAX_LEARNED_CLASSES = 16
FALLBACK = "l:u"  # cells without enough reuses of their own


def class_name(k: int) -> str:
    """Name of learned class ``k`` (0 = least likely to come back soon)."""
    return f"l:{k}"


@dataclass(frozen=True)
class LearnedKey:
    """Class key: a request's cell (``cells`` key name) mapped through ``table``."""

    cells: FeatureKey
    table: tuple[tuple[str, str], ...] = ()
    _lookup: Mapping[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cells.uses_block_features:
            raise ValueError(f"a learned key merges request features only, not {list(BLOCK_FEATURES)}")
        object.__setattr__(self, "_lookup", dict(self.table))

    uses_block_features = False

    @property
    def features(self) -> tuple[str, ...]:
        return self.cells.features

    def class_of(self, cell: str) -> str:
        return self._lookup.get(cell, FALLBACK)

    def __call__(self, request: Any, position: int, reuse_count: int) -> str:
        return self.class_of(self.cells(request, position, reuse_count))


def assign(cells: Mapping[str, SurvivalData], k: int, min_events: float, split_s: float) -> tuple[tuple[str, str], ...]:
    """Merge cells into up to ``k`` classes by their chance of a reuse within ``split_s``.

    Cells with fewer than ``min_events`` reuses are left out (they fall back).
    The others are clustered on the log-odds of that chance (weighted 1-D
    k-means, started from the reuse-weighted quantiles), so cells that behave
    alike share a class and a class boundary falls where the cells differ
    most; classes are numbered from the least likely to come back soon.
    Equal data gives an equal table (no randomness, ties broken by name).
    """
    ranked = sorted(
        ((reuse_within(d, split_s), name, d.n_events) for name, d in cells.items() if d.n_events >= min_events and d.n_events > 0),
        key=lambda x: (x[0], x[1]),
    )
    if not ranked:
        return ()
    p = np.clip(np.array([r[0] for r in ranked]), 1e-4, 1 - 1e-4)
    x = np.log(p / (1 - p))
    w = np.array([r[2] for r in ranked], dtype=np.float64)
    cum = (np.cumsum(w) - 0.5 * w) / w.sum()
    k = max(1, min(k, len(ranked)))
    centers = np.unique(np.interp((np.arange(k) + 0.5) / k, cum, x))
    labels = np.zeros(len(x), dtype=np.int64)
    for _ in range(50):
        labels = np.abs(x[:, None] - centers[None, :]).argmin(axis=1)
        new = np.array([np.average(x[labels == j], weights=w[labels == j]) for j in np.unique(labels)])
        if len(new) == len(centers) and np.allclose(new, centers):
            break
        centers = new
    labels = np.abs(x[:, None] - centers[None, :]).argmin(axis=1)
    rank = {c: i for i, c in enumerate(np.unique(labels))}
    return tuple(sorted((name, class_name(rank[int(lab)])) for (_, name, _), lab in zip(ranked, labels)))

"""Per-class reuse estimators, river-style: ``update`` / ``censor`` / ``get``.

Each class keeps binned, exponentially forgotten, censored observations
(:class:`SurvivalData`): a free block reused after ``gap`` seconds is
``update(gap)``; one we stopped watching after ``exposure`` seconds without
a reuse is ``censor(exposure)``.  A :class:`ReuseEstimator` is one such class
with its own drift detector (:class:`~.class_drift.LookupDrift`); a
controller keeps its finest classes' data as rows of a
:class:`SurvivalBank`, which forgets and pools them all at once, and detects
drift per class of each key instead (:mod:`.class_drift`).
:func:`pooled` sums classes for a coarser key.  :class:`ModelFit` fits a
pooled class's reuse model, warm-started, and only when its data moved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_wa.controller.class_drift import LookupDrift
from vllm_wa.controller.survival import (
    NUM_BINS,
    SurvivalData,
    exponential_em,
    hyperexponential_em,
)
from vllm_wa.params import ReuseModel

FAMILIES = ("exponential", "hyperexponential")


def _seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
    return float(value)


def forgetting_factor(elapsed_s: float, memory_s: float) -> float:
    """What ``elapsed_s`` seconds leave of observations kept for ``memory_s``."""
    elapsed_s = _seconds("elapsed_s", elapsed_s)
    return math.exp(-elapsed_s / memory_s) if elapsed_s > 0 else 1.0


@dataclass
class ReuseEstimator:
    """Censored reuse statistics of one class, with drift detection.

    Aging the statistics with time is the owner's (:func:`forgetting_factor`
    with ``memory_s``); each observation is recorded weighted by
    ``exp(-observed / memory_s)``, so that, once aged, it weighs by its
    block's free time and not by when it ended (the controller's
    ``_weight``).  A drift cuts the class's memory here.

    >>> est = ReuseEstimator()
    >>> for gap in (2.0, 3.0, 5.0, 4.0):
    ...     _ = est.update(gap)
    >>> est.censor(900.0)
    >>> model = est.get("exponential")
    >>> round(model.p, 2), 0.1 < model.a < 1.0
    (0.8, True)
    """

    drift_delta: float = 0.002
    drift_forget: float = 0.25
    memory_s: float = math.inf  # the owner's forgetting time constant (inf: no aging)
    data: SurvivalData = field(default_factory=SurvivalData)

    def __post_init__(self) -> None:
        self._drift = LookupDrift(self.drift_delta)

    @property
    def drifts(self) -> int:
        """Detections so far."""
        return self._drift.drifts

    def update(self, gap: float) -> bool:
        """A reuse after ``gap`` seconds.  Returns True when the drift detector
        fired (and the class's older observations were mostly forgotten)."""
        return self.update_many((gap,))

    def update_many(self, gaps: Sequence[float]) -> bool:
        """Reuses of several blocks found by one prompt lookup (the detector
        sees one value for them: :class:`~.class_drift.LookupDrift`)."""
        if not gaps:
            return False
        gaps = [_seconds("gap", g) for g in gaps]
        weights = [self._weight(g) for g in gaps]
        for g, w in zip(gaps, weights):
            self.data.add_event(g, w)
        self.data.groups += sum(weights) / len(weights)
        if self._drift.update(gaps):
            self.data.decay(self.drift_forget)
            return True
        return False

    def censor(self, exposure: float) -> None:
        """No reuse within ``exposure`` seconds, and no longer watched."""
        exposure = _seconds("exposure", exposure)
        self.data.add_censored(exposure, self._weight(exposure))

    def _weight(self, observed_s: float) -> float:
        return forgetting_factor(observed_s, self.memory_s)

    def get(self, family: str = "hyperexponential") -> ReuseModel | None:
        """The class's reuse model (None before any reuse was seen)."""
        return ModelFit(family).get(self.data)


class SurvivalBank:
    """The observations of many classes as rows of one matrix.

    A controller keeps one class per combination of feature buckets (hundreds
    to thousands); forgetting them and pooling them by a key's classes at
    every fit would cost a few numpy calls per class.  Each class's
    :class:`SurvivalData` is a view of its row, so its own updates stay as
    they were, and :meth:`decay` and :meth:`pool` are a few calls for all
    rows, with the same arithmetic, in the same order, as per class.
    """

    def __init__(self, capacity: int = 64) -> None:
        self._counts = np.zeros((max(1, capacity), 2, NUM_BINS))
        self.rows: list[SurvivalData] = []

    def __len__(self) -> int:
        return len(self.rows)

    def new_row(self) -> SurvivalData:
        """A new, empty class; its data is a view of the bank's next row."""
        i = len(self.rows)
        if i == len(self._counts):
            # Full: double, and point every class's views at its new row.
            grown = np.zeros((2 * i, 2, NUM_BINS))
            grown[:i] = self._counts
            self._counts = grown
            for j, d in enumerate(self.rows):
                d.events, d.censored = grown[j, 0], grown[j, 1]
        d = SurvivalData(self._counts[i, 0], self._counts[i, 1])
        self.rows.append(d)
        return d

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order), renumbered from 0; the others' data is gone.

        Each kept class's :class:`SurvivalData` stays the same object, a
        view of its new row.
        """
        kept = [self.rows[i] for i in rows]
        n = len(kept)
        self._counts[:n] = self._counts[rows]  # fancy indexing copies before the write
        self._counts[n:] = 0.0
        self.rows = kept
        for j, d in enumerate(kept):
            d.events, d.censored = self._counts[j, 0], self._counts[j, 1]

    def sum_rows(self, rows: np.ndarray) -> np.ndarray:
        """The (events, censored) counts of ``rows`` summed, shape ``(2, NUM_BINS)``."""
        return self._counts[rows].sum(axis=0) if len(rows) else np.zeros((2, NUM_BINS))

    def sum_groups(self, rows: np.ndarray) -> float:
        """The lookups of ``rows`` summed, one row after the other."""
        return float(sum(self.rows[f].groups for f in rows.tolist()))

    def decay(self, factor: float) -> None:
        """``SurvivalData.decay(factor)`` of every row."""
        self._counts[: len(self.rows)] *= factor
        for d in self.rows:
            d.groups *= factor

    def pool(
        self, labels: np.ndarray, num_classes: int, extra: tuple[np.ndarray, np.ndarray] | None = None
    ) -> list[SurvivalData]:
        """Row ``i`` pooled into class ``labels[i]``, as :func:`pooled` sums it.

        ``extra`` = ``(rows, censored)``: further censored counts of some rows
        (blocks still watched), added to their rows' classes after every
        row, in the given order.  ``np.add.at`` adds in index order, so each
        class's sums are those of adding its rows one by one.
        """
        n = len(self.rows)
        events = np.zeros((num_classes, NUM_BINS))
        censored = np.zeros((num_classes, NUM_BINS))
        groups = np.zeros(num_classes)
        np.add.at(events, labels, self._counts[:n, 0])
        np.add.at(censored, labels, self._counts[:n, 1])
        np.add.at(groups, labels, [d.groups for d in self.rows])
        if extra is not None and len(extra[0]):
            np.add.at(censored, labels[extra[0]], extra[1])
        return [SurvivalData(events[i], censored[i], float(groups[i])) for i in range(num_classes)]


def pooled(*data: SurvivalData) -> SurvivalData:
    """The observations of several classes as one class."""
    out = SurvivalData()
    for d in data:
        out += d
    return out


@dataclass
class ModelFit:
    """Fits one pooled class's model, warm-started from the previous fit.

    Forgetting scales every count alike, which leaves the maximum-likelihood
    fit unchanged, so a class is refitted only when the shape of its
    observations (the normalised bins) moved by more than ``tolerance`` in
    total variation since the last fit, or when the last fit stopped at its
    EM step cap: it then goes on from there at the next call (a fit stopped
    far from the answer was kept while the shape held still).
    """

    family: str = "hyperexponential"
    tolerance: float = 0.002
    model: ReuseModel | None = None
    _exponential: tuple[float, float] | None = None
    _hyper: np.ndarray | None = None
    _shape: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; expected one of {FAMILIES}")

    def get(self, data: SurvivalData) -> ReuseModel | None:
        size = data.n
        if size <= 0:
            return None
        shape = np.concatenate((data.events, data.censored)) / size
        if self._shape is not None and 0.5 * float(np.abs(shape - self._shape).sum()) <= self.tolerance:
            return self.model
        self.model, converged = self._fit(data)
        self._shape = shape if converged else None
        return self.model

    def _fit(self, data: SurvivalData) -> tuple[ReuseModel | None, bool]:
        if self.family == "exponential":
            p, a, converged = exponential_em(data, init=self._exponential)
            if p <= 0 or a <= 0 or not (math.isfinite(p) and math.isfinite(a)):
                return None, True
            self._exponential = (p, a)
            return ReuseModel.exponential(min(1.0, p), a), converged
        model, w, converged = hyperexponential_em(data, init=self._hyper)
        if w is not None:
            self._hyper = w
        return model, converged


def fit_model(data: SurvivalData, family: str) -> ReuseModel | None:
    """The reuse model of ``data`` under ``family``; None without any reuse seen."""
    return ModelFit(family).get(data)

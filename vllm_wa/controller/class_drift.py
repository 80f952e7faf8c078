"""Drift detection on reuse gaps: per lookup, and per class of one class key.

A river ``ADWIN`` detector watches a class's log reuse gaps; when it fires,
most of the class's older observations are forgotten, so a shift in traffic
is learned in minutes instead of the configured memory.

The controller keeps its observations per *finest* class (every feature
some candidate reads) and pools them by each candidate's key.  Detecting and
forgetting there made one candidate's fits depend on which others were
configured: more features split the rows finer, each row saw less, and its
detector fired less often (on the Mooncake trace at 20 % of unique blocks,
the growth-and-turn key run alone read 31.57 with two drifts; with the
default candidates configured beside it, 31.31 and none).  So each key has
its own detectors, one per class, and a detection forgets in that key's
view only (:class:`ClassDrift`): the finest rows are never cut.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from river import drift

from vllm_wa.controller.survival import NUM_BINS, SurvivalData

# A cut this small (in observations, all bins) changes no fit: it is dropped.
_NEGLIGIBLE = 1e-6


@dataclass
class LookupDrift:
    """An ADWIN detector fed one value per prompt lookup.

    Every block a lookup brings back is an observation, but the detector sees
    one value per lookup (the median log gap): a prompt brings back hundreds
    of blocks freed together, and fed one by one those identical gaps look
    like a change of distribution to ADWIN, which then keeps cutting the
    class's memory (measured: -12 % of the LRU-to-Belady gap instead of +14 %
    on the agentic split).
    """

    delta: float = 0.002
    # Detections so far: river 0.26's ``ADWIN.n_detections`` stays 0 after a
    # detection (checked), so they are counted here.
    drifts: int = 0

    def __post_init__(self) -> None:
        self._adwin = drift.ADWIN(delta=self.delta)

    def update(self, gaps: Sequence[float]) -> bool:
        """The gaps (s) of the blocks one lookup brought back; True when the detector fired."""
        # A clock that stepped back gives a negative gap: as the observations
        # bin it, a reuse at once; a value that is not a number is left out.
        logs = sorted(math.log1p(max(0.0, g)) for g in gaps if math.isfinite(g))
        if not logs:
            return False
        self._adwin.update(logs[len(logs) // 2])
        if self._adwin.drift_detected:
            self.drifts += 1
            return True
        return False


@dataclass
class ClassDrift:
    """The drift detectors of one class key's classes, and what they forgot.

    A detection in class ``c`` keeps ``forget`` of ``c``'s observations *as
    this key pools them*: the cut is held here, as counts to subtract from
    the pooled class (:meth:`view`), and ages as the observations do
    (:meth:`decay`), so the view after a cut is exactly ``forget`` times the
    view before it, and later observations count in full.  State is bounded
    by the key's classes (the controller's finest-class cap).
    """

    delta: float = 0.002
    forget: float = 0.25
    drifts: int = 0
    _detectors: dict[str, LookupDrift] = field(default_factory=dict)
    _cuts: dict[str, np.ndarray] = field(default_factory=dict)

    def update(self, name: str, gaps: Sequence[float]) -> bool:
        """One lookup's reuses in class ``name``; True when its detector fired
        (the caller then :meth:`cut`\\ s the class)."""
        det = self._detectors.get(name)
        if det is None:
            det = self._detectors[name] = LookupDrift(self.delta)
        if det.update(gaps):
            self.drifts += 1
            return True
        return False

    def cut(self, name: str, counts: np.ndarray) -> None:
        """Forget ``1 - forget`` of class ``name``'s view; ``counts`` is its
        pooled (events, censored) now, shape ``(2, NUM_BINS)``."""
        held = self._cuts.get(name)
        if held is None:
            held = np.zeros((2, NUM_BINS))
        self._cuts[name] = held + (1.0 - self.forget) * (counts - held)

    def decay(self, factor: float) -> None:
        """Age the cuts as the observations they were taken from age (a cut
        aged to nothing is dropped)."""
        for name, held in list(self._cuts.items()):
            held *= factor
            if held.sum() < _NEGLIGIBLE:
                del self._cuts[name]

    def view(self, name: str, data: SurvivalData) -> SurvivalData:
        """``data`` (class ``name`` pooled) less what its drifts forgot."""
        held = self._cuts.get(name)
        if held is None:
            return data
        return SurvivalData(
            np.maximum(data.events - held[0], 0.0), np.maximum(data.censored - held[1], 0.0), data.groups
        )

    def cut_classes(self) -> list[str]:
        return list(self._cuts)

    def cuts(self) -> dict[str, np.ndarray]:
        """What each cut class's drifts forgot, as (events, censored) counts (copies)."""
        return {name: held.copy() for name, held in self._cuts.items()}

    def restore(self, name: str, counts: np.ndarray) -> None:
        """Set class ``name``'s cut (a checkpoint's), at most its pooled ``counts`` now."""
        self._cuts[name] = np.asarray(counts, dtype=float).reshape(2, NUM_BINS).copy()

    def rescale(self, name: str, before: np.ndarray, after: np.ndarray) -> None:
        """Class ``name``'s pooled counts went from ``before`` to ``after``
        (finest classes retired): its cut shrinks in proportion, bin by bin."""
        held = self._cuts.get(name)
        if held is not None:
            ratio = np.divide(after, before, out=np.zeros_like(after), where=before > 0)
            self._cuts[name] = held * np.minimum(ratio, 1.0)

    def retain(self, names: Iterable[str]) -> None:
        """Drop the detectors and cuts of classes no longer in the key."""
        keep = set(names)
        for table in (self._detectors, self._cuts):
            for name in [n for n in table if n not in keep]:
                del table[name]

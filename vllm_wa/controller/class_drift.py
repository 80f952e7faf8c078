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
        # The clamp and the log are monotone, so the median log gap is the log
        # of the median gap: one log per lookup, not one per block (this runs
        # for every class key at every lookup that finds reuses).
        if not all(map(math.isfinite, gaps)):
            gaps = [g for g in gaps if math.isfinite(g)]
        if not gaps:
            return False
        mid = sorted(gaps)[len(gaps) // 2]
        self._adwin.update(math.log1p(max(0.0, mid)))
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
    view before it.  What a cut forgets is the blocks freed before it, not
    the observations recorded before it: a block freed before the cut whose
    reuse, or censoring, comes after it is forgotten as its peers were
    (:meth:`forget_late`, and the blocks still watched at a fit:
    :meth:`late_weights`).  Forgetting only what was recorded would keep the
    slow outcomes of those blocks and drop their quick ones, and lean every
    fit after a cut toward "never reused".  Blocks freed after the cut count
    in full.  State is bounded by the key's classes (the controller's
    finest-class cap) and, for the cut times, by the watch limit
    (:meth:`prune`).  A checkpoint keeps the cuts, not their times: after a
    restart the late outcomes of blocks freed before a cut count in full.
    """

    delta: float = 0.002
    forget: float = 0.25
    drifts: int = 0
    _detectors: dict[str, LookupDrift] = field(default_factory=dict)
    _cuts: dict[str, np.ndarray] = field(default_factory=dict)
    # Per class, the times of its cuts that blocks still watched may predate.
    _cut_times: dict[str, list[float]] = field(default_factory=dict)

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

    def cut(self, name: str, counts: np.ndarray, t: float) -> None:
        """Forget ``1 - forget`` of class ``name``'s view at time ``t``; ``counts``
        is its pooled (events, censored) now, shape ``(2, NUM_BINS)``."""
        held = self._cuts.get(name)
        if held is None:
            held = np.zeros((2, NUM_BINS))
        self._cuts[name] = held + (1.0 - self.forget) * (counts - held)
        self._cut_times.setdefault(name, []).append(t)

    def late(self) -> bool:
        """Whether some class has a cut that a block still watched may predate."""
        return bool(self._cut_times)

    def late_classes(self) -> list[str]:
        """The classes with such a cut."""
        return list(self._cut_times)

    def kept(self, name: str, freed_at: float) -> float:
        """What the cuts of class ``name`` keep of a block freed at ``freed_at``."""
        times = self._cut_times.get(name)
        if not times:
            return 1.0
        return self.forget ** sum(1 for c in times if c > freed_at)

    def forget_late(self, name: str, censored: bool, gap_bin: int, weight: float, freed_at: float) -> None:
        """An observation of class ``name`` (a reuse, or a censoring if
        ``censored``, in bin ``gap_bin``, of weight ``weight``) recorded after a
        cut its block predates: forget it as that cut forgot the block's peers."""
        kept = self.kept(name, freed_at)
        if kept < 1.0:
            held = self._cuts.get(name)
            if held is None:
                held = self._cuts[name] = np.zeros((2, NUM_BINS))
            held[int(censored), gap_bin] += (1.0 - kept) * weight

    def late_weights(self, name: str, freed_at: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """What the cuts of class ``name`` forget of blocks still watched
        (freed at ``freed_at``, of weights ``weights``), block by block."""
        times = self._cut_times.get(name)
        if not times:
            return np.zeros_like(weights)
        predates = (np.asarray(times)[None, :] > freed_at[:, None]).sum(axis=1)
        return (1.0 - self.forget ** predates) * weights

    def prune(self, before: float) -> None:
        """Drop cut times no watched block predates (none freed by ``before`` is still watched)."""
        for name, times in list(self._cut_times.items()):
            times[:] = [c for c in times if c > before]
            if not times:
                del self._cut_times[name]

    def decay(self, factor: float) -> None:
        """Age the cuts as the observations they were taken from age (a cut
        aged to nothing is dropped)."""
        for name, held in list(self._cuts.items()):
            held *= factor
            if held.sum() < _NEGLIGIBLE:
                del self._cuts[name]

    def view(self, name: str, data: SurvivalData, late_censored: np.ndarray | None = None) -> SurvivalData:
        """``data`` (class ``name`` pooled) less what its drifts forgot, and less
        ``late_censored`` (binned: what they forget of the blocks still watched)."""
        held = self._cuts.get(name)
        if held is None and late_censored is None:
            return data
        events, censored = data.events, data.censored
        if held is not None:
            events, censored = events - held[0], censored - held[1]
        if late_censored is not None:
            censored = censored - late_censored
        return SurvivalData(np.maximum(events, 0.0), np.maximum(censored, 0.0), data.groups)

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
        for table in (self._detectors, self._cuts, self._cut_times):
            for name in [n for n in table if n not in keep]:
                del table[name]

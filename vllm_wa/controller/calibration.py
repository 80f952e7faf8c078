"""The miniature caches' prediction for the running candidate, checked in the real cache.

The tuner chooses by the miniature caches alone. Whether their prediction
holds where it matters is measured here, on the same sampled blocks: for
each sampled request, its hit blocks in the running candidate's miniature
cache beside its hit blocks in the real cache (the engine reports them with
the lookup, ``LookupEvent.real_hits``), and in LRU's miniature cache.

The levels differ by sampling alone (a sampled block hits in a miniature
cache without its unsampled parents; blocks held by running requests take
room in the real cache only), so the number to watch is whether the gap
between prediction and the real cache moves when the running candidate
changes: a candidate whose real hit rate falls further below its
prediction than LRU's did is one the miniature caches misjudge
(docs/benchmarks.md, "Miniature-cache fidelity").

Only requests that fitted both caches are checked: one the miniature cache
could not fit is predicted no hit there, while the real lookup counted the
hits it found before the real cache refused it too; one the real cache
refused (it leaves holding no blocks) but a sampled miniature cache fitted
hits blocks there the real cache never held, and is taken back
(:meth:`Calibration.retract`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from vllm_wa.controller.batch_stats import Comparison, batch_lead


@dataclass
class CalibrationTotals:
    """Sampled blocks looked up, and how many hit: in the real cache, in the
    running candidate's miniature cache, in LRU's."""

    lookups: int = 0
    real: int = 0
    predicted: int = 0
    lru: int = 0
    requests: int = 0

    def add(self, lookups: int, real: int, predicted: int, lru: int, requests: int = 1) -> None:
        self.lookups += lookups
        self.real += real
        self.predicted += predicted
        self.lru += lru
        self.requests += requests

    def to_json(self) -> dict[str, Any]:
        n = self.lookups
        return {
            "requests": self.requests,
            "lookups": n,
            "real_hit_rate": self.real / n if n else None,
            "predicted_hit_rate": self.predicted / n if n else None,
            "lru_predicted_hit_rate": self.lru / n if n else None,
        }


@dataclass(frozen=True)
class CheckedRequest:
    """Where :meth:`Calibration.update` added one request, for :meth:`Calibration.retract`."""

    batch: CalibrationTotals
    total: CalibrationTotals
    row: tuple[int, int, int, int]  # lookups, real, predicted, lru


@dataclass
class Calibration:
    """River-style: :meth:`update` once per sampled request, :meth:`get` the summary.

    Keeps ``window_s`` of ``batch_s`` batches (a batch holds one running
    candidate), totals per candidate since the start, and the sums of the
    batches the window has dropped since the check began to count for the
    running candidate (:meth:`count_from`), so :meth:`overstatement` covers
    its whole run however long; all are bounded (the window by its batches,
    the totals by the candidate set).
    """

    window_s: float = 900.0
    batch_s: float = 30.0

    def __post_init__(self) -> None:
        self._batches: deque[tuple[float, str, CalibrationTotals]] = deque()
        self._max_batches = 8 * (int(self.window_s // self.batch_s) + 1)
        self.totals: dict[str, CalibrationTotals] = {}
        # (running candidate, when the check began to count for it, the sums
        # of its batches from then that the window has dropped); None: the
        # check does not count now.
        self._run: tuple[str, float, CalibrationTotals] | None = None

    def count_from(self, since: float, running: str) -> None:
        """The real-cache check counts for ``running`` from ``since`` (inf: not yet)."""
        self._run = None if since == math.inf else (running, since, CalibrationTotals())

    def update(self, t: float, running: str, lookups: int, real: int, predicted: int, lru: int) -> CheckedRequest:
        """One sampled request while ``running`` ran in the real cache; what :meth:`retract` takes back."""
        start = t - t % self.batch_s
        last = self._batches[-1] if self._batches else None
        if last is None or last[0] != start or last[1] != running:
            last = (start, running, CalibrationTotals())
            self._batches.append(last)
            # By time, and by count: one event dated far ahead would stay at
            # the head, and nothing behind it would leave (a batch a slot
            # with no switch; a switch a refit adds one more).
            while self._batches and (
                self._batches[0][0] < start - self.window_s or len(self._batches) > self._max_batches
            ):
                self._keep_in_run(*self._batches.popleft())
        row = (lookups, real, predicted, lru)
        last[2].add(*row)
        total = self.totals.setdefault(running, CalibrationTotals())
        total.add(*row)
        return CheckedRequest(last[2], total, row)

    def _keep_in_run(self, start: float, running: str, b: CalibrationTotals) -> None:
        """A batch leaves the window: its sums stay in the run's, if it is the run's."""
        run = self._run
        if run is not None and running == run[0] and start >= self._batch_start(run[1]):
            run[2].add(b.lookups, b.real, b.predicted, b.lru, b.requests)

    def _batch_start(self, t: float) -> float:
        return t - t % self.batch_s if math.isfinite(t) else t

    @staticmethod
    def retract(checked: CheckedRequest) -> None:
        """Take back a request found later not to have fitted the real cache.

        A check whose batch has left the window by then (a request that ran
        longer than ``window_s``) stays in the run's sums (:meth:`overstatement`).
        """
        lookups, real, predicted, lru = checked.row
        for totals in (checked.batch, checked.total):
            totals.add(-lookups, -real, -predicted, -lru, requests=-1)

    def window(self, now: float) -> dict[str, CalibrationTotals]:
        """Each candidate that ran in the last ``window_s``: its sums over that time."""
        out: dict[str, CalibrationTotals] = {}
        for start, running, b in self._batches:
            if start >= now - self.window_s:
                out.setdefault(running, CalibrationTotals()).add(b.lookups, b.real, b.predicted, b.lru, b.requests)
        return out

    def _since(self, since: float, running: str) -> list[CalibrationTotals]:
        # The batch holding ``since`` counts, as in the tuner's comparisons; a
        # batch holds one running candidate, so a switch inside it splits it.
        # A batch whose every check was taken back (retract) holds nothing and
        # is no batch: counted, it would pass the three-batch minimum early.
        first = self._batch_start(since)
        return [b for start, name, b in self._batches if start >= first and name == running and b.requests > 0]

    def lead_over_real(self, since: float, running: str) -> Comparison:
        """LRU's miniature cache's hit-rate lead over the real cache while
        ``running`` ran, from ``since``: what a switch to it cost, as far as LRU's
        miniature cache predicts LRU (running LRU, the two agree to 0.02 points
        on the development traces)."""
        rows = self._since(since, running)
        return batch_lead([b.lookups for b in rows], [b.lru - b.real for b in rows], sum(b.requests for b in rows))

    def overstatement(self, running: str) -> float:
        """How far ``running``'s miniature cache over-predicted the real cache
        since the check began to count for it (:meth:`count_from`), over the
        whole run, not only the window (0 when the check does not count)."""
        run = self._run
        if run is None or run[0] != running:
            return 0.0
        rows = [run[2], *self._since(run[1], running)]
        n = sum(b.lookups for b in rows)
        return sum(b.predicted - b.real for b in rows) / n if n else 0.0

    def get(self, now: float) -> dict[str, Any]:
        return {
            "window_s": self.window_s,
            "window": {name: t.to_json() for name, t in self.window(now).items()},
            "total": {name: t.to_json() for name, t in self.totals.items()},
        }

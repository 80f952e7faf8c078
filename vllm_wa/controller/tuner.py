"""Which candidate the real cache runs: LRU until another is measured better.

Every sampled request is looked up in every candidate's miniature cache, so
the candidates are compared *paired*, over the same requests.  A request's
hit blocks in each cache are summed into batches of ``batch_s`` seconds
(requests within a batch are correlated: they share prompts and cache
state), and the lead of one candidate over another is a ratio of batch sums
with a batch-means standard error.

* **Promotion** needs evidence: at least ``min_requests`` sampled requests
  over ``min_batches`` batches of the promotion window, and a lower
  confidence bound of the lead over the running candidate above ``margin``.
  The test is repeated at every refit, which would inflate false promotions
  at a fixed z, so the bound uses the normal-mixture boundary of a
  confidence sequence (Robbins 1970; Howard et al. 2021, eq. 14), valid
  whenever it is looked at.  Once the promotion window is full it slides,
  and a look shares all but one batch with the look before: the mixture
  boundary, made for a sample that grows from a fixed start, then sets a
  fixed bar of its own (3.06 standard errors at 30 batches).  For a move
  between LRU and a candidate the full window's bar is instead the one-sided
  ``full_window_confidence`` quantile (2.33 at 0.99; the mixture boundary
  where it is lower): stricter than the nominal 95 % for the looks that
  overlap.  That bar rests on the batch means being near normal, so it
  needs ``full_window_min_requests`` sampled requests in the window (900:
  30 a batch); with fewer, the mixture boundary stays.  On the no-signal
  trace's seed 1 (``replay.no_signal``: 15 requests a batch) the one-sided
  bar promoted a candidate on noise at 5,257 s and kept it for 30 % of the
  trace; every full-window promotion on the three development traces had
  1,834 requests or more.  That move also clears ``full_window_margin``
  (0.1 points) instead of ``margin`` (0.3): on the Mooncake trace at 2 %
  the lookup-stamped six-feature candidate led by 0.54 points with a bound
  of 0.11 over 2,857 requests at 1,305 s, and ``margin`` kept the cache on
  LRU to the end (5.44 against LFU's 5.79; 6.15 with the smaller margin,
  promoted at that look).  The margin is the extra a young or thin window
  pays; a full window of enough requests carries its risk in the bound,
  with the class test (``class_confidence``) keeping noise candidates at
  LRU's order: with that test off, nine candidates compared at every refit
  against this per-look bar promoted on noise on four seeds of six of a
  dense memoryless trace, all four past the guard-rail's time bound and two
  past its hit-rate bound (docs/results.md, "No signal"; with ``margin`` three, one
  past both).  On the Mooncake trace at 15 % of unique blocks the
  reuse-count candidate led LRU's miniature cache by 1.0 to 1.5 points
  (standard error 0.3 to 0.5) from t = 2,300 s, and the mixture bar kept
  the real cache on LRU to the end.  A young window (the held-out failure)
  still faces the mixture boundary, and when it leaves LRU that boundary's
  error is split among the candidates (Bonferroni: 0.05 / 10 for the ten
  defaults), since the move picks the best of them: on the no-signal
  trace's seed 9 the reuse-and-growth candidate, which reads the turn count
  there through the prompt's growth, cleared the per-candidate bar on a
  2.1-point lead over 502 requests at 3,790 s and ran for 48 % of the
  trace (+0.11 points); with the split bar it stays on LRU, and the real
  replays of the three development traces read the same (docs/results.md, "Mooncake:
  reuse and growth").  A move between two non-LRU candidates keeps the
  per-candidate bar: split there too (as on 2026-12-04), it held back the
  agentic split's move at 15 % on another arrangement (``--seed 2``) by
  160 s, -0.50 points on the recorded path, and guards nothing: the move
  never leaves a candidate for LRU's order.  Switches between two non-LRU
  candidates keep the mixture boundary throughout: with the full-window
  bar for them too, the agentic split at 8 % switched six times instead of
  twice and lost 0.17 points (miniature-cache replay).
* **The short look.** A lead that begins late in a full window is diluted
  by the batches before it.  So once the promotion window is full, a move
  between LRU and a candidate may also rest on the last ``short_window_s``
  seconds alone: a full window of its own (as many batches), at least as
  dense in requests as the full window's minimum asks, at the stricter
  one-sided ``short_window_confidence`` quantile (3.09 at 0.999) and the
  full window's margin.  The two looks together raise the chance of a false
  move at a look from 0.010 to at most 0.011.  On the Mooncake trace at
  20 % of unique blocks the reuse-count candidate's lead began near
  1,500 s; the full window alone promoted it at 2,430 s, the short look at
  1,410 s.  A young window never takes the short look.
* **Demotion** is quick and one-way safe: when the one-sided lower bound of
  LRU's lead over the running candidate, over the short demotion window,
  clears ``margin`` (the bar a promotion clears the other way), the real
  cache goes back to LRU at that refit.  A bound merely above zero, tested
  at every refit, demoted the agentic split's running candidate at 15 % on
  a 0.74-point lead with a bound of 0.10 (t = 6,632 s) and cost 0.09 points
  against staying; a loss as large as the held-out failure's (1.9 points
  over 99k sampled lookups) clears the margin at once.  The bound is
  Student's t on the window's batch means (k >= 3 batches, k - 1 degrees
  of freedom): just after a promotion the window holds two or three
  batches, and a normal quantile on a standard error from so few batches
  demoted good candidates on noise (measured on the Mooncake trace at
  15 %: a 1.2-point lead demoted 36 s after its promotion, two batches
  in).  A demoted candidate's earlier lead no longer counts.
* **Reinstatement** undoes a demotion as quickly as it was made: for a
  promotion window (``window_s``) after it, and until another switch, the
  candidate the miniature caches demoted goes back in when it leads LRU's
  miniature cache over the demotion window since its demotion, at the
  demotion's own bar (Student's t at ``demote_confidence`` above
  ``margin``, three batches or more).  A demotion is a test repeated at
  every refit over a short window, so a candidate that leads for hours is
  demoted now and then by a short dip:
  on the held-out agentic conversations (``--seed 1``, 8 %) the
  lookup-stamped think-time key led LRU in every 10-minute window after
  its demotion at 5,499 s, and the promotion bar, which starts its
  evidence again from the demotion, kept the cache on LRU for the last
  1,700 s.  A real-cache demotion is undone this way only when the
  candidate's miniature cache did not overstate it while it ran (predicted
  no more than the real cache read, from when the check counted): then the
  real cache lost a stretch to LRU, as a demotion finds, and the miniature
  caches were right.  One they overstated is never undone this way: there
  the miniature caches are what was wrong.  (On the held-out conversations,
  seed 0 at 5 %, with the reuse-and-growth key stamped at lookup in the set,
  the check demoted that key at 4,924 s on a 300-s stretch although over
  its 3,675 s the real cache had read 17.10 % of the sampled blocks against
  a prediction of 17.06; it stayed on LRU to the end.)  The bar is a per-look one, so the
  way back closes after a promotion window: left open, on the dense
  no-signal trace with the class test off (seed 0) it brought a noise
  candidate back twice, 1,124 and 2,663 s after its demotions (44 % of the
  trace off LRU instead of 9 %, -0.13 points); the three reinstatements on
  the development and held-out traces came 209 to 826 s after theirs.
* **The real-cache check** (``real_check``) tests the miniature caches'
  prediction where it matters.  The engine reports which of a lookup's
  sampled blocks the real cache had (``LookupEvent.real_hits``), and while a
  candidate runs, the same demotion test compares LRU's miniature cache
  with the real cache itself, on the same blocks (reason ``real-check``).
  Running LRU, the real cache and LRU's miniature cache agree to 0.02
  points on the development traces, so LRU's miniature cache stands in for
  the LRU the switch left.  A candidate its miniature cache overstates
  fails it: on Mooncake ``--cut 1800`` at 20 % the lookup-stamped
  think-time key read 0.27 points over LRU in the miniature caches and
  0.93 under it in the real cache, and the check demoted it at 426 s (LRU's
  21.57 instead of 20.61).  The cause was in the live queue (score ties
  broken by rounding, not by stamp; fixed in ``free_queue``: the key now
  reads 21.66 there, as predicted), which is what the check is for: the
  miniature caches cannot see a fault of the real one.  What its miniature
  cache overstated it by while it ran (prediction minus the real cache,
  :mod:`.calibration`) is then added to its bar for a promotion or a
  replacement, so the same lead does not bring it back.  The check counts
  from when the real cache has turned over after the switch
  (``real_check_turnover``; :meth:`Tuner.evicted`): until then it still holds
  what the previous candidate kept.
* **Replacement** moves between two candidates as quickly, when the
  evidence is as strong: if another candidate beats the running one over
  the demotion window, with the one-sided Student's t bound at
  ``replace_confidence`` (0.95, Bonferroni-corrected over the other
  candidates) above ``margin``, the tuner moves to it at that refit.  A
  promotion from a full window can rest on a lead that the trace takes
  back soon after: on the agentic split at 15 % the lookup-stamped
  think-time candidate led LRU's miniature cache by 6 to 10 points from
  2,400 to 3,600 s, and from 3,900 s it trailed most of the others by 1.5
  to 2.5 points.  It never moves away from LRU: that takes a promotion.  A
  replaced candidate's earlier lead no longer counts, as with a demoted one.
* **The gate.** Candidates that are equally good differ by noise, and a
  bound at 0.95 tested at every refit moved between two of them (agentic
  split at 8 %: five switches instead of three, -0.14 points on the
  recorded miniature-cache path, ``benchmarks/tuner_paths.py``); at 0.99
  it waited at 15 % until the mixture boundary moved it, at 4,786 s.  So a
  replacement also needs the running candidate to trail the field: the median hit rate
  of the other non-LRU candidates (per batch) must lead it over the same
  window, at the one-sided Student's t bound ``replace_gate_confidence``
  (0.95).  A candidate among the best passes that test only by a large
  chance; one whose lead has ended trails most of the others.  The median,
  not the mean: one candidate far behind (a key that suits other traffic:
  the Mooncake reuse-and-growth key on the agentic split) pulled the mean
  down and held the gate shut at 15 % (77.63 on the recorded path against
  77.96 with the median; real replay 77.90).  With the median, a candidate
  that trails the field by a little is replaced later: two points behind
  the median (four behind the mean) took up to 420 s instead of 300 s in
  the test below.  The mean gate, with the earlier candidate set, measured
  in real replays of the agentic split: 15 % moved at 4,056 s and read
  77.88 (77.59 without the gate), 11 % 55.90 (55.63).
* **A lasting lead** also opens the gate: a challenger that leads the
  running candidate over a full promotion window at the full window's bar
  (``full_window_confidence``, ``full_window_margin``, as many requests as
  that bar asks) may replace it, whatever the field does.  Where few keys
  suit the traffic the median is one of the others, and it can never lead
  the second best: on a Mooncake-format trace of shared templates (no
  tags, no outcomes: five of the ten defaults rank as LRU does) at 5 %
  the running reuse-and-growth key trailed the reuse-count key by about a
  point from 3,600 s, and the gate held it until a promotion moved it at
  5,670 s; with the lasting lead the replacement came at 3,925 s (+0.45
  points on the recorded path, docs/results.md, "Mooncake-format stress
  traces").  Equals rarely lead each other over a full window at that bar:
  of 34 recordings of the development traces and the held-out
  arrangements, 30 take the same path; four replace sooner (held-out
  seed 0 at 8 % and 11 %, seed 2 at 5 %, seed 3 at 11 %), and their
  recorded paths read the same or higher (+0.09, 0, +0.30, 0 points).

Every switch is logged with the evidence behind it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.stats import norm
from scipy.stats import t as student_t

from vllm_wa.controller.batch_stats import Comparison, batch_lead
from vllm_wa.controller.calibration import Calibration, CheckedRequest

LRU = "lru"


@dataclass(frozen=True)
class TunerSettings:
    """The tuner's knobs (``[tuner]`` in the controller config)."""

    margin: float = 0.003
    window_s: float = 900.0
    demote_window_s: float = 300.0
    batch_s: float = 30.0
    min_requests: int = 200
    min_batches: int = 6
    confidence: float = 0.95
    full_window_confidence: float = 0.99
    full_window_min_requests: int = 900
    full_window_margin: float = 0.001
    short_window_s: float = 450.0
    short_window_confidence: float = 0.999
    demote_confidence: float = 0.95
    replace_confidence: float = 0.95  # 0: no replacement
    replace_gate_confidence: float = 0.95  # 0: no gate
    real_check: bool = True  # demote when LRU's miniature cache leads the real cache too
    # ... counting from when the real cache has evicted this many times the
    # sampled blocks it holds since the switch (0: from the switch).
    real_check_turnover: float = 1.0


@dataclass(frozen=True)
class Switch:
    """One change of the running candidate, with its evidence."""

    time: float
    from_candidate: str
    to_candidate: str
    reason: str  # "promote", "demote", "real-check" (a demotion on the real cache's hits) or "replace"
    lead: float
    lower_bound: float
    batches: int
    requests: int

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["from"] = d.pop("from_candidate")
        d["to"] = d.pop("to_candidate")
        for k in ("lead", "lower_bound"):
            d[k] = round(d[k], 6)
        return d


def sequential_z(batches: int, confidence: float, rho: float) -> float:
    """Multiplier of the standard error that a mean of ``batches`` batches must
    clear for a one-sided bound that holds at every look (normal mixture)."""
    alpha = 1.0 - confidence
    b = max(1, batches)
    return math.sqrt(2.0 * (b + rho) / b * math.log(math.sqrt((b + rho) / rho) / alpha))


class PairedHits:
    """Per-batch sums, over the same sampled requests, of every candidate's hits."""

    def __init__(self, names: list[str], batch_s: float, keep_s: float) -> None:
        self.names = list(names)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.batch_s = float(batch_s)
        self.keep = max(1, int(math.ceil(keep_s / batch_s)) + 1)
        # (batch number, requests, lookups, hits per candidate)
        self._batches: deque[tuple[int, int, int, np.ndarray]] = deque()
        self._cur = -1
        self._requests = 0
        self._lookups = 0
        self._hits = np.zeros(len(self.names), dtype=np.int64)

    def add(self, t: float, lookups: int, hits: list[int]) -> None:
        """One sampled request: ``lookups`` sampled blocks, ``hits[i]`` hit in cache ``i``."""
        b = int(t // self.batch_s)
        if b != self._cur:
            self._close()
            self._cur = b
        self._requests += 1
        self._lookups += lookups
        self._hits += hits

    def _close(self) -> None:
        if self._requests:
            self._batches.append((self._cur, self._requests, self._lookups, self._hits))
            while len(self._batches) > self.keep:
                self._batches.popleft()
        self._requests = self._lookups = 0
        self._hits = np.zeros(len(self.names), dtype=np.int64)

    def _since(self, t: float) -> list[tuple[int, int, int, np.ndarray]]:
        first = int(t // self.batch_s)
        rows = [x for x in self._batches if x[0] >= first]
        if self._requests and self._cur >= first:
            rows.append((self._cur, self._requests, self._lookups, self._hits))
        return rows

    def compare(self, a: str, b: str, since: float) -> Comparison:
        """Lead of ``a`` over ``b`` in hit rate over the batches from ``since``."""
        rows = self._since(since)
        ia, ib = self.index[a], self.index[b]
        return self._lead(rows, [float(r[3][ia] - r[3][ib]) for r in rows])

    def compare_median(self, group: list[str], b: str, since: float) -> Comparison:
        """Lead of ``group``'s median over ``b``, over the batches from ``since``.

        The median is taken per batch (the candidates share a batch's
        lookups, so each batch's median hits are its median hit rate), and
        the lead is the lookup-weighted mean of those per-batch medians less
        ``b``'s rate: a lead means ``b`` trails most of the group, whatever
        its worst members do (with three or more members; with two the
        median is their mean).  It is not the median of the candidates'
        window rates: a per-batch median of noisy values leans toward the
        side of the outliers.
        """
        rows = self._since(since)
        if not rows:
            return self._lead(rows, [])
        ig, ib = [self.index[a] for a in group], self.index[b]
        hits = np.stack([r[3] for r in rows])
        return self._lead(rows, np.median(hits[:, ig], axis=1) - hits[:, ib])

    @staticmethod
    def _lead(rows: list[tuple[int, int, int, np.ndarray]], diffs: Any) -> Comparison:
        return batch_lead([r[2] for r in rows], diffs, sum(r[1] for r in rows))

    def rates(self, since: float) -> dict[str, tuple[float, int]]:
        """Each candidate's hit rate and sampled lookups over the batches from ``since``."""
        rows = self._since(since)
        total = sum(r[2] for r in rows)
        hits = sum((r[3] for r in rows), np.zeros(len(self.names), dtype=np.int64))
        return {n: (float(hits[i]) / total if total else 0.0, int(total)) for i, n in enumerate(self.names)}


@dataclass
class Tuner:
    """Chooses the running candidate; starts (and restarts) on LRU."""

    names: list[str]
    settings: TunerSettings = field(default_factory=TunerSettings)
    initial: str = LRU
    # Sampled blocks the real cache holds (its size times the sample rate):
    # the real-cache check's turnover is counted in them (0: unknown, the
    # check counts from the switch).
    sampled_cache_blocks: float = 0.0

    def __post_init__(self) -> None:
        if LRU not in self.names:
            raise ValueError("LRU must be a candidate")
        s = self.settings
        self.hits = PairedHits(self.names, s.batch_s, max(s.window_s, s.demote_window_s))
        self.calibration = Calibration(max(s.window_s, s.demote_window_s), s.batch_s)
        # Candidates a real-cache check demoted: by how much their miniature
        # cache overstated them while they ran, from when the check counted
        # (added to their promotion and replacement margins).
        self.overstated: dict[str, float] = {}
        self.active = self.initial
        self.active_since = -math.inf
        # When the real-cache check starts to count for the running candidate
        # (inf: not yet; see evicted), and the sampled evictions since the switch.
        self._count_real_check_from(-math.inf)
        self._evicted_since_switch = 0
        self._turnover_blocks = s.real_check_turnover * self.sampled_cache_blocks
        self.evidence_since = {n: -math.inf for n in self.names}
        self.switches: deque[Switch] = deque(maxlen=50)
        self.promotions = 0
        self.demotions = 0  # every move back to LRU, the real-check's included
        self.real_check_demotions = 0
        self.replacements = 0
        # The candidate the miniature caches last demoted, until another
        # switch: it may be reinstated (see the module doc).
        self.reinstatable: str | None = None
        self.seconds_on = {n: 0.0 for n in self.names}
        self._last = None
        self._t_quantiles: dict[tuple[float, int], float] = {}
        # Leaving LRU picks the best of the other candidates: the mixture
        # boundary's error is shared among them (Bonferroni; see the module doc).
        self._leave_lru_confidence = 1.0 - (1.0 - s.confidence) / max(1, len(self.names) - 1)
        # Batches a full promotion window holds, and its bar (see the module doc).
        self._full_batches = max(s.min_batches, int(s.window_s // s.batch_s))
        self._z_full = float(norm.ppf(s.full_window_confidence))
        # The short look: a full window of its own, as dense, at a stricter bar.
        short = 0.0 < s.short_window_s < s.window_s
        self._short_batches = max(s.min_batches, int(s.short_window_s // s.batch_s)) if short else 0
        self._short_min_requests = math.ceil(s.full_window_min_requests * s.short_window_s / s.window_s)
        self._z_short = float(norm.ppf(s.short_window_confidence))

    def record(self, t: float, lookups: int, hits: list[int], real: int | None = None) -> CheckedRequest | None:
        """One sampled request: its sampled blocks, each candidate's hit blocks
        and, when known, the real cache's (checked against the running
        candidate's prediction: :mod:`.calibration`; the check is returned,
        for :meth:`retract_real`)."""
        self.hits.add(t, lookups, hits)
        if real is None:
            return None
        index = self.hits.index
        return self.calibration.update(t, self.active, lookups, real, int(hits[index[self.active]]), int(hits[index[LRU]]))

    def retract_real(self, checked: CheckedRequest) -> None:
        """Take back a request's real-cache check: the real cache did not fit it."""
        self.calibration.retract(checked)

    def evicted(self, t: float, blocks: int) -> None:
        """The real cache evicted ``blocks`` sampled blocks, the last at ``t``.

        After a switch the real cache still holds what the previous
        candidate kept, and trails the new candidate's miniature cache (which
        ran it all along) until it has turned its content over: on Mooncake
        at 15 % of unique blocks the reuse-and-growth key's real cache read 6
        points under its prediction 100 s after its promotion and matched it
        from 220 s on (one turnover), but the check, counting from the
        switch, had demoted it at 184 s.  The check counts from then on.
        """
        if self.real_check_since != math.inf:
            return
        self._evicted_since_switch += blocks
        if self._evicted_since_switch >= self._turnover_blocks:
            self._count_real_check_from(t)

    def restart_real_check(self, now: float) -> None:
        """What the real cache runs changed at ``now``: the check waits for a turnover again."""
        self._evicted_since_switch = 0
        self._count_real_check_from(now if self._turnover_blocks <= 0 else math.inf)

    def _count_real_check_from(self, since: float) -> None:
        """The real-cache check counts for the running candidate from ``since`` (inf: not yet)."""
        self.real_check_since = since
        self.calibration.count_from(since, self.active)

    def _promotion(self, now: float) -> tuple[str, Comparison, float] | None:
        s = self.settings
        best: tuple[str, Comparison, float] | None = None
        for name in self.names:
            if name == self.active:
                continue
            since = max(now - s.window_s, self.evidence_since[name])
            cmp = self.hits.compare(name, self.active, since)
            if cmp.requests < s.min_requests or cmp.batches < s.min_batches:
                continue
            conf = self._leave_lru_confidence if self.active == LRU else s.confidence
            z = sequential_z(cmp.batches, conf, s.min_batches)
            margin = self._margin(name, s.margin)
            full_lru_move = cmp.batches >= self._full_batches and LRU in (name, self.active)
            if full_lru_move and cmp.requests >= s.full_window_min_requests:
                z = min(z, self._z_full)
                margin = self._margin(name, s.full_window_margin)
            lb = cmp.lower(z)
            if lb > margin and (best is None or lb > best[2]):
                best = (name, cmp, lb)
            if full_lru_move and self._short_batches:
                short = self._short_look(name, now)
                if short is not None and (best is None or short[1] > best[2]):
                    best = (name, *short)
        return best

    def _margin(self, name: str, base: float) -> float:
        """The margin a move to ``name`` clears: ``base``, plus what the
        real-cache check found its miniature cache to overstate."""
        return base + self.overstated.get(name, 0.0)

    def _short_look(self, name: str, now: float) -> tuple[Comparison, float] | None:
        """The lead of ``name`` over the running candidate in the short window, if it clears its bar."""
        s = self.settings
        cmp = self.hits.compare(name, self.active, max(now - s.short_window_s, self.evidence_since[name]))
        if cmp.batches < self._short_batches or cmp.requests < self._short_min_requests:
            return None
        lb = cmp.lower(self._z_short)
        return (cmp, lb) if lb > self._margin(name, s.full_window_margin) else None

    def _demotion(self, now: float) -> tuple[str, Comparison, float] | None:
        """LRU's miniature cache leads the running candidate's (``demote``), or
        leads the real cache, on the same sampled blocks (``real-check``)."""
        s = self.settings
        if self.active == LRU:
            return None
        checks = [("demote", self.hits.compare(LRU, self.active, self._running_window(now)))]
        if s.real_check and self.real_check_since <= now:
            real_since = max(now - s.demote_window_s, self.real_check_since)
            checks.append(("real-check", self.calibration.lead_over_real(real_since, self.active)))
        for reason, cmp in checks:
            if cmp.batches < 3:  # two batches (one degree of freedom) can agree by chance
                continue
            lb = cmp.lower(self._demote_quantile(cmp.batches))
            if lb > s.margin:
                return reason, cmp, lb
        return None

    def _running_window(self, now: float) -> float:
        """Where the running candidate's demotion window starts: the last
        ``demote_window_s`` seconds, none of it before the candidate ran."""
        return max(now - self.settings.demote_window_s, self.active_since)

    def _t_quantile(self, confidence: float, batches: int) -> float:
        """One-sided Student's t quantile for a mean of ``batches`` batch means
        (cached: the bars are looked up at every refit)."""
        q = self._t_quantiles.get((confidence, batches))
        if q is None:
            q = self._t_quantiles[confidence, batches] = float(student_t.ppf(confidence, batches - 1))
        return q

    def _demote_quantile(self, batches: int) -> float:
        return self._t_quantile(self.settings.demote_confidence, batches)

    def account(self, now: float) -> None:
        """Count the time since the last call on the running candidate."""
        if self._last is not None and now > self._last:
            self.seconds_on[self.active] += now - self._last
        # A clock that steps back does not count the replayed stretch twice.
        self._last = now if self._last is None else max(self._last, now)

    def decide(self, now: float) -> Switch | None:
        """Called at each refit: switch when the evidence says so."""
        self.account(now)
        demote = self._demotion(now)
        if demote is not None:
            reason, cmp, lb = demote
            reinstatable = reason == "demote"
            if reason == "real-check":
                self.real_check_demotions += 1
                # Its miniature cache overstates it: later leads are discounted by as much.
                overstated = self.calibration.overstatement(self.active)
                self.overstated[self.active] = max(0.0, overstated)
                # One that did not overstate it lost a stretch to LRU, as a
                # demotion finds: it may come back as a demoted one does.
                reinstatable = overstated <= 0.0
            demoted = self.active
            sw = self._demote(now, reason, cmp, lb)
            if reinstatable:
                self.reinstatable = demoted
            return sw
        promote = self._reinstatement(now) or self._promotion(now)
        if promote is not None:
            name, cmp, lb = promote
            if name == LRU:
                # LRU's full-window lead: back to the guard-rail, as a demotion.
                return self._demote(now, "demote", cmp, lb)
            self.promotions += 1
            return self._switch(now, name, "promote", cmp, lb)
        replace = self._replacement(now)
        if replace is not None:
            name, cmp, lb = replace
            self.evidence_since[self.active] = now
            self.replacements += 1
            return self._switch(now, name, "replace", cmp, lb)
        return None

    def _reinstatement(self, now: float) -> tuple[str, Comparison, float] | None:
        """The demoted candidate, if it leads LRU since its demotion at the demotion's bar."""
        name = self.reinstatable
        if name is None or self.active != LRU:
            return None
        s = self.settings
        if now - self.evidence_since[name] > s.window_s:
            # A promotion window since the demotion: its bar is the promotion's now.
            self.reinstatable = None
            return None
        cmp = self.hits.compare(name, LRU, max(now - s.demote_window_s, self.evidence_since[name]))
        if cmp.batches < 3:
            return None
        lb = cmp.lower(self._demote_quantile(cmp.batches))
        return (name, cmp, lb) if lb > self._margin(name, s.margin) else None

    def _demote(self, now: float, reason: str, cmp: Comparison, lb: float) -> Switch:
        """Back to LRU; the demoted candidate's evidence starts again from now."""
        self.evidence_since[self.active] = now
        self.demotions += 1
        return self._switch(now, LRU, reason, cmp, lb)

    def _replacement(self, now: float) -> tuple[str, Comparison, float] | None:
        """The candidate that beats the running (non-LRU) one over the demotion window, if any does.

        The bar is a test (does it beat the running one?); among those that
        pass, the largest measured lead is the best estimate of the gain. The
        largest lower bound instead favours the candidate whose batches vary
        least with the running one's: on the agentic split at 15 % it chose,
        of two with bounds 0.0044 and 0.0037 and leads 0.0221 and 0.0230, the
        one LRU demoted 26 minutes later (docs/results.md, "Replacement by
        the measured lead"). A promotion keeps the largest bound: its looks
        clear different bars (full window, short look), and one away from LRU
        is the guard-rail's decision.
        """
        s = self.settings
        if self.active == LRU or not s.replace_confidence:
            return None
        since = self._running_window(now)
        others = [n for n in self.names if n != self.active and n != LRU]
        if not others:
            return None
        gate = self._trails_the_field(others, since)
        best: tuple[str, Comparison, float] | None = None
        for name in others:
            cmp = self.hits.compare(name, self.active, since)
            if cmp.batches < 3:
                continue
            lb = cmp.lower(self._replace_quantile(cmp.batches))
            if (
                lb > self._margin(name, s.margin)
                and (best is None or cmp.lead > best[1].lead)
                and (gate or self._lasting_lead(name, now))
            ):
                best = (name, cmp, lb)
        return best

    def _lasting_lead(self, name: str, now: float) -> bool:
        """Whether ``name`` also leads the running candidate over a full promotion window, at its bar."""
        s = self.settings
        cmp = self.hits.compare(name, self.active, max(now - s.window_s, self.evidence_since[name]))
        if cmp.batches < self._full_batches or cmp.requests < s.full_window_min_requests:
            return False
        return cmp.lower(self._z_full) > self._margin(name, s.full_window_margin)

    def _trails_the_field(self, others: list[str], since: float) -> bool:
        """Whether the other candidates' median leads the running one with confidence (the gate)."""
        conf = self.settings.replace_gate_confidence
        if not conf:
            return True
        cmp = self.hits.compare_median(others, self.active, since)
        if cmp.batches < 3:
            return False
        return cmp.lower(self._t_quantile(conf, cmp.batches)) > 0.0

    def _replace_quantile(self, batches: int) -> float:
        # Bonferroni over the candidates a replacement may choose (not LRU, not the running one).
        alpha = (1.0 - self.settings.replace_confidence) / max(1, len(self.names) - 2)
        return self._t_quantile(1.0 - alpha, batches)

    def _switch(self, now: float, to: str, reason: str, cmp: Comparison, lb: float) -> Switch:
        sw = Switch(now, self.active, to, reason, cmp.lead, lb, cmp.batches, cmp.requests)
        self.reinstatable = None
        self.switches.append(sw)
        self.active = to
        self.active_since = now
        self.restart_real_check(now)
        return sw

    def state(self, now: float) -> dict[str, Any]:
        # A clock that reads NaN (state may be asked for before any refit) has no window.
        rates = self.hits.rates(now - self.settings.window_s) if math.isfinite(now) else {}
        return {
            "active": self.active,
            "promotions": self.promotions,
            "demotions": self.demotions,
            "real_check_demotions": self.real_check_demotions,
            "real_check_since": self.real_check_since if math.isfinite(self.real_check_since) else None,
            "replacements": self.replacements,
            "switches": [sw.to_json() for sw in self.switches],
            "seconds_on_candidate": {n: round(v, 3) for n, v in self.seconds_on.items()},
            "window_rates": rates,
            "calibration": self.calibration.get(now),
            "overstated": dict(self.overstated),
        }

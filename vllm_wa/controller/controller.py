"""The online controller: learn reuse models from engine events, tune, hot-swap.

``WAController.refit()`` is the whole job.  It drains the event sink, turns
events into censored reuse observations per finest class and feeds the
candidates' miniature caches; then, for every candidate, it fits one model
per class of that candidate's key, builds an immutable :class:`WAParams`,
and hands it to the candidate's shadow cache.  The tuner picks the candidate
the real cache runs (LRU, until another is measured better) and its
parameters are swapped into the live queue when they changed.  The job never
raises: an error is counted and logged, the last good parameters stay, and
the next run starts afresh.

The controller is the one owner of the live parameters: the refit job (on
its own thread) and the operator's pin/unpin (on the engine thread) resolve
and apply them under one lock, so neither can overwrite the other's.

The same object runs in the engine-core process (on an apscheduler thread)
and in ``vllm-wa replay`` (called at trace time through the replay clock).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_wa.controller.calibration import CheckedRequest
from vllm_wa.controller.cause_log import CauseLog
from vllm_wa.controller.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointFailures,
    read_checkpoint,
    write_checkpoint,
)
from vllm_wa.controller.class_drift import ClassDrift
from vllm_wa.controller.config import CandidateSpec, ControllerConfig
from vllm_wa.controller.estimators import FAMILIES, ModelFit, SurvivalBank, forgetting_factor, pooled
from vllm_wa.controller.features import FEATURES, FINEST, FOLDED, FeatureKey
from vllm_wa.controller.key_classes import KeyClasses
from vllm_wa.controller.learned_key import LearnedKey, assign
from vllm_wa.controller.reuse_tracker import ReuseTracker
from vllm_wa.controller.shadow import ClassKey, ShadowCache
from vllm_wa.controller.survival import NUM_BINS, SurvivalData, bin_exposures, gap_bin, separates, separation_threshold
from vllm_wa.controller.tuner import LRU, Tuner
from vllm_wa.engine_patch.block_tagger import MAX_LIVE_REQUESTS
from vllm_wa.engine_patch.conversations import ConversationTracker
from vllm_wa.engine_patch.events import EventKind, EventSink
from vllm_wa.params import ReuseModel, WAParams, params_changed
from vllm_wa.workload_classes import OTHER_CLASS, ClassRegistry, is_valid_class_name

logger = logging.getLogger(__name__)
# Finest classes (one estimator each, about 4 KiB): the default candidates'
# union of features (tag x outcome x reuse x think x reply x growth x turn)
# has up to 1,600 per tag and outcome; past the cap new ones keep only their
# tag and outcome (up to FOLDED_ROOM of those), then share "other".
MAX_FINE_CLASSES = 4096
# Finest classes past the cap that keep their tag and outcome (a tag cap's worth of outcomes).
FOLDED_ROOM = 1024
# Finest classes a checkpoint may hold: the cap, the folded ones and "other".
CHECKPOINT_MAX_CLASSES = MAX_FINE_CLASSES + FOLDED_ROOM + 1
# Once the table holds this many, a finest class with no block freed into it,
# reused or censored for ``class_retire_s`` and none still watched gives its slot back (checked
# every tenth of that time), so a long-running server whose tags change keeps
# learning the new ones instead of folding them, and then filing them as
# "other", for good. The development traces use at most about 1,500.
RETIRE_FINE_AT = MAX_FINE_CLASSES // 2
# Finest classes with blocks still watched, and those blocks' censored counts per bin.
AtRisk = tuple[np.ndarray, np.ndarray] | None


@dataclass
class Candidate:
    spec: CandidateSpec
    shadow: ShadowCache
    key: ClassKey | None
    params: WAParams = field(default_factory=WAParams.lru)
    fits: dict[str, ModelFit] = field(default_factory=dict)


# The key of the state's classes under LRU and of a pin that names no features.
DEFAULT_KEY = FeatureKey(("tag",))


def candidate_key(spec: CandidateSpec) -> ClassKey | None:
    """The class key a candidate starts with (None: LRU); a learned key starts with an empty table."""
    if spec.lru:
        return None
    key = FeatureKey(tuple(spec.features))
    return LearnedKey(key) if spec.classes else key


def sample_rate_for(cache_blocks: int, shadow_blocks: int) -> float:
    """Sample so the miniature caches hold about ``shadow_blocks`` blocks."""
    return min(1.0, shadow_blocks / max(1, cache_blocks))


def start_online(
    config: ControllerConfig,
    cache_blocks: int,
    install: Callable[[EventSink, ClassRegistry, FeatureKey, ConversationTracker], tuple[Any, Any]],
    clock: Callable[[], float] = time.monotonic,
    prior: WAParams | None = None,
    publish: bool = True,
    source_ids: np.ndarray | None = None,
) -> WAController:
    """Wire a live queue to a new controller (the engine and the replay share this).

    ``install(sink, registry, class_key, conversations)`` puts the
    workload-aware queue in place and returns ``(queue, tagger)``; swaps go
    to both.  ``publish``: see :class:`WAController`.  ``source_ids``: a
    replay's renumbered trace ids' ids in the file (see ``EventSink``).
    """
    rate = config.sample_rate or sample_rate_for(cache_blocks, config.shadow_blocks)
    chain = sample_rate_for(cache_blocks, config.shadow_blocks) if config.shadow_sampling == "chain" else None
    sink = EventSink(
        capacity=config.event_capacity, sample_rate=rate, chain_rate=chain, source_ids=source_ids,
        salt=config.sample_salt,
    )
    registry = ClassRegistry(max_classes=config.max_classes, retire_after_s=config.class_retire_s)
    initial = next(c for c in config.all_candidates if c.name == config.initial)
    key = candidate_key(initial) or DEFAULT_KEY
    conversations = ConversationTracker(max_age_s=config.max_watch_s, key_of=sink.sample_value)
    if prior is None and config.seed_params:
        prior = WAParams.load(config.seed_params, max_classes=config.max_classes)
    queue, tagger = install(sink, registry, key, conversations)
    if prior is not None and queue.params is not prior:
        # The config's seed: the queue runs what the controller reports as
        # running (the prior, until the first refit), as with --wa-params.
        queue.set_params(prior)

    def apply(params: WAParams, class_key: ClassKey | None) -> None:
        if class_key is not None:
            tagger.set_class_key(class_key)
        queue.set_params(params)

    return WAController(config, cache_blocks, apply, sink, clock=clock, prior=prior, publish=publish)


def _raised_at(e: BaseException) -> str:
    """Where ``e`` was raised: the innermost frame's file and line."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


class WAController:
    """Learns per-class reuse models online and drives a live queue.

    Args:
        config: the controller's knobs.
        cache_blocks: size of the real cache (the miniature caches scale it).
        apply: called with ``(params, class_key)`` to swap them into the real
            queue and tagger; ``class_key`` is None for LRU.
        sink: the event sink the engine hooks write to.
        clock: seconds; trace time in replays.
        prior: parameters before anything is learned (LRU when None).
        publish: publish :attr:`snapshot` at every refit, for readers on
            other threads (``/wa/params``); a replay has none and reads
            :meth:`state` once, at its end.
    """

    def __init__(
        self,
        config: ControllerConfig,
        cache_blocks: int,
        apply: Callable[[WAParams, ClassKey | None], None],
        sink: EventSink,
        clock: Callable[[], float] = time.monotonic,
        prior: WAParams | None = None,
        publish: bool = True,
    ) -> None:
        self.config = config
        self.publish = publish
        self.sink = sink
        self.clock = clock
        self.apply = apply
        self.cache_blocks = cache_blocks
        self.prior = prior if prior is not None else WAParams.lru(source="prior")
        rate = sink.sample_rate
        sampled_cache = max(2, int(round(cache_blocks * rate)))
        # Finest classes: every feature some candidate's key uses (the others
        # are folded), interned up to MAX_FINE_CLASSES.
        used = {f for c in config.all_candidates for f in c.features if not c.lru}
        self._fold = tuple(i for i, f in enumerate(FEATURES) if f not in used)
        self._other_fine = (OTHER_CLASS,) + (FOLDED,) * (len(FEATURES) - 1)
        self._fine_ids: dict[tuple, int] = {}
        self._fine: list[tuple] = []
        # When each finest class last had a block freed into it, reused or
        # censored (as of a refit), and those that have had one since the last refit.
        self._fine_used_at: list[float] = []
        self._fine_touched: set[int] = set()
        self._next_fine_retire = -math.inf
        self.finest_retired = 0  # finest classes given back (see RETIRE_FINE_AT)
        self.finest_folded = 0  # freed blocks filed under a folded class (the table was full)
        # The finest classes' observations, one row each (forgotten and pooled for all at once).
        self._bank = SurvivalBank()
        # The candidates' keys' classes, each counting its own lookups (the
        # class test counts one lookup's blocks as one observation per class
        # of the key, however many finest classes they span).
        self._key_classes: dict[FeatureKey, KeyClasses] = {}
        # Per class key: its classes' drift detectors, and what they forgot
        # in that key's view (the finest rows are never cut: class_drift).
        self._drift: dict[FeatureKey, ClassDrift] = {}
        # The finest classes the lookup being processed found reuses in, with their gaps.
        self._found: list[tuple[int, list[float]]] = []
        # The blocks still watched at the last fit: finest class, exposure bin,
        # weight and free time (see _late_censored).
        self._watched: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self.tracker = ReuseTracker(
            ghost_capacity=int(config.ghost_factor * sampled_cache),
            watch_capacity=2 * sampled_cache + 1024,
            max_watch_s=config.max_watch_s,
            on_reuse=self._on_reuse,
            on_censored=self._on_censored,
        )
        self._chain = sink.chain_rate is not None
        # The miniature caches' sample is nested in the watched one (the hashes
        # whose sample value is below a smaller threshold), and sized by it.
        # (Chain sampling feeds them whole conversations at the sink's chain rate instead.)
        shadow_rate = sample_rate_for(cache_blocks, config.shadow_blocks)
        if not self._chain:
            shadow_rate = min(rate, shadow_rate)
        self._shadow_threshold = int(shadow_rate * (1 << 64)) if shadow_rate < rate else 1 << 64
        self.shadow_blocks = max(2, int(round(cache_blocks * shadow_rate)))
        self.candidates: dict[str, Candidate] = {}
        # Candidates with the same feature key and model family (the same key
        # at two horizons, or with two stamps) see the same class data at every
        # fit, so they share their fits: the same models, fitted once.
        shared_fits: dict[tuple[FeatureKey, str], dict[str, ModelFit]] = {}
        self._default_fits = {c.family: ModelFit(c.family) for c in config.all_candidates if not c.lru}
        for spec in config.all_candidates:
            key = candidate_key(spec)
            shadow = ShadowCache(spec, self.shadow_blocks, config.max_classes, key, config.class_retire_s)
            fits = shared_fits.setdefault((key, spec.family), {}) if isinstance(key, FeatureKey) else {}
            self.candidates[spec.name] = Candidate(spec, shadow, key, fits=fits)
        self._shadows = [c.shadow for c in self.candidates.values()]
        # Sampled requests' real-cache checks, until they finish (_hold_real_check).
        self._held_checks: dict[str, CheckedRequest] = {}
        for cand in self.candidates.values():
            counted = cand.key.cells if isinstance(cand.key, LearnedKey) else cand.key
            if counted is not None:
                self._key_classes.setdefault(counted, KeyClasses(counted))
        self.tuner = Tuner(list(self.candidates), config.tuner_settings, config.initial, sampled_cache)
        self.pinned: WAParams | None = None
        self._pinned_key: FeatureKey | None = None
        # What the live queue runs: the parameters and the class key (None: LRU).
        self.params = self.prior
        self._applied_key: ClassKey | None = None
        self._applied_candidate: str | None = None
        self._swap_lock = threading.Lock()
        # When a swap last changed the candidate the live queue runs (None:
        # not since the last refit); the refit restarts the real-cache check.
        self._real_cache_changed: float | None = None
        # When the live queue last began to run another candidate (a switch, a
        # pin, an unpin), read on the clock once it runs it: a lookup before
        # then ran under what came before, though it is drained after.
        self._real_cache_since = -math.inf
        self.version = 0
        self.refits = 0
        self.swaps = 0
        self.errors = 0
        self.last_error = ""
        self._refit_causes = CauseLog()  # logged with a traceback already
        self.last_refit: float | None = None
        self.last_swap: float | None = None
        self.refit_seconds = 0.0
        self.events_processed = 0
        # Events whose time is NaN or infinite: skipped, not applied (one in a
        # drained batch failed the refit, and the rest of the batch was lost).
        self.events_bad_time = 0
        self.events_failed = 0  # events whose handling raised (skipped, the batch went on)
        self.drift_events: deque[dict[str, Any]] = deque(maxlen=50)
        self._last_forget: float | None = None
        self._last_checkpoint = -math.inf
        self._last_fit = -math.inf
        self._separation = {f: separation_threshold(config.class_confidence, f) for f in FAMILIES}
        self.checkpoint_failures = CheckpointFailures()
        # Overstatements a checkpoint held that this run does not apply (see load_checkpoint).
        self._unapplied_overstated: dict[str, float] = {}
        # The state as of the last refit, published for other threads (the
        # engine loop serves /wa/params from it while a refit may be running).
        self.snapshot: dict[str, Any] | None = None

    # ---- event intake ---------------------------------------------------------------------

    def _fine_id(self, comps: tuple) -> int:
        fid = self._fine_ids.get(comps)
        if fid is None:
            fid = self._new_fine_id(comps)
        self._fine_touched.add(fid)
        return fid

    def _new_fine_id(self, comps: tuple) -> int:
        if len(self._fine) >= MAX_FINE_CLASSES:
            # Full: keep the tag and outcome (every key has them to
            # tell apart), fold the rest; past some room for those, all is other.
            comps = comps[:2] + self._other_fine[2:]
            if len(self._fine) >= MAX_FINE_CLASSES + FOLDED_ROOM and comps not in self._fine_ids:
                comps = self._other_fine
            fid = self._fine_ids.get(comps)
            if fid is not None:
                return fid
        fid = len(self._fine)
        self._fine_ids[comps] = fid
        self._fine.append(comps)
        self._fine_used_at.append(-math.inf)
        self._bank.new_row()
        return fid

    def _retire_fine(self, now: float) -> None:
        """Give back the finest classes unused for ``class_retire_s`` (see :data:`RETIRE_FINE_AT`).

        The table is renumbered: the kept classes keep their observations,
        their watched blocks and (by name) each key's lookup counts and
        drift detectors; a class's drift cut shrinks with the observations
        retired from it.
        """
        used_at = self._fine_used_at
        for fid in self._fine_touched:
            used_at[fid] = now
        self._fine_touched.clear()
        if len(self._fine) < RETIRE_FINE_AT or now < self._next_fine_retire:
            return
        retire_s = self.config.class_retire_s
        self._next_fine_retire = now + max(1.0, retire_s / 10.0)
        watched = self.tracker.classes()
        keep = [f for f in range(len(self._fine)) if used_at[f] > now - retire_s or f in watched]
        if len(keep) == len(self._fine):
            return
        new_id = np.full(len(self._fine), -1, dtype=np.intp)
        new_id[keep] = np.arange(len(keep))
        self.finest_retired += len(self._fine) - len(keep)
        cut_before = {key: self._cut_counts(key) for key in self._drift}
        self._fine = [self._fine[f] for f in keep]
        self._fine_ids = {comps: i for i, comps in enumerate(self._fine)}
        self._fine_used_at = [used_at[f] for f in keep]
        self._bank.keep(keep)
        self.tracker.renumber(new_id)
        for kc in self._key_classes.values():
            kc.relabel(self._fine)
        for key, before in cut_before.items():
            drift = self._drift[key]
            after = self._cut_counts(key)
            for name, counts in before.items():
                drift.rescale(name, counts, after.get(name, np.zeros_like(counts)))
            drift.retain(self._key_classes[key].names)
        for cand in self.candidates.values():
            kc = self._key_classes.get(cand.key) if isinstance(cand.key, FeatureKey) else None
            if kc is not None:  # a retired class's warm-started fit goes too
                live = set(kc.names)
                for name in [n for n in cand.fits if n not in live]:
                    del cand.fits[name]

    def _cut_counts(self, key: FeatureKey) -> dict[str, np.ndarray]:
        """The pooled counts, now, of each of ``key``'s classes that a drift cut."""
        kc, _ = self._classes_of(key)
        out = {}
        for name in self._drift[key].cut_classes():
            rows = kc.rows_of(name)
            if rows is not None:
                out[name] = self._bank.sum_rows(rows)
        return out

    def _drift_of(self, key: FeatureKey) -> ClassDrift:
        """``key``'s drift detectors (made at its first lookup with reuses, or restore)."""
        drift = self._drift.get(key)
        if drift is None:
            drift = self._drift[key] = ClassDrift(self.config.drift_delta, self.config.drift_forget)
        return drift

    def _weight(self, observed_s: float) -> float:
        """The weight of an observation that ends ``observed_s`` seconds after its block was freed.

        Forgetting ages what is recorded, so an observation recorded with
        weight 1 would weigh by when it *ended*: a long gap, a watch that
        expired, a block still watched would all outweigh a short reuse of a
        block freed at the same moment, and the fit would lean toward "never
        reused" by as much as ``exp(max_watch_s / memory_s)``.  Recorded with
        ``exp(-observed_s / memory_s)`` and then aged, every observation
        weighs by its block's free time alone, which its outcome does not
        change, and the weighted fit is unbiased on steady traffic.  Only
        with ``weigh_by_free_time`` (opt-in; weight 1 otherwise).
        """
        if not self.config.weigh_by_free_time:
            return 1.0
        return math.exp(-observed_s / self.config.memory_s) if observed_s > 0 else 1.0

    def _lookup_weight(self, gaps: list[float]) -> float:
        """A lookup's weight as one observation (``groups``): its reuses' mean weight."""
        if not self.config.weigh_by_free_time:
            return 1.0  # the hot path: no call per gap per key when the weights are all 1
        return sum(map(self._weight, gaps)) / len(gaps) if gaps else 0.0

    def _on_reuse(self, fid: int, gaps: list[float], t: float) -> None:
        """The reuses one lookup found in a finest class: observations now,
        lookup counts and drift detection per key in :meth:`_count_lookup`."""
        self._found.append((fid, gaps))
        self._fine_touched.add(fid)
        row = self._bank.rows[fid]
        if not self.config.weigh_by_free_time:
            for g in gaps:
                row.add_event(g)
            row.groups += 1.0
            return
        weights = [self._weight(g) for g in gaps]
        for g, w in zip(gaps, weights):
            row.add_event(g, w)
            self._forget_late(fid, False, g, w, t - g)
        row.groups += sum(weights) / len(weights)

    def _on_censored(self, fid: int, exposure: float, freed_at: float) -> None:
        self._fine_touched.add(fid)
        w = self._weight(exposure)
        self._bank.rows[fid].add_censored(exposure, w)
        if self.config.weigh_by_free_time:
            self._forget_late(fid, True, exposure, w, freed_at)

    def _forget_late(self, fid: int, censored: bool, observed_s: float, weight: float, freed_at: float) -> None:
        """An observation of finest class ``fid`` (of weight ``weight``) whose
        block was freed at ``freed_at``: each key whose class of it was cut
        since forgets it as the cut forgot the block's peers
        (:class:`ClassDrift`; with ``weigh_by_free_time`` only)."""
        for key, drift in self._drift.items():
            if not drift.late():
                continue
            kc = self._key_classes.get(key)
            if kc is None:
                continue
            if fid >= len(kc.labels):
                kc.extend(self._fine)
            drift.forget_late(kc.names[kc.labels[fid]], censored, gap_bin(max(0.0, observed_s)), weight, freed_at)

    def _finest(self, request: Any, position: int, reuse_count: int) -> tuple:
        return self._folded(FINEST.components(request, position, reuse_count))

    def _folded(self, comps: tuple) -> tuple:
        """A finest class's components with the features no candidate uses folded."""
        if self._fold:
            comps = list(comps)
            for i in self._fold:
                comps[i] = FOLDED
            comps = tuple(comps)
        return comps

    def _shadow_hashes(self, ev: Any) -> tuple[list, int | None]:
        """The hashes a lookup brings to the miniature caches (see
        ``shadow_sampling``), and how many of them the real cache had (None:
        unknown, under chain sampling or when the engine does not say)."""
        if self._chain:
            return list(ev.chain), None
        thr = self._shadow_threshold
        real = ev.real_hits
        if thr >= 1 << 64:
            return list(ev.hashes), real
        if not real:
            return self.sink.subsample(ev.hashes, thr), real
        # The real cache's hits are the first ``real`` hashes: subsample them and the rest apart.
        head = self.sink.subsample(ev.hashes[:real], thr)
        return head + self.sink.subsample(ev.hashes[real:], thr), len(head)

    @property
    def finest_classes(self) -> int:
        """Finest classes with a slot in the table (at most the cap plus its folded room)."""
        return len(self._fine)

    @property
    def active(self) -> str:
        """The candidate the tuner runs (the live queue runs it unless pinned)."""
        return self.tuner.active

    def process(self, events: list[Any]) -> None:
        """Apply drained engine events in order."""
        tracker = self.tracker
        shadows = self._shadows
        record = self.tuner.record
        evicted = 0
        isfinite = math.isfinite
        for ev in events:
            if not isfinite(ev.time):
                self.events_bad_time += 1
                continue
            try:
                kind = ev.kind
                if kind == EventKind.FREED:
                    comps = self._finest(ev.request, ev.position, ev.reuse_count)
                    fid = self._fine_id(comps)
                    if self._fine[fid] != comps:
                        self.finest_folded += 1
                    tracker.freed(ev.block_hash, fid, ev.time)
                elif kind == EventKind.EVICTED:
                    tracker.evicted(ev.block_hash, ev.time)
                    evicted += 1
                    last_evicted = ev.time
                elif kind == EventKind.LOOKUP:
                    self._found.clear()  # what a failed lookup left is not this one's
                    tracker.looked_up(ev.hashes, ev.time)
                    if self._found:
                        self._count_lookup(self._found, ev.time)
                    hs, real = self._shadow_hashes(ev)
                    # A repeated lookup (a preemption, a lost finish) of a request
                    # any miniature cache still holds is skipped in all of them:
                    # admitted again where it was held, its first admission's
                    # blocks would stay pinned for good.  (Whether a cache holds it
                    # differs where one of them could not fit it.)
                    rid = ev.request_id
                    if hs and not any(s.cache.holds(rid) for s in shadows):
                        # The same sampled request in every miniature cache: paired
                        # evidence. While pinned the real cache runs the pin, not
                        # the tuner's candidate: its hits check nothing; nor do
                        # those of a lookup made before the live queue took up
                        # what it runs now (one made during a refit that switched,
                        # or under a pin just lifted, is drained after).
                        if self.pinned is not None or ev.time < self._real_cache_since:
                            real = None
                        hits = [s.lookup(rid, ev.tag, hs, ev.time) for s in shadows]
                        if not self.candidates[self.tuner.active].shadow.cache.holds(rid):
                            real = None  # the miniature cache could not fit it: see _hold_real_check
                        checked = record(ev.time, len(hs), hits, real)
                        if checked is not None:
                            self._hold_real_check(rid, checked)
                elif kind == EventKind.FINISHED:
                    checked = self._held_checks.pop(ev.request_id, None)
                    if checked is not None and ev.request is None:
                        self.tuner.retract_real(checked)  # the real cache held none of it
                    for s in shadows:
                        s.finish(ev.request_id, ev.request, ev.time)
                elif kind == EventKind.OUTCOME:
                    # A late outcome: the watched blocks' observations and the
                    # miniature caches' copies move to the request's new class.
                    for pos, h, reuse in ev.blocks:
                        tracker.refile(h, ev.freed_at, self._fine_id(self._finest(ev.request, pos, reuse)))
                    for s in shadows:
                        s.reclassify(ev.request, ev.time)
            except Exception:  # one event's bug must not cost the batch its finishes
                self._event_failed(ev)
        if evicted:
            self.tuner.evicted(last_evicted, evicted)
        self.events_processed += len(events)

    def _event_failed(self, ev: Any) -> None:
        """Count (and log, the first time) an event whose handling raised.

        It is skipped and the batch goes on: had the error ended the batch,
        its FINISHED events would be lost with it, and the miniature caches
        would hold those requests' blocks pinned until ``max_watch_s``; a
        failing refit now and then filled them, and every candidate read
        about no hits.
        """
        self.events_failed += 1
        if self.events_failed == 1:
            logger.exception("vllm-wa: skipped an engine event whose handling failed (%s)", type(ev).__name__)

    def _hold_real_check(self, request_id: str, checked: CheckedRequest) -> None:
        """Keep a sampled request's real-cache check until the request finishes.

        Only requests that fitted both caches are checked. The real hits are
        those the lookup found, before the real cache knew whether it could
        fit the request. One the running candidate's miniature cache could
        not fit is predicted no hit there, so it is not checked at all: with
        it, the real cache read 9.5 points over the prediction where a third
        of the prompts did not fit. One the real cache refused (it leaves
        holding no blocks; a server keeps it waiting) but a sampled miniature
        cache fitted hits blocks there the real cache never held, so its
        check is taken back when it leaves: with it, LRU's miniature cache led
        the real cache by 18 points on those requests.
        """
        held = self._held_checks
        held[request_id] = checked
        if len(held) > MAX_LIVE_REQUESTS:  # finishes lost: the oldest check stays
            del held[next(iter(held))]

    # ---- the job ----------------------------------------------------------------------------

    def refit(self) -> None:
        """Drain, learn, tune, swap. Never raises."""
        t0 = time.perf_counter()
        try:
            now = self.clock()
            if not math.isfinite(now):
                # Checked before anything is drained: expiring every watch
                # at NaN would censor them all with no exposure to record.
                raise ValueError(f"the clock read {now!r}")
            self._refit(now)
        except Exception as e:  # noqa: BLE001 - the job must keep running
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            # With its traceback once per cause (the error's type and the line that
            # raised it; its message may carry values): one that repeats (a clock
            # stuck at NaN) would log one every refit_interval_s while it lasts.
            if not self._refit_causes.first((type(e).__name__, _raised_at(e))):
                logger.debug("vllm-wa controller refit failed again (%d errors): %s", self.errors, self.last_error)
            else:
                logger.exception(
                    "vllm-wa controller refit failed; keeping the last good parameters "
                    "(counted in vllm_wa_controller_errors; this cause is not logged again)"
                )
        finally:
            self.refit_seconds = time.perf_counter() - t0

    def _refit(self, now: float) -> None:
        # Forget first, then record: the reuses drained here and the watches
        # that expire here all ended since the last refit, and so weigh alike
        # (recording the reuses before forgetting aged them by one interval
        # more than the censorings recorded after it).
        if self._last_forget is not None and len(self._bank):
            # A clock that steps back forgets nothing until it is past its last forget again.
            factor = forgetting_factor(max(0.0, now - self._last_forget), self.config.memory_s)
            if factor < 1.0:
                self._bank.decay(factor)
                for kc in self._key_classes.values():
                    kc.decay(factor)
                for drift in self._drift.values():
                    drift.decay(factor)
        self._last_forget = now if self._last_forget is None else max(now, self._last_forget)
        self.process(self.sink.drain())
        self.tracker.expire(now)
        for drift in self._drift.values():
            drift.prune(now - self.config.max_watch_s)
        self._retire_fine(now)
        for cand in self.candidates.values():
            cand.shadow.expire(now, self.config.max_watch_s)
        if now - self._last_fit >= self.config.fit_interval_s:
            # Fits move slowly (forgetting scales every count alike); the
            # tuner still decides, and swaps land, at every refit.
            self._last_fit = now
            at_risk = self._at_risk(now)
            by_key: dict[FeatureKey, dict[str, SurvivalData]] = {}
            # Every key partitions the same finest classes: one pooled default.
            (total,) = self._bank.pool(np.zeros(len(self._bank), dtype=np.intp), 1, at_risk)
            defaults = {
                family: fit.get(total) if total.n_events >= self.config.min_samples else None
                for family, fit in self._default_fits.items()
            }
            for cand in self.candidates.values():
                if cand.spec.lru:
                    continue
                cand.params = self._fit_candidate(cand, at_risk, by_key, defaults[cand.spec.family])
                cand.shadow.set_params(cand.params)
        if self.config.tuner_enabled:
            sw = self.tuner.decide(now)
            if sw is not None:
                logger.info("vllm-wa tuner: %s %s -> %s (lead %.4f, bound %.4f, %d requests in %d batches)",
                            sw.reason, sw.from_candidate, sw.to_candidate, sw.lead, sw.lower_bound,
                            sw.requests, sw.batches)
        else:
            self.tuner.account(now)  # the fixed candidate's time still counts
        self._swap(now)
        with self._swap_lock:
            changed, self._real_cache_changed = self._real_cache_changed, None
        if changed is not None:
            self.tuner.restart_real_check(changed)
        self.refits += 1
        self.last_refit = now
        if self.publish:
            self.snapshot = self.state()
        if self.config.checkpoint_path and now - self._last_checkpoint >= self.config.checkpoint_interval_s:
            self._last_checkpoint = now
            self.save_checkpoint(self.config.checkpoint_path)

    def _at_risk(self, now: float) -> AtRisk:
        """Blocks still watched, as censored observations at their current
        exposure (weighted as :meth:`_weight` says): the finest classes that
        have some, and their binned counts."""
        if not len(self.tracker):
            self._watched = None
            return None
        arr = self.tracker.at_risk_array(now)
        fids = arr[:, 0].astype(np.int64)
        exposures = arr[:, 1]
        bins = bin_exposures(exposures)
        if self.config.weigh_by_free_time:
            weights = np.exp(-np.maximum(exposures, 0.0) / self.config.memory_s)
        else:
            weights = np.ones(len(exposures))
        counts = np.zeros((len(self._fine), NUM_BINS))
        np.add.at(counts, (fids, bins), weights)
        # Kept for the keys whose cuts some of these blocks predate (_late_censored).
        self._watched = (fids, bins, weights, now - exposures)
        rows = np.flatnonzero(counts.sum(axis=1))
        return rows, counts[rows]

    def _classes_of(self, key: FeatureKey) -> tuple[KeyClasses, np.ndarray]:
        """``key``'s classes over every finest class so far, and each finest
        class's label: a candidate's key's own, which counts its lookups, or
        for another key (the state's, under LRU) a view made for the call."""
        kc = self._key_classes.get(key)
        if kc is None:
            kc = KeyClasses(key)
        return kc, kc.extend(self._fine)

    def _count_lookup(self, found: list[tuple[int, list[float]]], t: float) -> None:
        """One lookup found reuses in these finest classes (with their gaps):
        for each class of each key, one lookup counted and one value for its
        drift detector; a detection forgets in that key's view only."""
        top = max(fid for fid, _ in found)
        for key, kc in self._key_classes.items():
            if top >= len(kc.labels):
                kc.extend(self._fine)
            names, labels, lookups = kc.names, kc.labels, kc.lookups
            by_class: dict[int, list[float]] = {}
            for fid, gaps in found:
                by_class.setdefault(labels[fid], []).extend(gaps)
            drift = self._drift_of(key)
            for i, gaps in by_class.items():
                lookups[i] += self._lookup_weight(gaps)
                if drift.update(names[i], gaps):
                    drift.cut(names[i], self._bank.sum_rows(kc.rows(i)), t)
                    lookups[i] *= drift.forget
                    self.drift_events.append({"time": t, "key": key.name, "class": names[i]})

    def _class_data(self, key: ClassKey, at_risk: AtRisk) -> dict[str, SurvivalData]:
        """The observations of each class of ``key``: its finest classes pooled,
        then the blocks they still watch.  A candidate's key's classes carry
        its own lookup counts (pooling finest classes would count a lookup
        once in each) and what its drifts forgot; a learned key's classes
        pool its cells' data so."""
        if isinstance(key, LearnedKey):
            return self._pooled_cells(key, self._class_data(key.cells, at_risk))
        kc, labels = self._classes_of(key)
        data = self._bank.pool(labels, len(kc.names), at_risk)
        if key in self._key_classes:
            for d, g in zip(data, kc.lookups):
                # At most the finest classes' sum (a retired finest class
                # takes its lookups along; the key keeps its count by name).
                d.groups = min(g, d.groups)
        drift = self._drift.get(key)
        if drift is not None:
            late = self._late_censored(kc, labels, drift) if at_risk is not None else {}
            data = [drift.view(name, d, late.get(name)) for name, d in zip(kc.names, data)]
        return dict(zip(kc.names, data))

    def _late_censored(self, kc: KeyClasses, labels: np.ndarray, drift: ClassDrift) -> dict[str, np.ndarray]:
        """For each class of ``kc`` cut since some of its watched blocks were
        freed: what its cuts forget of them, binned by exposure."""
        if not self.config.weigh_by_free_time or not drift.late() or self._watched is None:
            return {}
        fids, bins, weights, freed_at = self._watched
        classes = labels[fids]
        out = {}
        for name in drift.late_classes():
            i = kc.index.get(name)
            if i is None:
                continue
            mine = classes == i
            if mine.any():
                forgotten = drift.late_weights(name, freed_at[mine], weights[mine])
                out[name] = np.bincount(bins[mine], weights=forgotten, minlength=NUM_BINS)
        return out

    @staticmethod
    def _pooled_cells(key: LearnedKey, cells: dict[str, SurvivalData]) -> dict[str, SurvivalData]:
        """A learned key's classes' observations: its cells' data summed by its table."""
        members: dict[str, list[SurvivalData]] = {}
        for cell, d in cells.items():
            members.setdefault(key.class_of(cell), []).append(d)
        return {name: pooled(*ds) for name, ds in members.items()}

    def _learn_key(self, cand: Candidate, at_risk: AtRisk) -> dict[str, SurvivalData]:
        """Re-learn a learned key's table; returns its classes' observations."""
        key = cand.key
        assert isinstance(key, LearnedKey)
        cells = self._class_data(key.cells, at_risk)
        table = assign(cells, cand.spec.classes, self.config.min_samples, cand.spec.split_s)
        if table != key.table:
            key = cand.key = LearnedKey(key.cells, table)
            cand.shadow.set_key(key)
        return self._pooled_cells(key, cells)

    def _fit_candidate(
        self,
        cand: Candidate,
        at_risk: AtRisk,
        by_key: dict[FeatureKey, dict[str, SurvivalData]],
        default: ReuseModel | None,
    ) -> WAParams:
        """``by_key``: this fit's class data of the feature keys already pooled;
        ``default``: the model of all observations pooled, in the candidate's family."""
        spec, key = cand.spec, cand.key
        assert key is not None
        if isinstance(key, LearnedKey):
            classes = self._learn_key(cand, at_risk)
        else:
            classes = by_key.get(key)
            if classes is None:
                classes = by_key[key] = self._class_data(key, at_risk)
        threshold = self._separation[spec.family]
        models: dict[str, ReuseModel] = {}
        for name, d in classes.items():
            # A class whose name holds a folded feature (``*``: finest classes
            # past the cap, or rows restored from a run that did not read that
            # feature) is one the engine's key never names: a model for it
            # would never score a block, and its name is no class name (a
            # checkpoint holding it would be refused at the next start).
            if d.n_events < self.config.min_samples or not is_valid_class_name(name):
                continue
            m = self._model_fit(cand, name).get(d)
            if m is not None and (default is None or separates(m, default, d, threshold)):
                models[name] = m
        if not models:
            return self.prior.evolve(horizon=spec.horizon, mode=spec.mode, stamp=spec.stamp, source="prior")
        return WAParams(
            models=models,
            default=default or self.prior.default,
            horizon=spec.horizon,
            mode=spec.mode,
            stamp=spec.stamp,
            source=f"online:{spec.name}",
        )

    @staticmethod
    def _model_fit(cand: Candidate, name: str) -> ModelFit:
        fit = cand.fits.get(name)
        if fit is None:
            fit = cand.fits[name] = ModelFit(cand.spec.family)
        return fit

    def _target(self) -> tuple[WAParams, ClassKey | None, str]:
        """What the live queue should run: the pin, or the tuner's candidate."""
        if self.pinned is not None:
            return self.pinned, self._pinned_key, "pinned"
        cand = self.candidates[self.active]
        if cand.spec.lru:
            return WAParams.lru(source="online:lru"), None, LRU
        return cand.params, cand.key, cand.spec.name

    def _swap(self, now: float) -> bool:
        """Apply the target parameters if they differ from the live ones; under the lock."""
        with self._swap_lock:
            params, key, name = self._target()
            if name not in ("pinned", LRU):
                params = self._with_other_classes(self.candidates[name])
            # Compared as applied (merged): an unmerged target never equals the live parameters.
            if (
                self.version > 0
                and name == self._applied_candidate
                and key == self._applied_key
                and not params_changed(self.params, params, self.config.swap_tolerance)
            ):
                return False
            params = params.evolve(version=self.version + 1)
            params.compile()  # scorers are built here, not on the engine thread
            self.apply(params, key)
            self.version = params.version
            self.params = params
            self._applied_key = key
            if self.swaps and name != self._applied_candidate:
                # What the real cache runs changed (a switch, a pin, an
                # unpin): the real-cache check waits for a turnover again.
                # (The first swap changes nothing: the cache starts cold.)
                self._real_cache_changed = now
                self._real_cache_since = self.clock()
            self._applied_candidate = name
            self.swaps += 1
            self.last_swap = now
            return True

    def _with_other_classes(self, cand: Candidate) -> WAParams:
        """The active candidate's parameters, plus the other candidates' classes.

        Blocks freed under an earlier class key keep their class until they
        leave the queue; class names of different keys do not collide (a tag
        holds no ``.`` or ``:``, the separators of a name's parts, and a key
        without the tag always names with one: ``FeatureKey.name_of``), so
        adding every other key's current models keeps those blocks scored by
        what was learned about them instead of by the default model.  A
        candidate of the same key (another family or horizon) adds nothing:
        a class the active candidate leaves to its default stays there, as
        in its miniature cache.
        """
        merged: dict[str, ReuseModel] = {}
        for other in self.candidates.values():
            if other is not cand and not other.spec.lru and other.key != cand.key:
                merged.update(other.params.models)
        if not merged:
            return cand.params
        merged.update(cand.params.models)
        return cand.params.evolve(models=merged)

    # ---- operator control ---------------------------------------------------------------------

    def pin(self, params: WAParams, features: tuple[str, ...] | None = None) -> None:
        """Run fixed parameters (learning continues); validated by the caller."""
        key = FeatureKey(tuple(features)) if features is not None else DEFAULT_KEY
        with self._swap_lock:
            before = (self.pinned, self._pinned_key, self._applied_candidate)
            self.pinned = params.evolve(source="pinned")
            self._pinned_key = key
            # An operator's pin lands as sent, even within ``swap_tolerance``
            # of what runs (the tolerance spares the engine the refits' jitter).
            self._applied_candidate = None
        try:
            self._swap(self.clock())
        except Exception:
            # A pin that cannot be applied leaves nothing behind: not a "pinned"
            # mode over the old parameters, nor a target every refit fails on.
            with self._swap_lock:
                self.pinned, self._pinned_key, self._applied_candidate = before
            raise

    def unpin(self) -> None:
        with self._swap_lock:
            self.pinned = None
            self._pinned_key = None
        self._swap(self.clock())

    # ---- state ------------------------------------------------------------------------------------

    def class_estimates(self) -> dict[str, dict[str, Any]]:
        """Per-class estimates under the active candidate's key, with sample counts."""
        cand = self.candidates[self.active]
        key = cand.key or DEFAULT_KEY
        out: dict[str, dict[str, Any]] = {}
        for name, d in sorted(self._class_data(key, None).items()):
            m = self.params.models.get(name) if self.params else None
            out[name] = {
                "reuse_probability": m.p if m is not None else None,
                "reuse_rate": m.a if m is not None else None,
                "reuses": round(d.n_events, 2),
                "observations": round(d.n, 2),
                "fitted": m is not None,
            }
        return out

    def state_light(self) -> dict[str, Any]:
        """What can be read safely before the first refit has published a snapshot."""
        return {
            "mode": "pinned" if self.pinned is not None else "auto",
            "active_candidate": self.active,
            "params": self.params.to_pr_json(),
            "params_version": self.version,
            "params_source": self.params.source,
            "refits": self.refits,
            "swaps": self.swaps,
            "errors": self.errors,
        }

    def state(self) -> dict[str, Any]:
        def rnd(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        now = self.clock() if self.last_refit is None else self.last_refit
        tuner = self.tuner.state(now)
        rates = tuner.pop("window_rates")
        return {
            **self.state_light(),
            "classes": self.class_estimates(),
            "candidates": [
                {
                    "name": name,
                    "active": name == self.active,
                    "sampled_hit_rate": rnd(rate),
                    "sampled_lookups": lookups,
                    "shadow_blocks": self.shadow_blocks,
                    **self._shadow_counters(name),
                    **self._learned_state(name),
                }
                for name, (rate, lookups) in rates.items()
            ],
            "drift_events": list(self.drift_events),  # the last 50
            "drifts": {key.name: d.drifts for key, d in self._drift.items()},
            "switches": tuner["switches"],
            "promotions": tuner["promotions"],
            "demotions": tuner["demotions"],
            "real_check_demotions": tuner["real_check_demotions"],
            # When the real-cache check of the running candidate began counting (None: not yet).
            "real_check_since": rnd(tuner["real_check_since"]),
            "replacements": tuner["replacements"],
            "seconds_on_candidate": tuner["seconds_on_candidate"],
            # The running candidate's prediction against the real cache (tuner.calibration).
            "calibration": tuner["calibration"],
            "overstated": tuner["overstated"],
            "last_refit": rnd(self.last_refit),
            "last_swap": rnd(self.last_swap),
            "last_error": self.last_error,
            "checkpoint_errors": self.checkpoint_failures.count,
            "checkpoint_trims": self.checkpoint_failures.trims,
            "last_checkpoint_error": self.checkpoint_failures.last_error,
            "refit_seconds": rnd(self.refit_seconds),
            "events_processed": self.events_processed,
            "events_bad_time": self.events_bad_time,
            "events_failed": self.events_failed,
            "events_dropped": self.sink.dropped,
            "finest_classes": self.finest_classes,
            "finest_classes_retired": self.finest_retired,
            "finest_folded": self.finest_folded,
            "watched_blocks": len(self.tracker.watch),
            # Reuses of watched blocks, those of them found in the ghost table
            # (evicted first: what an uncensored estimate would miss), and
            # watches that ended without one.
            "reuses_seen": self.tracker.reuses,
            "ghost_reuses": self.tracker.ghost_reuses,
            "watches_censored": self.tracker.censored,
            "ghost_blocks": len(self.tracker.ghost),
            "sample_rate": self.sink.sample_rate,
        }

    def _shadow_counters(self, name: str) -> dict[str, int]:
        """What a candidate's miniature cache could not measure: sampled
        requests whose blocks did not fit (counted as misses), and requests
        it released without their finish (a full event sink)."""
        shadow = self.candidates[name].shadow
        return {
            "shadow_overflow": shadow.overflow,
            "shadow_lost_finishes": shadow.lost_finishes,
            "shadow_expired": shadow.expired,
        }

    def _learned_state(self, name: str) -> dict[str, Any]:
        """A learned key's classes: how many feature cells each holds."""
        key = self.candidates[name].key
        if not isinstance(key, LearnedKey):
            return {}
        return {"learned_cells": dict(sorted(Counter(cls for _, cls in key.table).items()))}

    # ---- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, path: str) -> bool:
        """Write a checkpoint (atomically); a failure is counted, never raised.

        Its params are what runs, as the candidate (or pin) has them: the
        other keys' classes the live queue also holds are left out, so they
        stay within a checkpoint's class cap.  A restart does not run them
        (it starts on LRU); they carry the version and show what ran.
        """
        with self._swap_lock:
            running = self._target()[0].evolve(version=self.version)
        ckpt = Checkpoint(
            self.active,
            running,
            tuple(zip(self._fine, self._bank.rows)),
            # The tuner's findings, then those a restart read and did not apply
            # (the check off, or a candidate not configured now), so they are kept.
            tuple({**self._unapplied_overstated, **self.tuner.overstated}.items()),
            self._saved_cuts(),
        )
        try:
            dropped = write_checkpoint(path, ckpt)
        except (OSError, ValueError) as e:
            self.checkpoint_failures.record(path, e)
            return False
        if dropped:
            self.checkpoint_failures.trimmed(path, dropped)
        return True

    def _saved_cuts(self) -> tuple[tuple[tuple[str, ...], str, SurvivalData], ...]:
        """What each key's drifts forgot, per class (at most a checkpoint's worth per key)."""
        out = []
        for key, drift in self._drift.items():
            kc, _ = self._classes_of(key)
            kept = 0
            for name, held in drift.cuts().items():
                if kept == CHECKPOINT_MAX_CLASSES:
                    break
                i = kc.index.get(name)
                if i is None:
                    continue
                kept += 1
                # The lookups forgot too: the finest rows' sum less the key's count.
                lookups = self._bank.sum_groups(kc.rows(i))
                out.append((key.features, name, SurvivalData(held[0], held[1], max(0.0, lookups - kc.lookups[i]))))
        return tuple(out)

    def load_checkpoint(self, path: str) -> bool:
        """Warm-start from a checkpoint; whatever the file holds, a bad one gives a warning and the prior."""
        try:
            ckpt = read_checkpoint(path, max_classes=CHECKPOINT_MAX_CLASSES)
        except CheckpointError as e:
            logger.warning("vllm-wa: ignoring checkpoint %s (%s); starting from the prior", path, e)
            return False
        except Exception:  # noqa: BLE001 - never fail the engine's start over a checkpoint
            logger.exception("vllm-wa: ignoring checkpoint %s (unexpected error); starting from the prior", path)
            return False
        if ckpt is None:
            return False
        for comps, d in ckpt.classes:
            # Filed as this run files a block: its features folded as the
            # candidates configured now fold them; rows that land together add up.
            row = self._bank.rows[self._fine_id(self._folded(comps))]
            row += d
        # The checkpoint keeps lookups per finest class only: each key starts
        # from their sum (at most one per class spanned), and counts exactly from here.
        rows = self._bank.rows
        for kc in self._key_classes.values():
            labels = kc.extend(self._fine).tolist()
            kc.lookups[:] = [0.0] * len(kc.names)
            for fid, label in enumerate(labels):  # one pass, each class in row order
                kc.lookups[label] += rows[fid].groups
        # What earlier drifts forgot, for the keys and classes configured now,
        # at most each class's data as restored.
        for features, name, d in ckpt.drift_cuts:
            kc = self._key_classes.get(FeatureKey(features))
            i = None if kc is None else kc.index.get(name)
            if i is None:
                continue
            pooled_now = self._bank.sum_rows(kc.rows(i))
            self._drift_of(kc.key).restore(name, np.minimum(np.stack((d.events, d.censored)), pooled_now))
            kc.lookups[i] = max(0.0, kc.lookups[i] - d.groups)
        # The saved active candidate is not trusted: the tuner starts on LRU and
        # re-confirms a candidate on this traffic before promoting it, against
        # the bar the real-cache check raised for it (unless the check is now
        # off; candidates no longer configured are dropped).
        names = set(self.tuner.names) - {LRU} if self.tuner.settings.real_check else set()
        self.tuner.overstated = {n: v for n, v in ckpt.overstated if n in names}
        self._unapplied_overstated = {n: v for n, v in ckpt.overstated if n not in names}
        # The saved params are not applied (the tuner starts on LRU), so
        # ``params`` stays what the live queue runs; the version continues.
        self.version = max(self.version, ckpt.params.version)
        return True

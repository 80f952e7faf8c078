"""The online controller: learn reuse models from engine events, tune, hot-swap.

``WAController.refit()`` is the whole job.  It drains the event sink, turns
events into censored reuse observations per finest class and feeds the
candidates' miniature caches; then, for every candidate, it fits one model
per class of that candidate's key, builds an immutable :class:`WAParams`,
and hands it to the candidate's shadow cache.  The tuner picks the candidate
the real cache runs (LRU is always a candidate) and the new parameters are
swapped into the live queue.  The job never raises: an error is counted and
logged, the last good parameters stay, and the next run starts afresh.

The same object runs in the engine-core process (on an apscheduler thread)
and in ``vllm-wa replay`` (called at trace time through the replay clock).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_wa.controller.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointFailures,
    read_checkpoint,
    write_checkpoint,
)
from vllm_wa.controller.config import CandidateSpec, ControllerConfig
from vllm_wa.controller.estimators import FitState, ReuseEstimator, fit_model
from vllm_wa.controller.features import FINEST, FeatureKey
from vllm_wa.controller.reuse_tracker import ReuseTracker
from vllm_wa.controller.shadow import ShadowCache
from vllm_wa.controller.survival import NUM_BINS, SurvivalData, bin_exposures
from vllm_wa.engine_patch.events import EventKind, EventSink, hash_sample_value
from vllm_wa.params import ReuseModel, WAParams
from vllm_wa.workload_classes import ClassRegistry

logger = logging.getLogger(__name__)
MAX_FINE_CLASSES = 1024


@dataclass
class Candidate:
    spec: CandidateSpec
    shadow: ShadowCache
    key: FeatureKey | None
    params: WAParams = field(default_factory=WAParams.lru)
    lead_since: float | None = None
    fits: dict[str, FitState] = field(default_factory=dict)


def sample_rate_for(cache_blocks: int, shadow_blocks: int) -> float:
    """Sample so the miniature caches hold about ``shadow_blocks`` blocks."""
    return min(1.0, shadow_blocks / max(1, cache_blocks))


def start_online(
    config: ControllerConfig,
    cache_blocks: int,
    install: Callable[[EventSink, ClassRegistry, FeatureKey], tuple[Any, Any]],
    clock: Callable[[], float] = time.monotonic,
    prior: WAParams | None = None,
) -> WAController:
    """Wire a live queue to a new controller (the engine and the replay share this).

    ``install(sink, registry, class_key)`` puts the workload-aware queue in
    place and returns ``(queue, tagger)``; swaps go to both.
    """
    rate = config.sample_rate or sample_rate_for(cache_blocks, config.shadow_blocks)
    sink = EventSink(capacity=config.event_capacity, sample_rate=rate)
    registry = ClassRegistry(max_classes=config.max_classes, retire_after_s=config.class_retire_s)
    initial = next(c for c in config.all_candidates if c.name == config.initial)
    key = FeatureKey(tuple(initial.features)) if not initial.lru else FeatureKey(("tag",))
    queue, tagger = install(sink, registry, key)
    if prior is None and config.seed_params:
        prior = WAParams.load(config.seed_params)

    def apply(params: WAParams, class_key: FeatureKey | None) -> None:
        if class_key is not None:
            tagger.set_class_key(class_key)
        queue.set_params(params)

    return WAController(config, cache_blocks, apply, sink, clock=clock, prior=prior)


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
    """

    def __init__(
        self,
        config: ControllerConfig,
        cache_blocks: int,
        apply: Callable[[WAParams, FeatureKey | None], None],
        sink: EventSink,
        clock: Callable[[], float] = time.monotonic,
        prior: WAParams | None = None,
    ) -> None:
        self.config = config
        self.sink = sink
        self.clock = clock
        self.apply = apply
        self.cache_blocks = cache_blocks
        self.prior = prior if prior is not None else WAParams.lru(source="prior")
        rate = sink.sample_rate
        sampled_cache = max(2, int(round(cache_blocks * rate)))
        self._fine_ids: dict[tuple, int] = {}
        self._fine: list[tuple] = []
        self.estimators: list[ReuseEstimator] = []
        self.tracker = ReuseTracker(
            ghost_capacity=int(config.ghost_factor * sampled_cache),
            watch_capacity=2 * sampled_cache + 1024,
            max_watch_s=config.max_watch_s,
            on_reuse=self._on_reuse,
            on_censored=self._on_censored,
        )
        self._shadow_threshold = int(min(1.0, sample_rate_for(cache_blocks, config.shadow_blocks) / rate) * (1 << 64))
        self.shadow_blocks = max(2, int(round(cache_blocks * sample_rate_for(cache_blocks, config.shadow_blocks))))
        self.candidates: dict[str, Candidate] = {}
        for spec in config.all_candidates:
            shadow = ShadowCache(spec, self.shadow_blocks, config.tuner_window_s, config.max_classes)
            key = None if spec.lru else FeatureKey(tuple(spec.features))
            self.candidates[spec.name] = Candidate(spec, shadow, key)
        self.active = config.initial
        self.pinned: WAParams | None = None
        self.params = self.prior
        self.version = 0
        self.refits = 0
        self.swaps = 0
        self.errors = 0
        self.last_error = ""
        self.last_refit: float | None = None
        self.last_swap: float | None = None
        self.refit_seconds = 0.0
        self.events_processed = 0
        self.drift_events: deque[dict[str, Any]] = deque(maxlen=50)
        self.switches: deque[dict[str, Any]] = deque(maxlen=50)
        self._last_forget: float | None = None
        self._last_checkpoint = -math.inf
        self.checkpoint_failures = CheckpointFailures()
        # The state as of the last refit, published for other threads (the
        # engine loop serves /wa/params from it while a refit may be running).
        self.snapshot: dict[str, Any] | None = None

    # ---- event intake ---------------------------------------------------------------------

    def _fine_id(self, comps: tuple) -> int:
        fid = self._fine_ids.get(comps)
        if fid is None:
            if len(self._fine) >= MAX_FINE_CLASSES:
                comps = ("other", comps[1], comps[2], comps[3])
                fid = self._fine_ids.get(comps)
                if fid is not None:
                    return fid
            fid = len(self._fine)
            self._fine_ids[comps] = fid
            self._fine.append(comps)
            self.estimators.append(
                ReuseEstimator(self.config.memory_s, self.config.drift_delta, self.config.drift_forget)
            )
        return fid

    def _on_reuse(self, fid: int, gap: float) -> None:
        if self.estimators[fid].update(gap=gap):
            self.drift_events.append({"time": self.clock(), "class": FINEST.name_of(self._fine[fid])})

    def _on_censored(self, fid: int, exposure: float) -> None:
        self.estimators[fid].update(exposure=exposure)

    def _shadow_hashes(self, hashes: Any) -> list:
        thr = self._shadow_threshold
        if thr >= 1 << 64:
            return [h for _, h in hashes]
        return [h for _, h in hashes if hash_sample_value(h) < thr]

    def process(self, events: list[Any]) -> None:
        """Apply drained engine events in order."""
        tracker = self.tracker
        shadows = [c.shadow for c in self.candidates.values()]
        for ev in events:
            kind = ev.kind
            if kind == EventKind.FREED:
                comps = FINEST.components(ev.tag, ev.outcome, ev.position, ev.reuse_count)
                tracker.freed(ev.block_hash, self._fine_id(comps), ev.time)
            elif kind == EventKind.EVICTED:
                tracker.evicted(ev.block_hash, ev.time)
            elif kind == EventKind.LOOKUP:
                tracker.looked_up(ev.hashes, ev.time)
                hs = self._shadow_hashes(ev.hashes)
                if hs:
                    for s in shadows:
                        s.lookup(ev.request_id, ev.tag, hs, ev.time)
            elif kind == EventKind.FINISHED:
                for s in shadows:
                    s.finish(ev.request_id, ev.outcome, ev.time)
        self.events_processed += len(events)

    # ---- the job ----------------------------------------------------------------------------

    def refit(self) -> None:
        """Drain, learn, tune, swap. Never raises."""
        t0 = time.perf_counter()
        try:
            self._refit(self.clock())
        except Exception as e:  # noqa: BLE001 - the job must keep running
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            logger.exception("vllm-wa controller refit failed; keeping the last good parameters")
        finally:
            self.refit_seconds = time.perf_counter() - t0

    def _refit(self, now: float) -> None:
        self.process(self.sink.drain())
        if self._last_forget is not None:
            for est in self.estimators:
                est.forget(now - self._last_forget)
        self._last_forget = now
        self.tracker.expire(now)
        for cand in self.candidates.values():
            cand.shadow.expire(now, self.config.max_watch_s)
        at_risk = self._at_risk(now)
        for cand in self.candidates.values():
            if cand.spec.lru:
                continue
            cand.params = self._fit_candidate(cand, at_risk)
            cand.shadow.set_params(cand.params)
        self._tune(now)
        self.refits += 1
        self.last_refit = now
        self._swap(now)
        self.snapshot = self.state()
        if self.config.checkpoint_path and now - self._last_checkpoint >= self.config.checkpoint_interval_s:
            self._last_checkpoint = now
            self.save_checkpoint(self.config.checkpoint_path)

    def _at_risk(self, now: float) -> dict[int, SurvivalData]:
        """Blocks still watched, as censored observations at their current exposure."""
        n = len(self.tracker)
        if not n:
            return {}
        arr = np.fromiter((x for e in self.tracker.at_risk(now) for x in e), dtype=np.float64, count=2 * n)
        fids = arr[0::2].astype(np.int64)
        bins = bin_exposures(arr[1::2])
        counts = np.zeros((len(self._fine), NUM_BINS))
        np.add.at(counts, (fids, bins), 1.0)
        return {int(f): SurvivalData(np.zeros(NUM_BINS), counts[f]) for f in np.flatnonzero(counts.sum(axis=1))}

    def _fit_candidate(self, cand: Candidate, at_risk: dict[int, SurvivalData]) -> WAParams:
        spec, key = cand.spec, cand.key
        assert key is not None
        pooled: dict[str, SurvivalData] = {}
        total = SurvivalData()
        for fid, comps in enumerate(self._fine):
            name = key.name_of(comps)
            d = pooled.get(name)
            if d is None:
                d = pooled[name] = SurvivalData()
            d += self.estimators[fid].data
            if fid in at_risk:
                d += at_risk[fid]
        models: dict[str, ReuseModel] = {}
        for name, d in pooled.items():
            total += d
            if d.n_events < self.config.min_samples:
                continue
            m = fit_model(d, spec.family, cand.fits.setdefault(name, FitState()))
            if m is not None:
                models[name] = m
        default = (
            fit_model(total, spec.family, cand.fits.setdefault("\0default", FitState()))
            if total.n_events >= self.config.min_samples
            else None
        )
        if not models:
            return self.prior.evolve(horizon=spec.horizon, mode=spec.mode, source="prior")
        return WAParams(
            models=models,
            default=default or self.prior.default,
            horizon=spec.horizon,
            mode=spec.mode,
            source=f"online:{spec.name}",
        )

    def _tune(self, now: float) -> None:
        cfg = self.config
        if not cfg.tuner_enabled:
            return
        cur = self.candidates[self.active]
        cur_rate = cur.shadow.window.rate
        best = None
        for cand in self.candidates.values():
            h, n = cand.shadow.window.totals()
            if n < cfg.tuner_min_lookups:
                cand.lead_since = None
                continue
            if cand is cur or cand.shadow.window.rate <= cur_rate + cfg.tuner_margin:
                cand.lead_since = None
                continue
            if cand.lead_since is None:
                cand.lead_since = now
            if now - cand.lead_since >= cfg.tuner_hold_s and (
                best is None or cand.shadow.window.rate > best.shadow.window.rate
            ):
                best = cand
        if best is not None:
            self.switches.append(
                {"time": now, "from": self.active, "to": best.spec.name,
                 "from_rate": cur_rate, "to_rate": best.shadow.window.rate}
            )
            self.active = best.spec.name
            best.lead_since = None

    def _swap(self, now: float) -> None:
        cand = self.candidates[self.active]
        if self.pinned is not None:
            params, key = self.pinned, self._pinned_key
        elif cand.spec.lru:
            params, key = WAParams.lru(source="online:lru"), None
        else:
            params, key = self._with_other_classes(cand), cand.key
        self.version += 1
        params = params.evolve(version=self.version)
        self.apply(params, key)
        self.params = params
        self.swaps += 1
        self.last_swap = now

    def _with_other_classes(self, cand: Candidate) -> WAParams:
        """The active candidate's parameters, plus the other candidates' classes.

        Blocks freed under an earlier class key keep their class until they
        leave the queue; class names of different keys never collide, so
        adding every candidate's current models keeps those blocks scored by
        what was learned about them instead of by the default model.
        """
        merged: dict[str, ReuseModel] = {}
        for other in self.candidates.values():
            if other is not cand and not other.spec.lru:
                merged.update(other.params.models)
        if not merged:
            return cand.params
        merged.update(cand.params.models)
        return cand.params.evolve(models=merged)

    # ---- operator control ---------------------------------------------------------------------

    _pinned_key: FeatureKey | None = None

    def pin(self, params: WAParams, features: tuple[str, ...] | None = None) -> None:
        """Run fixed parameters (learning continues); validated by the caller."""
        self._pinned_key = FeatureKey(tuple(features)) if features is not None else FeatureKey(("tag",))
        self.pinned = params.evolve(source="pinned")
        self._swap(self.clock())

    def unpin(self) -> None:
        self.pinned = None
        self._pinned_key = None
        self._swap(self.clock())

    # ---- state ------------------------------------------------------------------------------------

    def class_estimates(self) -> dict[str, dict[str, Any]]:
        """Per-class estimates under the active candidate's key, with sample counts."""
        cand = self.candidates[self.active]
        key = cand.key or FeatureKey(("tag",))
        out: dict[str, dict[str, Any]] = {}
        pooled: dict[str, SurvivalData] = {}
        for fid, comps in enumerate(self._fine):
            name = key.name_of(comps)
            pooled.setdefault(name, SurvivalData())
            pooled[name] += self.estimators[fid].data
        for name, d in sorted(pooled.items()):
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

        return {
            **self.state_light(),
            "classes": self.class_estimates(),
            "candidates": [
                {
                    "name": c.spec.name,
                    "active": c.spec.name == self.active,
                    "sampled_hit_rate": rnd(c.shadow.window.rate),
                    "sampled_lookups": c.shadow.window.totals()[1],
                    "shadow_blocks": self.shadow_blocks,
                }
                for c in self.candidates.values()
            ],
            "drift_events": list(self.drift_events),
            "switches": list(self.switches),
            "last_refit": rnd(self.last_refit),
            "last_swap": rnd(self.last_swap),
            "last_error": self.last_error,
            "checkpoint_errors": self.checkpoint_failures.count,
            "last_checkpoint_error": self.checkpoint_failures.last_error,
            "refit_seconds": rnd(self.refit_seconds),
            "events_processed": self.events_processed,
            "events_dropped": self.sink.dropped,
            "watched_blocks": len(self.tracker.watch),
            "ghost_blocks": len(self.tracker.ghost),
            "sample_rate": self.sink.sample_rate,
        }

    # ---- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, path: str) -> bool:
        """Write a checkpoint (atomically); a failure is counted, never raised."""
        ckpt = Checkpoint(
            self.active,
            self.params,
            tuple((comps, self.estimators[fid].data) for fid, comps in enumerate(self._fine)),
        )
        try:
            write_checkpoint(path, ckpt)
        except (OSError, ValueError) as e:
            self.checkpoint_failures.record(path, e)
            return False
        return True

    def load_checkpoint(self, path: str) -> bool:
        """Warm-start from a checkpoint; whatever the file holds, a bad one gives a warning and the prior."""
        try:
            ckpt = read_checkpoint(path, max_classes=MAX_FINE_CLASSES)
        except CheckpointError as e:
            logger.warning("vllm-wa: ignoring checkpoint %s (%s); starting from the prior", path, e)
            return False
        except Exception:  # noqa: BLE001 - never fail the engine's start over a checkpoint
            logger.exception("vllm-wa: ignoring checkpoint %s (unexpected error); starting from the prior", path)
            return False
        if ckpt is None:
            return False
        for comps, d in ckpt.classes:
            fid = self._fine_id(comps)
            self.estimators[fid].data = d
        if ckpt.active in self.candidates:
            self.active = ckpt.active
        self.params = ckpt.params
        self.version = max(self.version, ckpt.params.version)
        return True

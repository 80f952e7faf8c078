"""The engine-core side of ``--wa-online``: queue, controller and utility calls.

``install()`` wraps ``Scheduler.__init__`` so that, once vLLM has built the
scheduler's KV-cache manager, the workload-aware queue replaces the block
pool's free queue and the controller starts on an apscheduler background
thread.  It also adds the ``wa_*`` methods that the API server reaches through
vLLM's utility-call channel (they run on the engine loop, between steps).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from vllm import envs

from vllm_wa.controller.controller import WAController, start_online
from vllm_wa.controller.features import FeatureKey
from vllm_wa.engine_patch.block_tagger import MAX_LATE_FACT_ID, OUTCOMES
from vllm_wa.engine_patch.compat import check_vllm_version
from vllm_wa.engine_patch.conversations import ConversationTracker
from vllm_wa.engine_patch.events import EventSink
from vllm_wa.engine_patch.install import WAHandle, install_wa_queue
from vllm_wa.params import WAParams
from vllm_wa.serving import faults
from vllm_wa.serving.pin_request import PinRequestError, parse_pin_request
from vllm_wa.serving.settings import MAX_OUTCOME_REPORTS_PER_CALL, ServingSettings
from vllm_wa.workload_classes import DEFAULT_ID, ClassRegistry

logger = logging.getLogger(__name__)
_WRAPPED = "__vllm_wa_wrapped__"
_ATTR = "_vllm_wa_engine"
_N_PREFIX = re.compile(r"^\d+_")
_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def external_request_id(engine_request_id: str) -> str:
    """The API server's id of an engine request: drop ``{i}_`` and ``-<8 hex>``."""
    return _SUFFIX.sub("", _N_PREFIX.sub("", engine_request_id))


def api_request_id(engine_request_id: str) -> str:
    """The API call an engine request belongs to: drop ``{i}_`` (an ``n > 1``
    request's children), keep vLLM's random ``-<8 hex>``, which tells apart
    two calls that sent the same id."""
    return _N_PREFIX.sub("", engine_request_id)


def match_api_reports(tagger: Any) -> None:
    """Have ``tagger`` file releases under the ids the API server reports late
    outcomes by, telling apart calls that sent the same id.

    With ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` (deprecated in vLLM) the
    engine's id is the client's own, so a client id ending in ``-<8 hex>``
    keeps that ending.
    """
    tagger.request_key = api_request_id if envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION else external_request_id
    tagger.request_group = api_request_id


@dataclass
class EngineWA:
    """What ``--wa-online`` runs inside one engine core."""

    handle: WAHandle
    controller: WAController
    scheduler: Any
    settings: ServingSettings
    engine_index: int
    block_size: int
    invalid_reports: int = 0
    # Reports past a call's first MAX_OUTCOME_REPORTS_PER_CALL, not applied.
    reports_over_limit: int = 0
    # When this engine core started and how many snapshots it has served:
    # together, how fresh a copy of its metrics is (see shared_metrics).
    started_at: float = field(default_factory=time.time)
    snapshots_served: int = 0

    def stop(self) -> None:
        try:
            self.scheduler.shutdown(wait=False)
        except Exception:  # noqa: BLE001
            pass


def _attach(sched: Any) -> None:
    settings = ServingSettings.from_env()
    manager = getattr(sched, "kv_cache_manager", None)
    if manager is None or not getattr(manager, "enable_caching", False):
        logger.warning("vllm-wa: prefix caching is off; --wa-online has nothing to do")
        return
    cfg = settings.controller_config()
    prior = WAParams.load(settings.params_path, max_classes=cfg.max_classes) if settings.params_path else None
    pool = manager.block_pool
    handles: list[WAHandle] = []

    def install(
        sink: EventSink, registry: ClassRegistry, key: FeatureKey, conversations: ConversationTracker
    ) -> tuple[Any, Any]:
        h = install_wa_queue(pool, prior, sink=sink, registry=registry, class_key=key, conversations=conversations)
        match_api_reports(h.tagger)
        handles.append(h)
        return h.queue, h.tagger

    controller = start_online(cfg, pool.num_gpu_blocks, install, prior=prior)
    faults.install_from_env(controller)
    handle = handles[0]
    if cfg.checkpoint_path:
        controller.load_checkpoint(cfg.checkpoint_path)
    from apscheduler.schedulers.background import BackgroundScheduler

    bg = BackgroundScheduler(daemon=True)
    bg.add_job(
        controller.refit,
        "interval",
        seconds=cfg.refit_interval_s,
        id="vllm-wa-refit",
        max_instances=1,
        coalesce=True,
        misfire_grace_time=None,
    )
    bg.start()
    vllm_config = getattr(sched, "vllm_config", None)
    index = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_index", 0) or 0
    block_size = manager.coordinator.single_type_managers[0].block_size
    ewa = EngineWA(handle, controller, bg, settings, int(index), int(block_size))
    setattr(sched, _ATTR, ewa)
    # One engine core builds one scheduler; one built again (vLLM rebuilding
    # its engine) leaves the earlier controller nothing to serve: its refit
    # job stops instead of running on beside the new one for good.
    previous = _current.pop() if _current else None
    if previous is not None:
        previous.stop()
        logger.info("vllm-wa: a new scheduler replaced the one the earlier controller served; stopped that one")
    _current.append(ewa)
    logger.info(
        "vllm-wa: online controller started (engine %s, %d blocks, sample rate %.4f, refit every %gs)",
        index, pool.num_gpu_blocks, controller.sink.sample_rate, cfg.refit_interval_s,
    )


# The controller attached last in this process (at most one).
_current: list[EngineWA] = []


def _wrap_scheduler_init(orig: Any) -> Any:
    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        _attach(self)

    setattr(__init__, _WRAPPED, orig)
    return __init__


def _engine_wa(core: Any) -> EngineWA | None:
    return getattr(getattr(core, "scheduler", None), _ATTR, None)


# ---- utility methods (bound onto vLLM's EngineCore) -------------------------------------------


def wa_get_state(self: Any) -> dict[str, Any]:
    ewa = _engine_wa(self)
    if ewa is None:
        return {"enabled": False}
    c = ewa.controller
    state = dict(c.snapshot or {})
    state.update(c.state_light())  # current mode and parameters, even between refits
    state.update(_live_counters(ewa))
    state["engine"] = ewa.engine_index
    state["pid"] = os.getpid()
    state["enabled"] = True
    state["pin_allowed"] = ewa.settings.allow_pin
    return state


def wa_set_params(self: Any, body: dict[str, Any]) -> dict[str, Any]:
    """Pin parameters (``{"params": <PR json>, "features": [...]}``) or ``{"mode": "auto"}``."""
    ewa = _engine_wa(self)
    if ewa is None:
        # (Prefix caching off, which vLLM decides for some models: nothing to pin.)
        return {"ok": False, "error": "vllm-wa is not enabled on this engine", "status": 409}
    if not ewa.settings.allow_pin:
        return {"ok": False, "error": "pinning is disabled (start with --wa-allow-pin)", "status": 403}
    try:
        params, features = parse_pin_request(body, max_classes=ewa.handle.registry.max_classes)
    except PinRequestError as e:
        return {"ok": False, "error": str(e), "status": e.status}
    if params is None:
        ewa.controller.unpin()
    else:
        ewa.controller.pin(params, features)
    return {"ok": True, "engine": ewa.engine_index, "mode": "pinned" if params else "auto",
            "params_version": ewa.controller.version}


def _valid_reports(ewa: Any, items: Any) -> list[tuple[str, str]]:
    """The well-formed ``[external_request_id, outcome]`` items of one call (the rest counted)."""
    if not isinstance(items, list):
        return []
    ewa.reports_over_limit += max(0, len(items) - MAX_OUTCOME_REPORTS_PER_CALL)
    out = []
    for item in items[:MAX_OUTCOME_REPORTS_PER_CALL]:
        if not (
            isinstance(item, (list, tuple))
            and len(item) == 2
            and isinstance(item[0], str)
            and len(item[0]) <= MAX_LATE_FACT_ID  # no release is remembered under a longer id
            and item[1] in OUTCOMES
        ):
            ewa.invalid_reports += 1
            continue
        out.append((item[0], item[1]))
    return out


def wa_report_outcomes(self: Any, items: list[Any]) -> int:
    """Late facts from the API server: ``[[external_request_id, outcome], ...]``; the blocks moved.

    The API server reports a reply once it has it, so the engine that served
    the call has released it already; every engine core gets every report
    (data parallel), and one that has released no call under the id keeps
    nothing: kept, it would re-file the next call a client sends under the
    same id there.  (Facts sent before their call are ``wa_expect_outcomes``.)
    """
    ewa = _engine_wa(self)
    if ewa is None:
        return 0
    tagger = ewa.handle.tagger
    return sum(tagger.reclassify(rid, outcome, pending=False) for rid, outcome in _valid_reports(ewa, items))


def wa_expect_outcomes(self: Any, items: list[Any]) -> int:
    """Benchmark outcome hints, sent before their requests: each applies to the
    next call released under its id, never to an earlier one (``BlockTagger.expect_outcome``).
    Returns the hints kept."""
    ewa = _engine_wa(self)
    if ewa is None:
        return 0
    valid = _valid_reports(ewa, items)
    for rid, outcome in valid:
        ewa.handle.tagger.expect_outcome(rid, outcome)
    return len(valid)


def wa_get_metrics(self: Any) -> dict[str, Any]:
    ewa = _engine_wa(self)
    if ewa is None:
        return {"enabled": False}
    c = ewa.controller
    reg = ewa.handle.registry
    q = ewa.handle.queue
    t = ewa.handle.tagger
    bs = ewa.block_size
    params = c.params
    # Rows only for classes in use (_classes_in_use), and no fitted values
    # for a class the active parameters leave to the default model.
    classes: dict[str, dict[str, Any]] = {}
    for cid in _classes_in_use(ewa.handle):
        name = reg.name_of(cid)
        row: dict[str, Any] = {
            "evictions": q.counters.evicted[cid],
            "reuses": q.counters.reused[cid],
            "freed": q.counters.freed[cid],
        }
        m = params.models.get(name)
        if m is not None:
            row["reuse_rate"] = m.a
            row["reuse_probability"] = m.p
        classes[name] = row
    tags = {
        t.tags.name_of(tid): {
            "hit_tokens": t.hit_blocks_by_tag[tid] * bs,
            "queried_tokens": t.queried_tokens_by_tag[tid],
        }
        for tid in t.tags.used_ids()
    }
    out = {
        "enabled": True,
        "engine": ewa.engine_index,
        "classes": classes,
        "tags": tags,
        "params_version": c.version,
        "swaps": c.swaps,
        "refits": c.refits,
        "errors": c.errors,
        "refit_seconds": c.refit_seconds,
        "pinned": c.pinned is not None,
    }
    out.update(_live_counters(ewa))
    out.update(_calibration(c.snapshot))
    out.update(_tuner(c.snapshot))
    return out


def _calibration(snapshot: dict[str, Any] | None) -> dict[str, Any]:
    """The running candidate's prediction and the real cache's hit ratio on the
    same sampled blocks over the tuner's window, as of the last refit (absent
    before any sampled lookup)."""
    if not snapshot:
        return {}
    window = (snapshot.get("calibration") or {}).get("window") or {}
    cal = window.get(snapshot.get("active_candidate"))
    if not cal or not cal.get("lookups"):
        return {}
    return {"sampled_real_hit_ratio": cal["real_hit_rate"], "sampled_predicted_hit_ratio": cal["predicted_hit_rate"]}


# Per candidate, what its miniature cache could not measure (controller state).
SHADOW_COUNTERS = ("shadow_overflow", "shadow_lost_finishes", "shadow_expired")


def _tuner(snapshot: dict[str, Any] | None) -> dict[str, Any]:
    """The tuner's switches by reason, and per candidate its seconds run,
    whether it is the tuner's choice and its miniature cache's losses, as of
    the last refit (absent before it).  Candidates come from the controller config: a bounded label set."""
    if not snapshot:
        return {}
    demotions = snapshot.get("demotions", 0)
    real_check = snapshot.get("real_check_demotions", 0)
    switches = {
        "promote": snapshot.get("promotions", 0),
        "demote": demotions - real_check,  # each switch counted once, under its own reason
        "real-check": real_check,
        "replace": snapshot.get("replacements", 0),
    }
    active = snapshot.get("active_candidate")
    seconds = snapshot.get("seconds_on_candidate") or {}
    shadow = {c.get("name"): c for c in snapshot.get("candidates") or () if isinstance(c, dict)}
    return {
        "tuner_switches": {reason: {"count": n} for reason, n in switches.items()},
        "candidates": {
            name: {
                "seconds": s,
                "active": int(name == active),
                **{k: shadow.get(name, {}).get(k) for k in SHADOW_COUNTERS},
            }
            for name, s in seconds.items()
        },
    }


def _classes_in_use(handle: WAHandle) -> list[int]:
    """The class ids the metrics report: names claimed by a release (no
    reserved name before it is used, no tag posing as a class), and the
    default class once a block went there, since a block freed without a
    release (a sliding window's, mid-request) is filed there even if no
    request was untagged."""
    used = handle.registry.used_ids()
    counters = handle.queue.counters
    if DEFAULT_ID not in used and (counters.freed[DEFAULT_ID] or counters.evicted[DEFAULT_ID]):
        used.insert(0, DEFAULT_ID)
    return used


def _live_counters(ewa: EngineWA) -> dict[str, Any]:
    t = ewa.handle.tagger
    return {
        "events_dropped": ewa.controller.sink.dropped,
        "events_bad_time": ewa.controller.events_bad_time,
        "events_failed": ewa.controller.events_failed,
        "checkpoint_errors": ewa.controller.checkpoint_failures.count,
        "checkpoint_trims": ewa.controller.checkpoint_failures.trims,
        "finest_classes_retired": ewa.controller.finest_retired,
        "finest_folded": ewa.controller.finest_folded,
        "finest_classes": ewa.controller.finest_classes,
        "hook_errors": ewa.handle.hook_errors,
        "tags_missing": t.tag_counters.missing,
        "tags_invalid": t.tag_counters.invalid,
        "tags_over_class_cap": t.tag_counters.over_cap,
        "releases_over_class_cap": t.releases_over_class_cap,
        "refiles_over_class_cap": t.refiles_over_class_cap,
        "long_request_ids": t.long_request_ids,
        "outcomes_reclassified": t.reclassified_requests,
        "invalid_outcome_reports": ewa.invalid_reports,
        "outcome_reports_dropped": ewa.reports_over_limit,
        "num_classes": len(_classes_in_use(ewa.handle)),
        "num_tags": len(t.tags.used_ids()),
    }


def wa_get_snapshot(self: Any) -> dict[str, Any]:
    """State and metrics in one call: what the API server's poller fetches once per interval.

    The controller state is the snapshot the last refit published (built on
    the controller's thread), plus a few live counters; everything else is
    bounded by the class caps, so the cost on the engine loop is small and
    does not depend on how often clients read ``/wa/params``.
    """
    ewa = _engine_wa(self)
    if ewa is None:
        return {"enabled": False}
    ewa.snapshots_served += 1
    metrics = wa_get_metrics(self)
    metrics["freshness"] = [ewa.started_at, ewa.snapshots_served]
    return {"enabled": True, "state": wa_get_state(self), "metrics": metrics}


_UTILITIES = {
    "wa_get_snapshot": wa_get_snapshot,
    "wa_set_params": wa_set_params,
    "wa_report_outcomes": wa_report_outcomes,
    "wa_expect_outcomes": wa_expect_outcomes,
}


def install() -> None:
    """Engine-side patches (idempotent); only called when ``--wa-online`` is set."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    check_vllm_version()
    if getattr(Scheduler.__init__, _WRAPPED, None) is None:
        Scheduler.__init__ = _wrap_scheduler_init(Scheduler.__init__)
    for name, fn in _UTILITIES.items():
        if not hasattr(EngineCore, name):
            setattr(EngineCore, name, fn)

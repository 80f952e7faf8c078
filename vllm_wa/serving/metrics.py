"""``vllm_wa_*`` metrics on vLLM's own ``/metrics``, from the API server's engine snapshots.

A ``prometheus_client`` custom collector: every scrape renders the latest
snapshots (see :mod:`vllm_wa.serving.snapshots`), so

* the engine's running totals are exported as counters (they only grow; an
  engine restart starts them again from zero, which ``rate()`` handles);
* a class or tag that retired, or a class whose parameters fell back to the
  default model, simply has no series any more: nothing keeps a stale value.

Series are labelled by ``engine`` (the data-parallel rank) and ``class``
(eviction class) or ``tag`` (workload tag, for hit accounting), both sets
bounded by the class caps, or by the tuner's ``candidate`` (from the
controller config) or switch ``reason`` (four).  vLLM serves ``/metrics`` from the global
registry, or, with several API servers, from a fresh multiprocess registry
per scrape: :func:`install` puts the collector in both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_WRAPPED = "__vllm_wa_wrapped__"

# snapshot key -> (metric name without _total, help)
ENGINE_COUNTERS = {
    "swaps": ("vllm_wa_param_swaps", "Parameter swaps into the live queue."),
    "refits": ("vllm_wa_refits", "Controller refits."),
    "errors": ("vllm_wa_controller_errors", "Controller refits that failed (last good parameters kept)."),
    "checkpoint_errors": ("vllm_wa_checkpoint_errors", "Checkpoint writes that failed."),
    "checkpoint_trims": (
        "vllm_wa_checkpoint_trims",
        "Checkpoint writes that left out their smallest drift cuts or classes to stay within the reader's size cap.",
    ),
    "events_dropped": ("vllm_wa_events_dropped", "Engine events dropped because the event sink was full."),
    "events_bad_time": ("vllm_wa_events_bad_time", "Engine events the controller skipped: their time was NaN or infinite."),
    "finest_classes_retired": (
        "vllm_wa_finest_classes_retired",
        "Controller finest classes (feature-bucket combinations) given back after going unused for class_retire_s.",
    ),
    "finest_folded": (
        "vllm_wa_finest_folded_observations",
        "Watched block releases the controller filed under a coarser class because its finest-class table was full "
        "(a late outcome's re-file of a released block is not another release).",
    ),
    "events_failed": (
        "vllm_wa_events_failed",
        "Engine events whose handling raised in the controller; skipped, the rest of their batch applied.",
    ),
    "hook_errors": ("vllm_wa_hook_errors", "Errors caught in the engine hooks."),
    "long_request_ids": (
        "vllm_wa_long_request_ids",
        "Finished requests not remembered for late outcome reports: their id was over 256 characters.",
    ),
    "tags_missing": ("vllm_wa_missing_tags", "Requests without a workload tag."),
    "tags_invalid": ("vllm_wa_invalid_tags", "Requests whose workload tag was invalid (or a reserved name)."),
    "tags_over_class_cap": ("vllm_wa_tags_over_class_cap", "Requests whose new tag found the tag registry full."),
    "releases_over_class_cap": (
        "vllm_wa_releases_over_class_cap",
        "Block releases filed under 'other' because the eviction-class registry was full.",
    ),
    "refiles_over_class_cap": (
        "vllm_wa_refiles_over_class_cap",
        "Reported outcomes whose refiled blocks went to 'other' because the eviction-class registry was full.",
    ),
    "outcomes_reclassified": (
        "vllm_wa_outcomes_reclassified",
        "Requests whose blocks a reported reply outcome (a tool call, a hint) re-filed.",
    ),
    "invalid_outcome_reports": ("vllm_wa_invalid_outcome_reports", "Outcome reports refused as malformed."),
    "outcome_reports_dropped": (
        "vllm_wa_outcome_reports_dropped",
        "Outcome reports an engine received past one call's limit, not applied.",
    ),
}
ENGINE_GAUGES = {
    "params_version": ("vllm_wa_params_version", "Version of the parameters the queue runs."),
    "refit_seconds": ("vllm_wa_refit_duration_seconds", "Wall time of the last controller refit."),
    "num_classes": ("vllm_wa_classes", "Eviction classes in use."),
    "num_tags": ("vllm_wa_tags", "Workload tags in use."),
    "finest_classes": ("vllm_wa_finest_classes", "Finest classes the controller keeps reuse statistics for."),
    "sampled_real_hit_ratio": (
        "vllm_wa_sampled_real_hit_ratio",
        "Real cache's hit ratio on the miniature caches' sampled blocks while the running candidate ran (tuner window).",
    ),
    "sampled_predicted_hit_ratio": (
        "vllm_wa_sampled_predicted_hit_ratio",
        "The running candidate's miniature-cache hit ratio on the same sampled blocks (tuner window).",
    ),
}
CLASS_COUNTERS = {
    "evictions": ("vllm_wa_evicted_blocks", "Cached blocks of the class evicted from the free queue."),
    "reuses": ("vllm_wa_reused_blocks", "Free blocks of the class taken back by a prefix hit."),
    "freed": ("vllm_wa_freed_blocks", "Blocks freed into the class (or re-filed into it by a late outcome)."),
}
CLASS_GAUGES = {
    "reuse_rate": ("vllm_wa_reuse_rate", "Fitted exponential reuse rate of the class (1/s); absent for the default."),
    "reuse_probability": (
        "vllm_wa_reuse_probability",
        "Fitted probability that a freed block of the class is reused; absent for the default.",
    ),
}
# The tuner's switches, labelled by ``reason``: promote, demote, real-check, replace.
SWITCH_COUNTERS = {
    "count": (
        "vllm_wa_tuner_switches",
        (
            "Changes of the tuner's running candidate, by reason (promote, demote: back to LRU, "
            "real-check: back to LRU on the real cache's hits, replace)."
        ),
    ),
}
# Per configured ``candidate``.
CANDIDATE_COUNTERS = {
    "seconds": ("vllm_wa_tuner_candidate_seconds", "Seconds the tuner has run each candidate (as of the last refit)."),
    "shadow_overflow": (
        "vllm_wa_tuner_shadow_overflow_requests",
        "Sampled requests whose blocks did not fit in the candidate's miniature cache (measured as misses).",
    ),
    "shadow_lost_finishes": (
        "vllm_wa_tuner_shadow_lost_finishes",
        "Requests the candidate's miniature cache released unfinished because it held too many (finishes lost).",
    ),
    "shadow_expired": (
        "vllm_wa_tuner_shadow_expired_requests",
        "Requests the candidate's miniature cache released after max_watch_s without their finish.",
    ),
}
CANDIDATE_GAUGES = {
    "active": (
        "vllm_wa_tuner_active",
        "1 for the candidate the tuner runs (the live queue runs it unless parameters are pinned), 0 for the others.",
    ),
}
TAG_COUNTERS = {
    "hit_tokens": ("vllm_wa_prefix_cache_hit_tokens", "Prompt tokens that hit the prefix cache, by workload tag."),
    "queried_tokens": ("vllm_wa_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache, by workload tag."),
}


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class WACollector:
    """Renders the engines' latest metrics; ``source()`` returns the snapshots (or None)."""

    def __init__(self, source: Callable[[], list[dict[str, Any]] | None]) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []  # names depend on nothing at registration; collect() says what exists

    def collect(self) -> Iterator[Metric]:
        engines = [e for e in (self.source() or []) if isinstance(e, dict) and e.get("enabled")]
        metrics = [(str(e.get("metrics", {}).get("engine", i)), e.get("metrics", {})) for i, e in enumerate(engines)]
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield self._family(CounterMetricFamily, name, doc, ["engine"], ((m.get(key), (eng,)) for eng, m in metrics))
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield self._family(GaugeMetricFamily, name, doc, ["engine"], ((m.get(key), (eng,)) for eng, m in metrics))
        for group, table, kind, label in (
            ("classes", CLASS_COUNTERS, CounterMetricFamily, "class"),
            ("classes", CLASS_GAUGES, GaugeMetricFamily, "class"),
            ("tags", TAG_COUNTERS, CounterMetricFamily, "tag"),
            ("tuner_switches", SWITCH_COUNTERS, CounterMetricFamily, "reason"),
            ("candidates", CANDIDATE_COUNTERS, CounterMetricFamily, "candidate"),
            ("candidates", CANDIDATE_GAUGES, GaugeMetricFamily, "candidate"),
        ):
            for key, (name, doc) in table.items():
                rows = (
                    (row.get(key), (str(cls), eng))
                    for eng, m in metrics
                    for cls, row in (m.get(group) or {}).items()
                    if isinstance(row, dict)
                )
                yield self._family(kind, name, doc, [label, "engine"], rows)

    @staticmethod
    def _family(kind: type, name: str, doc: str, labels: list[str], rows: Any) -> Metric:
        fam = kind(name, doc, labels=labels)
        for value, label_values in rows:
            v = _number(value)
            if v is not None:
                fam.add_metric(list(label_values), v)
        return fam


def install(collector: WACollector) -> None:
    """Put ``collector`` in every registry ``/metrics`` is rendered from, in this process (idempotent).

    One API server: vLLM and its instrumentator render the global registry.
    Several API servers (``--api-server-count``, data parallelism): vLLM sets
    ``PROMETHEUS_MULTIPROC_DIR``, and ``/metrics`` renders a registry built
    per scrape around a ``MultiProcessCollector`` (by vLLM's
    ``get_prometheus_registry`` and by the instrumentator's handler), so the
    collector joins each registry such a collector is built for.
    """
    from prometheus_client import REGISTRY, multiprocess

    if collector not in REGISTRY._collector_to_names:
        REGISTRY.register(collector)
    cls = multiprocess.MultiProcessCollector
    current = cls.__init__
    if getattr(current, _WRAPPED, None) is not None:
        return

    @functools.wraps(current)
    def __init__(self: Any, registry: Any, *args: Any, **kwargs: Any) -> None:
        current(self, registry, *args, **kwargs)
        if registry is not None and collector not in getattr(registry, "_collector_to_names", {}):
            registry.register(collector)

    setattr(__init__, _WRAPPED, current)
    cls.__init__ = __init__

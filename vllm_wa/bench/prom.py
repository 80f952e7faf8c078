"""The server counters a benchmark run compares before and after: vLLM's and ``vllm_wa_``'s.

Parsed from the Prometheus text of ``GET /metrics``, summed over engines
(one API server with data parallelism exports one series per engine).  Each
series is also kept on its own, so the growth between two scrapes is taken
per series: a series that fell was reset (its engine restarted) and has grown
by its new value, as Prometheus' ``increase()`` counts it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# vLLM 0.32's names (prometheus_client adds ``_total`` to counters).
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREEMPTIONS = "vllm:num_preemptions_total"
REQUEST_SUCCESS = "vllm:request_success_total"
CACHE_CONFIG = "vllm:cache_config_info"


@dataclass
class MetricsSnapshot:
    """What one scrape of ``/metrics`` says, as far as the benchmark cares."""

    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    preemptions: float = 0.0
    finished: dict[str, float] = field(default_factory=dict)  # by finished_reason
    cache_config: dict[str, str] = field(default_factory=dict)  # labels of vllm:cache_config_info (engine 0)
    wa: dict[str, float] = field(default_factory=dict)  # every vllm_wa_ sample, "name{labels}" -> value
    # The vLLM counters above, one value a series: "name{labels}" -> value.
    counters: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MetricsSnapshot:
        return cls(**{k: d[k] for k in asdict(cls()) if k in d})

    def minus(self, before: MetricsSnapshot) -> dict[str, Any]:
        """Growth of the counters since ``before`` (gauges of ``vllm_wa_`` running totals included).

        Taken series by series, a reset series counting from zero; a snapshot
        written before the series were kept falls back to the sums.
        """
        wa = _growth({k: v for k, v in self.wa.items() if k.split("{")[0].endswith("_total")}, before.wa)
        if self.counters and before.counters:
            grown = _growth(self.counters, before.counters)
            by_name: dict[str, float] = {}
            finished: dict[str, float] = {}
            for k, v in grown.items():
                name = k.split("{")[0]
                by_name[name] = by_name.get(name, 0.0) + v
                if name == REQUEST_SUCCESS:
                    reason = _label(k, "finished_reason")
                    finished[reason] = finished.get(reason, 0.0) + v
            return {
                "prefix_cache_queries": by_name.get(PREFIX_QUERIES, 0.0),
                "prefix_cache_hits": by_name.get(PREFIX_HITS, 0.0),
                "preemptions": by_name.get(PREEMPTIONS, 0.0),
                "finished": finished,
                "wa": {k: v for k, v in wa.items() if v},
            }
        return {
            "prefix_cache_queries": self.prefix_cache_queries - before.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits - before.prefix_cache_hits,
            "preemptions": self.preemptions - before.preemptions,
            "finished": {k: v - before.finished.get(k, 0.0) for k, v in self.finished.items()},
            "wa": {k: v for k, v in wa.items() if v},
        }


def _growth(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Each series' growth; one that fell was reset and grew by its new value."""
    out = {}
    for k, v in after.items():
        b = before.get(k, 0.0)
        out[k] = v if v < b else v - b
    return out


def _label(series: str, name: str) -> str:
    """A label's value in a ``name{k="v",...}`` series key ("" when absent)."""
    key = f'{name}="'
    i = series.find(key)
    if i < 0:
        return ""
    j = series.find('"', i + len(key))
    return series[i + len(key) : j]


def _series(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse the Prometheus text format; unknown series are ignored, a malformed text raises ``ValueError``."""
    from prometheus_client.parser import text_string_to_metric_families

    snap = MetricsSnapshot()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, value = s.name, s.labels, float(s.value)
            if name in (PREFIX_QUERIES, PREFIX_HITS, PREEMPTIONS, REQUEST_SUCCESS):
                snap.counters[_series(name, labels)] = value
            if name == PREFIX_QUERIES:
                snap.prefix_cache_queries += value
            elif name == PREFIX_HITS:
                snap.prefix_cache_hits += value
            elif name == PREEMPTIONS:
                snap.preemptions += value
            elif name == REQUEST_SUCCESS:
                reason = labels.get("finished_reason", "")
                snap.finished[reason] = snap.finished.get(reason, 0.0) + value
            elif name == CACHE_CONFIG and labels.get("engine", "0") == "0":
                snap.cache_config = dict(labels)
            elif name.startswith("vllm_wa_"):
                snap.wa[_series(name, labels)] = value
    return snap

"""This API server's own ``vllm_wa_api_*`` counters: outcome reports and benchmark hints.

The engines' counters reach ``/metrics`` through their snapshots
(:mod:`vllm_wa.serving.metrics`); what happens only in an API server (a reply
outcome reported to the engines or lost on the way, a benchmark hint applied
or ignored) is counted here, with plain ``prometheus_client`` counters.  With
one API server vLLM renders the global registry; with several
(``--api-server-count``, ``PROMETHEUS_MULTIPROC_DIR`` set) each process writes
its values to the shared directory and the multiprocess collector sums them,
so a scrape counts every API server's reports, whichever answers it.

They live in a module of their own so that the modules that count
(``api_side``, ``outcome_hints``) need not import each other.  They are
created by the first :func:`api_counters` call (``api_side.install``, at
start-up, so the series exist from zero): a server without ``--wa-online``
has none.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from prometheus_client import Counter


@dataclass(frozen=True)
class ApiCounters:
    """The labelled children, one per thing counted."""

    reports_sent: Counter
    reports_dropped: Counter
    hints_applied: Counter
    hints_ignored: Counter


@functools.cache
def api_counters() -> ApiCounters:
    """This process's counters, registered in the global registry on first use."""
    reports = Counter(
        "vllm_wa_api_outcome_reports",
        "Reply outcomes this API server sent to the engines (a reply that called a tool; with "
        "--wa-bench-outcome-hints, also each hint's facts), or lost (the report buffer was full, "
        "or the engines refused a call).",
        ["result"],
    )
    hints = Counter(
        "vllm_wa_api_outcome_hints",
        "Benchmark outcome hints (--wa-bench-outcome-hints) delivered to the engines, "
        "or ignored (a bad value, or not delivered).",
        ["result"],
    )
    return ApiCounters(
        reports_sent=reports.labels("sent"),
        reports_dropped=reports.labels("dropped"),
        hints_applied=hints.labels("applied"),
        hints_ignored=hints.labels("ignored"),
    )

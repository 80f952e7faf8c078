"""Summaries, the side-by-side table and the plot of benchmark runs."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from vllm_wa.bench.prom import MetricsSnapshot
from vllm_wa.bench.results import RunResult

PERCENTILES = (50, 90, 99)
# A run whose last request went out more than this much later than the trace
# schedules it (as a ratio of run lengths) did not replay the trace's
# interleaving: the closed loop stretched it by the server's lag.
STRETCH_WARN = 1.1
# Nor did one whose requests went out late by more than this share of the
# trace's span at the 90th percentile: a burst the server could not keep up
# with, followed by a lull that let the last request go out on time.
LAG_WARN_SHARE = 0.1


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def distribution(xs: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": percentile(xs, q) for q in PERCENTILES}
    out["mean"] = sum(xs) / len(xs) if xs else None
    out["n"] = len(xs)
    return out


def candidate_seconds(before: list[dict[str, Any]] | None, after: list[dict[str, Any]] | None) -> tuple[dict[str, float], str]:
    """Seconds each controller candidate ran during the run, summed over engines, and how they were found.

    Read from ``seconds_on_candidate`` in ``GET /wa/params`` (a running total
    per engine); without it, derived from the ``switches`` log and the active
    candidate before and after.
    """
    if not after:
        return {}, "none"
    before = before or []
    by_engine = {e.get("engine", i): e for i, e in enumerate(before)}
    total: Counter[str] = Counter()
    source = "seconds_on_candidate"
    for i, e in enumerate(after):
        b = by_engine.get(e.get("engine", i), {})
        now = e.get("seconds_on_candidate")
        if isinstance(now, dict):
            was = b.get("seconds_on_candidate") or {}
            for name, v in now.items():
                total[name] += max(0.0, float(v) - float(was.get(name, 0.0)))
            continue
        source = "switches"
        t_start, t_end = b.get("last_refit"), e.get("last_refit")
        active = b.get("active_candidate") or e.get("active_candidate") or "?"
        if t_start is None or t_end is None:
            continue
        t = float(t_start)
        for sw in e.get("switches") or []:
            ts = float(sw.get("time", t))
            if ts <= t_start:
                continue
            total[active] += ts - t
            t, active = ts, sw.get("to", active)
        total[active] += max(0.0, float(t_end) - t)
    return dict(total), source


def summarize(res: RunResult) -> dict[str, Any]:
    recs = res.requests
    ok = [r for r in recs if r.ok]
    failed = [r for r in recs if not r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    before = MetricsSnapshot.from_json(res.metrics_before) if res.metrics_before else None
    after = MetricsSnapshot.from_json(res.metrics_after) if res.metrics_after else None
    server = after.minus(before) if before and after else {}
    secs, secs_source = candidate_seconds(res.wa_before, res.wa_after)
    on_total = sum(secs.values())
    errors = Counter((r.error or "no reply")[:80] for r in failed)
    wall = res.wall_s or 0.0
    sent = [r for r in recs if r.sent is not None and r.scheduled is not None]
    scale = res.time_scale if res.time_scale > 0 else 1.0
    last_scheduled = max((r.scheduled for r in sent), default=0.0)
    return {
        "label": res.label,
        "cache_blocks": (res.server or {}).get("num_gpu_blocks"),
        "requests": len(recs),
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(errors.most_common(5)),
        "excluded_too_long": res.excluded_too_long,
        "interrupted": res.interrupted,
        "stop_reason": res.stop_reason,
        # Prefix-cache queries the server had counted before the run: a used
        # server's cache may already hold this trace's prompts.
        "queries_before_run": before.prefix_cache_queries if before else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_tokens_reported": sum(1 for r in ok if r.cached_tokens is not None),
        "token_hit_rate": cached / prompt if prompt else None,
        "server": server,
        "server_token_hit_rate": (
            server["prefix_cache_hits"] / server["prefix_cache_queries"] if server.get("prefix_cache_queries") else None
        ),
        "ttft_ms": distribution([r.server_ttft_ms for r in ok if r.server_ttft_ms is not None]),
        "qttft_ms": distribution([q for r in ok if (q := r.qttft_ms) is not None]),
        "client_ttft_ms": distribution([1000 * t for r in ok if (t := r.client_ttft_s) is not None]),
        "e2e_ms": distribution([1000 * t for r in ok if (t := r.e2e_s) is not None]),
        "behind_schedule_trace_s": distribution([r.behind_schedule_s / scale for r in sent]),
        "schedule_stretch": max(r.sent for r in sent) / last_scheduled if last_scheduled > 0 else None,
        "schedule_span_trace_s": last_scheduled / scale,
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall else None,
        "output_tokens_per_s": sum(r.completion_tokens or 0 for r in ok) / wall if wall else None,
        "prompt_tokens_per_s": prompt / wall if wall else None,
        "candidate_seconds": secs,
        "candidate_seconds_source": secs_source,
        "wa_share": (on_total - secs.get("lru", 0.0)) / on_total if on_total else None,
    }


def schedule_warning(summary: dict[str, Any]) -> str | None:
    """A line saying the run fell behind the trace's schedule, or None when it kept it (or cannot tell)."""
    stretch = summary["schedule_stretch"]
    lag = summary["behind_schedule_trace_s"]
    span = summary.get("schedule_span_trace_s") or 0.0
    stretched = stretch is not None and stretch > STRETCH_WARN
    lagged = lag["p90"] is not None and span > 0 and lag["p90"] > LAG_WARN_SHARE * span
    if not (stretched or lagged):
        return None
    return (
        f"{summary['label']} fell behind the trace's schedule: its last request went out {stretch or 0:.2f}x as late "
        f"as scheduled, the median request {lag['p50']:.1f} and the 90th percentile {lag['p90']:.1f} trace s late "
        f"(the trace spans {span:.1f} s); its hit rate and times are those of a slower interleaving than the "
        "trace's (the server could not keep up: a larger --time-scale keeps the schedule)"
    )


def used_server_warning(summary: dict[str, Any]) -> str | None:
    """A line saying the server had served prompts before the run, or None."""
    queries = summary.get("queries_before_run")
    if not queries:
        return None
    return (
        f"{summary['label']} ran against a server that had already looked up {queries:.0f} prompt tokens: its prefix "
        "cache may hold this trace's prompts from an earlier run (start a fresh server for each run to compare)"
    )


def _fmt(v: Any, spec: str = ".1f", scale: float = 1.0) -> str:
    if v is None:
        return "-"
    return format(v * scale, spec)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def paired_hit_rates(a: RunResult, b: RunResult) -> tuple[float | None, float | None, int]:
    """Token hit rates of two runs of one trace over the requests both completed, and how many.

    A request that fails in one run only leaves that run's own rate: compared
    over different sets, failures would read as a gain or a loss.
    """
    done_a = {r.index: r for r in a.requests if r.ok}
    both = [(done_a[r.index], r) for r in b.requests if r.ok and r.index in done_a]

    def rate(pairs: list) -> float | None:
        prompt = sum(r.prompt_tokens or 0 for r in pairs)
        return sum(r.cached_tokens or 0 for r in pairs) / prompt if prompt else None

    return rate([x for x, _ in both]), rate([y for _, y in both]), len(both)


def format_table(
    summaries: Sequence[dict[str, Any]], baseline: str = "lru", results: Sequence[RunResult] | None = None
) -> str:
    """Runs side by side, one column each; a ratio column per non-baseline run of the same cache size.

    ``results`` (the runs, in the summaries' order) lets the hit-rate
    comparison pair the requests both runs completed; without them it is
    given only when neither run lost a request.
    """
    cols = list(summaries)
    run_of = {id(s): r for s, r in zip(cols, results)} if results is not None else {}
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, fn) -> None:
        rows.append((name, [fn(s) for s in cols]))

    row("cache blocks", lambda s: str(s["cache_blocks"]))
    row("requests (failed)", lambda s: f"{s['completed']} ({s['failed']})")
    row("token hit rate %", lambda s: _fmt(s["token_hit_rate"], ".2f", 100))
    row("  server counter %", lambda s: _fmt(s["server_token_hit_rate"], ".2f", 100))
    for key, name in (("ttft_ms", "TTFT ms"), ("qttft_ms", "QTTFT ms")):
        for p in ("p50", "p90", "p99", "mean"):
            row(f"{name} {p}", lambda s, key=key, p=p: _fmt(s[key][p], ".1f"))
    row("client TTFT ms p50", lambda s: _fmt(s["client_ttft_ms"]["p50"], ".1f"))
    row("behind schedule p50 (tr s)", lambda s: _fmt(s["behind_schedule_trace_s"]["p50"], ".0f"))
    row("schedule stretch", lambda s: _fmt(s["schedule_stretch"], ".2f"))
    row("throughput req/s", lambda s: _fmt(s["requests_per_s"], ".2f"))
    row("output tok/s", lambda s: _fmt(s["output_tokens_per_s"], ".1f"))
    row("preemptions", lambda s: _fmt((s["server"] or {}).get("preemptions"), ".0f"))
    row("time on a WA candidate %", lambda s: _fmt(s["wa_share"], ".1f", 100))
    width = max(12, *(len(s["label"]) + 2 for s in cols))
    head = f"{'':<26}" + "".join(f"{s['label']:>{width}}" for s in cols)
    lines = [head]
    for name, cells in rows:
        lines.append(f"{name:<26}" + "".join(f"{c:>{width}}" for c in cells))
    # Ratios against the baseline at the same cache size.
    base = {s["cache_blocks"]: s for s in cols if s["label"].split("@")[0] == baseline}
    for s in cols:
        b = base.get(s["cache_blocks"])
        if b is None or b is s:
            continue
        parts = [
            f"TTFT {p} {_ratio(s['ttft_ms'][p], b['ttft_ms'][p])}" for p in ("p50", "p90", "p99", "mean")
        ] + [f"QTTFT {p} {_ratio(s['qttft_ms'][p], b['qttft_ms'][p])}" for p in ("p50", "p90", "p99", "mean")]
        lines.append(f"{s['label']} / {b['label']}: hit rate {_hit_delta(s, b, run_of)}; " + ", ".join(parts))
    return "\n".join(lines)


def _hit_delta(s: dict[str, Any], b: dict[str, Any], run_of: dict[int, RunResult]) -> str:
    """Run ``s``'s hit rate against baseline ``b``'s, over the same requests."""
    rs, rb = run_of.get(id(s)), run_of.get(id(b))
    if rs is not None and rb is not None:
        hb, hs, n = paired_hit_rates(rb, rs)
        if hs is None or hb is None:
            return "- (no request completed in both)"
        note = "" if n == s["completed"] == b["completed"] else f" on the {n} requests both completed"
        return f"{100 * (hs - hb):+.2f} points{note}"
    if s["failed"] or b["failed"]:
        return f"- (the runs lost {s['failed']} and {b['failed']} requests: compare on those both completed)"
    hit = s["token_hit_rate"], b["token_hit_rate"]
    return f"{100 * (hit[0] - hit[1]):+.2f} points" if None not in hit else "-"


def windowed_hit_rates(res: RunResult, window_s: float) -> list[tuple[float, float]]:
    """(window start s, token hit rate) of the completed requests, by send time."""
    acc: dict[int, list[int]] = {}
    for r in res.requests:
        if r.ok and r.sent is not None and r.prompt_tokens:
            w = acc.setdefault(int(r.sent // window_s), [0, 0])
            w[0] += r.cached_tokens or 0
            w[1] += r.prompt_tokens
    return [(k * window_s, h / p) for k, (h, p) in sorted(acc.items()) if p]


def plot(results: Sequence[RunResult], path: str, windows: int = 30) -> None:
    """TTFT CDF per run (server TTFT and QTTFT) and windowed token hit rate over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    span = max((r.wall_s for r in results), default=1.0) or 1.0
    window = max(1.0, span / windows)
    for i, res in enumerate(results):
        color = f"C{i % 10}"
        ok = [r for r in res.requests if r.ok]
        for values, style, what in (
            (sorted(r.server_ttft_ms for r in ok if r.server_ttft_ms is not None), "-", "TTFT"),
            (sorted(q for r in ok if (q := r.qttft_ms) is not None), "--", "QTTFT"),
        ):
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax1.plot(values, ys, style, color=color, label=f"{res.label} {what}")
        pts = windowed_hit_rates(res, window)
        if pts:
            ax2.plot([t for t, _ in pts], [100 * h for _, h in pts], marker=".", color=color, label=res.label)
    ax1.set_xscale("log")
    ax1.set_xlabel("ms (server per-request metrics; dashed: QTTFT = queue + TTFT)")
    ax1.set_ylabel("CDF")
    ax1.set_title("time to first token")
    ax1.legend(fontsize=7)
    ax2.set_xlabel(f"seconds into the run ({window:.0f} s windows)")
    ax2.set_ylabel("token hit rate %")
    ax2.set_title("prefix-cache hit rate over time")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

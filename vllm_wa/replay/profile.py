"""The offline profiler of PR #22236: fit per-class reuse parameters on a trace prefix.

Replays the first part of a trace through an infinite cache and, per class,
counts accesses and reuses and collects reuse gaps.  As in the PR,
``p = reuses / accesses`` and ``a = 1 / scale`` of ``scipy.stats.expon.fit``
on the gaps.  Unlike the PR, a gap is measured from the moment the block was
freed (the end of the request that last used it), which is what the queue
measures its idle time from.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Any

import numpy as np
from scipy import stats

from vllm_wa.params import ReuseModel, WAParams, pooled_model
from vllm_wa.replay.lifetime import LifetimeModel
from vllm_wa.replay.trace import Trace, TraceRequest


def profile_trace(
    trace: Trace, until: float, lifetime: LifetimeModel | None = None, since: float = float("-inf")
) -> WAParams:
    """PR-format parameters from the requests arriving in ``[since, until)``.

    A block occurrence is a reuse when the block was seen before and no
    request holds it: no earlier occurrence in this request, and every
    earlier request that used it finished by this arrival. Its gap runs from
    the last of those finishes, and it counts for the class that used the
    block last. Computed over all occurrences at once, grouped by block id.
    """
    lifetime = lifetime or LifetimeModel()
    lo, hi = _in_window(trace.requests, since, until)
    reqs = trace.requests[lo:hi]
    accesses: dict[str, int] = {}
    for r in reqs:
        accesses[r.tag] = accesses.get(r.tag, 0) + len(r.hash_ids)
    reuses: dict[str, int] = {}
    gaps: dict[str, array] = {}
    ids = _block_ids(reqs)
    if len(ids) < 2:
        return params_from_counts(accesses, reuses, gaps)
    classes = list(accesses)
    code = {c: i for i, c in enumerate(classes)}
    lengths = np.array([len(r.hash_ids) for r in reqs], dtype=np.int64)
    arrival = np.array([r.arrival for r in reqs], dtype=np.float64)
    finish = lifetime.finish_times(trace)[lo:hi]
    cls = np.array([code[r.tag] for r in reqs], dtype=np.int64)
    # Occurrences grouped by block id, each group in request order.
    order = np.argsort(ids, kind="stable")
    req = np.repeat(np.arange(len(reqs), dtype=np.int64), lengths)[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = ids[order][1:] != ids[order][:-1]
    # The latest finish among a group's occurrences so far: a running maximum
    # of (group, finish rank), which never carries across groups.
    ends, rank = np.unique(finish, return_inverse=True)
    group = np.cumsum(first) - 1
    running = np.maximum.accumulate(group * len(ends) + rank[req])
    k = np.flatnonzero(~first)
    k = k[req[k - 1] != req[k]]  # an earlier occurrence in the same prompt holds the block
    freed = ends[running[k - 1] - group[k] * len(ends)]
    k_ok = freed <= arrival[req[k]]
    k, freed = k[k_ok], freed[k_ok]
    # Back to trace order (request, then position), the order gaps were seen in.
    back = np.argsort(order[k], kind="stable")
    k, freed = k[back], freed[back]
    gap = arrival[req[k]] - freed
    prev = cls[req[k - 1]]
    for c in np.unique(prev):
        mine = prev == c
        reuses[classes[c]] = int(mine.sum())
        gaps[classes[c]] = array("d", gap[mine].tobytes())
    return params_from_counts(accesses, reuses, gaps)


def _in_window(reqs: list[TraceRequest], since: float, until: float) -> tuple[int, int]:
    """The slice of requests a scan in trace order profiles: from ``since``, stopping at the first at ``until``."""
    lo = bisect.bisect_left(reqs, since, key=lambda r: r.arrival)
    hi = bisect.bisect_left(reqs, until, lo=lo, key=lambda r: r.arrival)
    return lo, hi


def _block_ids(reqs: list[TraceRequest]) -> np.ndarray:
    """Every prompt's block ids, concatenated, as int64 (other hashables numbered)."""
    if all(isinstance(r.hash_ids, array) and r.hash_ids.typecode == "q" for r in reqs):
        return np.concatenate([np.frombuffer(r.hash_ids, dtype=np.int64) for r in reqs] or [np.empty(0, np.int64)])
    seen: dict[Any, int] = {}
    return np.fromiter((seen.setdefault(h, len(seen)) for r in reqs for h in r.hash_ids), dtype=np.int64)


def params_from_counts(accesses: dict[str, int], reuses: dict[str, int], gaps: dict[str, array]) -> WAParams:
    models: dict[str, ReuseModel] = {}
    rates = {}
    for c, n in accesses.items():
        if n <= 0:
            continue
        g = np.frombuffer(gaps[c], dtype=np.float64) if len(gaps.get(c, ())) else None
        if g is not None and len(g) >= 2 and float(np.ptp(g)) > 0:
            _, scale = stats.expon.fit(g)
            rates[c] = 1.0 / scale if scale > 0 else None
        elif g is not None and len(g) and float(g.mean()) > 0:
            rates[c] = 1.0 / float(g.mean())
        else:
            rates[c] = None
    known = [a for a in rates.values() if a]
    fallback = float(np.mean(known)) if known else 1.0 / 60.0
    for c, n in accesses.items():
        if n <= 0:
            continue
        p = min(1.0, reuses.get(c, 0) / n)
        models[c] = ReuseModel.exponential(p, rates.get(c) or fallback)
    if not models:
        return WAParams.lru()
    return WAParams(models=models, default=pooled_model(models.values()), source="offline-profile")

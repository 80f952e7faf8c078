"""The offline profiler of PR #22236: fit per-class reuse parameters on a trace prefix.

Replays the first part of a trace through an infinite cache and, per class,
counts accesses and reuses and collects reuse gaps.  As in the PR,
``p = reuses / accesses`` and ``a = 1 / scale`` of ``scipy.stats.expon.fit``
on the gaps.  Unlike the PR, a gap is measured from the moment the block was
freed (the end of the request that last used it), which is what the queue
measures its idle time from.
"""

from __future__ import annotations

import heapq
from array import array
from collections import defaultdict

import numpy as np
from scipy import stats

from vllm_wa.params import ReuseModel, WAParams, pooled_model
from vllm_wa.replay.lifetime import LifetimeModel
from vllm_wa.replay.trace import Trace


def profile_trace(
    trace: Trace, until: float, lifetime: LifetimeModel | None = None, since: float = float("-inf")
) -> WAParams:
    """PR-format parameters from the requests arriving in ``[since, until)``."""
    lifetime = lifetime or LifetimeModel()
    last_class: dict[int, str] = {}
    free_at: dict[int, float] = {}
    holders: dict[int, int] = defaultdict(int)
    accesses: dict[str, int] = defaultdict(int)
    reuses: dict[str, int] = defaultdict(int)
    gaps: dict[str, array] = defaultdict(lambda: array("d"))
    finishing: list[tuple[float, int, int]] = []
    reqs = trace.requests

    def release(i: int, t: float) -> None:
        for h in reqs[i].hash_ids:
            holders[h] -= 1
            if holders[h] == 0:
                free_at[h] = t
                del holders[h]

    for i, r in enumerate(reqs):
        if r.arrival < since:
            continue
        if r.arrival >= until:
            break
        while finishing and finishing[0][0] <= r.arrival:
            t, _, j = heapq.heappop(finishing)
            release(j, t)
        c = r.tag
        for h in r.hash_ids:
            prev = last_class.get(h)
            if prev is not None and h not in holders:
                reuses[prev] += 1
                gaps[prev].append(r.arrival - free_at[h])
            holders[h] += 1
            last_class[h] = c
        accesses[c] += len(r.hash_ids)
        heapq.heappush(finishing, (r.arrival + lifetime.service_time(r), i, i))
    return params_from_counts(accesses, reuses, gaps)


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

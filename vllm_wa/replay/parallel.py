"""Independent replays in forked worker processes (the benchmarks' sweeps).

Forked, so a trace the parent loaded is shared copy-on-write instead of being
pickled to every worker; with one job everything runs in this process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def worker_count(jobs: int) -> int:
    """The processes to fork for ``jobs`` (0: one per core this process may
    run on): at most one per core.  Replays are CPU-bound, so more only add memory (each worker holds
    a replay's state, hundreds of MB on the development traces)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if jobs < 0:
        raise ValueError(f"jobs must be 0 (one per core) or more, got {jobs}")
    return cores if jobs == 0 else min(jobs, cores)


def map_jobs(fn: Callable[[T], R], items: Iterable[T], jobs: int, *, ordered: bool = True) -> Iterator[R]:
    """``fn`` of each item, on ``jobs`` processes: in the items' order, or
    (``ordered`` False) as each finishes, so progress can be printed."""
    jobs = worker_count(jobs)
    if jobs <= 1:
        yield from map(fn, items)
        return
    with mp.get_context("fork").Pool(jobs) as pool:
        yield from (pool.imap if ordered else pool.imap_unordered)(fn, items)

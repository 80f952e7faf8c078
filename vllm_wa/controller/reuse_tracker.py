"""Turns the engine's sampled block events into censored reuse observations.

A sampled block is watched from the moment it is freed.  The next prompt
lookup that contains its hash is a reuse after the elapsed gap, whether or not
the block was still cached: an evicted block moves to the bounded *ghost
table*, so the true gap is still seen after an eviction.  A block that falls
out of the ghost table (or is watched longer than ``max_watch_s``) becomes a
censored observation at its exposure; blocks still watched count as censored
at their current exposure when a fit is made.

The watch table is in free order, so its expired blocks are at its head.  The
ghost table is in eviction order, which a workload-aware queue makes unlike
free order (a block freed early may be evicted late), so a heap of the
ghosts' free times finds its expired blocks wherever they sit.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

Entry = tuple[int, float]  # (finest-class id, free time)


class ReuseTracker:
    """Watch table of free sampled blocks plus the ghost table of evicted ones."""

    def __init__(
        self,
        ghost_capacity: int,
        watch_capacity: int,
        max_watch_s: float,
        on_reuse: Callable[[int, list[float], float], None],
        on_censored: Callable[[int, float, float], None],
    ) -> None:
        self.ghost_capacity = max(1, int(ghost_capacity))
        self.watch_capacity = max(1, int(watch_capacity))
        self.max_watch_s = max_watch_s
        self._on_reuse = on_reuse
        self._on_censored = on_censored
        self.watch: OrderedDict[Any, Entry] = OrderedDict()
        self.ghost: OrderedDict[Any, Entry] = OrderedDict()
        # (free time, tie-break, hash) of ghosts; an item whose ghost has
        # gone (reused, pushed out, freed again) is dropped when it surfaces
        # or when the heap outgrows the table (``_rebuild_ghost_heap``).
        self._ghost_heap: list[tuple[float, int, Any]] = []
        self._ghost_seq = itertools.count()
        self.reuses = 0
        self.ghost_reuses = 0
        self.censored = 0

    def freed(self, block_hash: Any, key: int, t: float) -> None:
        self.ghost.pop(block_hash, None)
        self.watch[block_hash] = (key, t)
        self.watch.move_to_end(block_hash)
        if len(self.watch) > self.watch_capacity:
            h, (k, t0) = self.watch.popitem(last=False)
            self._censor(k, t - t0, t0)

    def refile(self, block_hash: Any, freed_at: float, key: int) -> bool:
        """Move a block still watched since its free at ``freed_at`` to class
        ``key`` (its request's outcome came late).  False if that free is no
        longer watched (reused, censored, or freed again since)."""
        for table in (self.watch, self.ghost):
            entry = table.get(block_hash)
            if entry is not None:
                if entry[1] != freed_at:
                    return False
                table[block_hash] = (key, freed_at)  # keeps its place in the table
                return True
        return False

    def evicted(self, block_hash: Any, t: float) -> None:
        entry = self.watch.pop(block_hash, None)
        if entry is None:
            return
        self.ghost[block_hash] = entry
        heapq.heappush(self._ghost_heap, (entry[1], next(self._ghost_seq), block_hash))
        if len(self.ghost) > self.ghost_capacity:
            _, (k, t0) = self.ghost.popitem(last=False)
            self._censor(k, t - t0, t0)
        if len(self._ghost_heap) > 2 * self.ghost_capacity + 64:
            self._rebuild_ghost_heap()

    def _rebuild_ghost_heap(self) -> None:
        """Drop the heap's items whose ghosts have gone: it stays within twice the table."""
        seq = self._ghost_seq
        self._ghost_heap = [(t0, next(seq), h) for h, (_, t0) in self.ghost.items()]
        heapq.heapify(self._ghost_heap)

    def looked_up(self, hashes: Any, t: float) -> None:
        """A prompt with these (sampled) block hashes arrived at ``t``.

        Its reuses are reported once per class, as one batch of gaps with the
        lookup time: the blocks of a prompt were freed together and come back
        together.
        """
        watch, ghost = self.watch, self.ghost
        found: dict[int, list[float]] = {}
        for h in hashes:
            entry = watch.pop(h, None)
            if entry is None:
                entry = ghost.pop(h, None)
                if entry is None:
                    continue
                self.ghost_reuses += 1
            self.reuses += 1
            gaps = found.get(entry[0])
            if gaps is None:
                found[entry[0]] = [t - entry[1]]
            else:
                gaps.append(t - entry[1])
        for key, gaps in found.items():
            self._on_reuse(key, gaps, t)

    def expire(self, now: float) -> None:
        """Censor blocks watched longer than ``max_watch_s``."""
        limit = now - self.max_watch_s
        watch = self.watch
        while watch:
            h, (k, t0) = next(iter(watch.items()))
            if t0 > limit:
                break
            del watch[h]
            self._censor(k, now - t0, t0)
        heap, ghost = self._ghost_heap, self.ghost
        while heap and heap[0][0] <= limit:
            t0, _, h = heapq.heappop(heap)
            entry = ghost.get(h)
            if entry is not None and entry[1] == t0:
                del ghost[h]
                self._censor(entry[0], now - t0, t0)

    def at_risk(self, now: float) -> Iterator[tuple[int, float]]:
        """(class, exposure) of every block still watched (not yet reused)."""
        for table in (self.watch, self.ghost):
            for k, t0 in table.values():
                yield k, now - t0

    def at_risk_array(self, now: float) -> np.ndarray:
        """The same as an ``(n, 2)`` array, built without a Python loop per block."""
        arr = np.array([*self.watch.values(), *self.ghost.values()], dtype=np.float64).reshape(-1, 2)
        arr[:, 1] = now - arr[:, 1]
        return arr

    def classes(self) -> set[int]:
        """The classes of every block still watched."""
        return {k for table in (self.watch, self.ghost) for k, _ in table.values()}

    def renumber(self, new_class: Any) -> None:
        """Every watched block's class ``k`` becomes ``new_class[k]``; order and free times stay."""
        for table in (self.watch, self.ghost):
            for h, (k, t0) in table.items():
                table[h] = (int(new_class[k]), t0)

    def _censor(self, key: int, exposure: float, freed_at: float) -> None:
        self.censored += 1
        self._on_censored(key, exposure, freed_at)

    def __len__(self) -> int:
        return len(self.watch) + len(self.ghost)

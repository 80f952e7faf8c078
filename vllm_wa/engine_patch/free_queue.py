"""A workload-aware drop-in for vLLM's ``FreeKVCacheBlockQueue``.

Free blocks are kept in one intrusive FIFO list per workload class (using the
``prev_free_block``/``next_free_block`` fields of ``KVCacheBlock``, like
vLLM's queue, so no Python object is allocated per operation), plus one list
of blocks without a hash that are always handed out first, as in vLLM.

On eviction only the list heads are compared: each class's head is its
longest-idle block, and a class's score never increases with idle time, so
the head is the class's best victim.  The lowest ``(score, free stamp)`` goes.
Runs of victims from one class are taken without rescoring each block: the
run continues while the next block's free stamp is older than a threshold
derived once from the runner-up's score.

Per-block state (class, free stamp, sampling flag) lives in arrays indexed by
``block_id`` because ``KVCacheBlock`` has ``__slots__``.

A lookup-stamped release goes where its stamp sorts in its class list, which
may be far from the tail (requests that started later finished first). Each
class keeps its distinct stamps sorted, with the first block of each stamp's
group, so the place is found by bisection, exactly, in a time that does not
grow with the list (``_StampGroups``).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.engine_patch.events import EventKind, EventSink, EvictedEvent
from vllm_wa.kv_block import install_hash_alias
from vllm_wa.params import ClassScorer, ParamsError, WAParams
from vllm_wa.workload_classes import DEFAULT_ID, ClassRegistry

Clock = Callable[[], float]
_INF = math.inf
_NO_LOOKUP = -_INF  # lookup_time of a block no lookup has dated
# Class heads whose log scores differ by at most this much tie, and the older
# stamp goes first, as in LRU: two classes left to one memoryless model (its
# score does not depend on the idle time) score alike but for the last bits
# of their logs.  Compared exactly, those bits decided: with the prior model
# (exponential, p = 1) for every class but one unused class, the Mooncake
# trace at 20 % (``--cut 1800``) evicted newer blocks first and lost 0.2 to
# 1.3 points against its miniature cache, which ran LRU.
_SCORE_TIE = 1e-9


# Stamps per bucket of a _SortedStamps (a bucket splits past twice this).
_STAMPS_PER_BUCKET = 512


class _SortedStamps:
    """Distinct floats, sorted, in buckets of at most ``2 * _STAMPS_PER_BUCKET``.

    A list of buckets (as ``sortedcontainers.SortedList`` keeps them): adding,
    removing and finding the next larger stamp move at most a bucket and the
    bucket index, however many stamps there are (a short-request workload
    leaves one per request in a large cache).
    """

    __slots__ = ("_buckets", "_maxes")

    def __init__(self, ordered: list[float] | None = None) -> None:
        """``ordered``: stamps already sorted and distinct."""
        k = _STAMPS_PER_BUCKET
        self._buckets = [ordered[i : i + k] for i in range(0, len(ordered), k)] if ordered else []
        self._maxes = [b[-1] for b in self._buckets]

    def __iter__(self) -> Iterator[float]:
        for b in self._buckets:
            yield from b

    def next_above(self, s: float) -> float | None:
        """The smallest stamp larger than ``s`` (None: none is)."""
        i = bisect_right(self._maxes, s)
        if i == len(self._maxes):
            return None
        b = self._buckets[i]
        return b[bisect_right(b, s)]

    def add(self, s: float) -> None:
        """Add ``s`` (not present)."""
        maxes, buckets = self._maxes, self._buckets
        if not maxes:
            buckets.append([s])
            maxes.append(s)
            return
        i = bisect_left(maxes, s)
        if i == len(maxes):
            i -= 1
            b = buckets[i]
            b.append(s)
            maxes[i] = s
        else:
            b = buckets[i]
            insort(b, s)
        if len(b) > 2 * _STAMPS_PER_BUCKET:
            half = b[_STAMPS_PER_BUCKET:]
            del b[_STAMPS_PER_BUCKET:]
            buckets.insert(i + 1, half)
            maxes[i] = b[-1]
            maxes.insert(i + 1, half[-1])

    def remove(self, s: float) -> None:
        """Remove ``s`` (present)."""
        i = bisect_left(self._maxes, s)
        b = self._buckets[i]
        del b[bisect_left(b, s)]
        if not b:
            del self._buckets[i]
            del self._maxes[i]
        else:
            self._maxes[i] = b[-1]

    def pop_below(self, s: float) -> list[float]:
        """Remove and return every stamp smaller than ``s``, in order."""
        maxes, buckets = self._maxes, self._buckets
        out: list[float] = []
        n = bisect_left(maxes, s)
        for b in buckets[:n]:
            out += b
        del buckets[:n], maxes[:n]
        if buckets:
            b = buckets[0]
            j = bisect_left(b, s)
            out += b[:j]
            del b[:j]
        return out


@dataclass
class _StampGroups:
    """One class list's stamps: each distinct stamp and the first block holding it.

    A list is in stamp order, so blocks of one stamp follow each other; a
    block stamped ``s`` belongs right before the first block of the next
    larger stamp (or at the tail).
    """

    keys: _SortedStamps = field(default_factory=_SortedStamps)
    first: dict[float, KVCacheBlock] = field(default_factory=dict)


@dataclass
class _ActiveParams:
    """Parameters compiled for the queue; replaced, never mutated, on a swap."""

    params: WAParams
    registry: ClassRegistry
    uniform: bool
    lookup_stamped: bool  # releases are stamped at their request's lookup
    _scorers: dict[int, ClassScorer] = field(default_factory=dict)

    def scorer(self, cid: int) -> ClassScorer:
        s = self._scorers.get(cid)
        if s is None:
            s = self.params.scorer_for(self.registry.name_of(cid))
            self._scorers[cid] = s
        return s


@dataclass
class QueueCounters:
    """Per-class totals of free-list transitions (all blocks, not sampled).

    Each only grows (a retired class's totals start again at zero): they are
    exported as Prometheus counters.  ``freed`` counts blocks freed into the
    class and blocks re-filed into it by a late outcome.

    ``reused`` is counted by the block tagger at the prefix lookup, which
    knows the request; the queue's ``remove`` stays as cheap as vLLM's.
    """

    freed: list[int]
    reused: list[int]
    evicted: list[int]
    reclassified: int = 0


# Blocks of a class run the eviction-order walk scores one by one before it
# solves for the run's crossing with the next class (once a run).
_RUN_SCORED = 8


def _goes_before(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether a head keyed ``a`` (score, stamp) is evicted before one keyed
    ``b``: :meth:`WorkloadAwareFreeQueue._first`'s order for two heads."""
    if abs(a[0] - b[0]) <= _SCORE_TIE and a[1] != b[1]:
        return a[1] < b[1]
    return a < b  # equal keys: not before (the class order among the heads decides, as in _first)


class WorkloadAwareFreeQueue:
    """Free-block queue that evicts the block least likely to be reused soon.

    Args:
        blocks: the free blocks, as for ``FreeKVCacheBlockQueue``.
        params: initial parameters (LRU-equivalent when None).
        clock: seconds, monotonic; replays pass trace time.
        registry: class-name registry shared with whoever tags blocks.
        sink: where sampled eviction/free events go (None: no events).
        num_block_ids: size of the per-block arrays (default: max id + 1),
            for pools whose first free block is not the highest id.
        score_staleness: seconds a victim selection may be reused before it
            is rescored (scores move on the scale of seconds; rescoring every
            head on every single-block allocation would cost more than the
            eviction itself).
    """

    def __init__(
        self,
        blocks: list[KVCacheBlock],
        params: WAParams | None = None,
        *,
        clock: Clock = time.monotonic,
        registry: ClassRegistry | None = None,
        sink: EventSink | None = None,
        num_block_ids: int | None = None,
        score_staleness: float = 1e-3,
    ) -> None:
        install_hash_alias()  # the hash slot under one name (vllm_wa.kv_block)
        self.clock = clock
        self.registry = registry if registry is not None else ClassRegistry()
        self.sink = None
        n_ids = max((b.block_id for b in blocks), default=-1) + 1
        if num_block_ids is not None:
            if num_block_ids < n_ids:
                raise ValueError(f"num_block_ids={num_block_ids} but a block has id {n_ids - 1}")
            n_ids = num_block_ids
        self.num_classes_cap = cap = self.registry.max_classes
        # Class a block is filed under when it is next freed (written by the
        # block tagger); for a free block, the class list it sits in.
        self.block_class: list[int] = [DEFAULT_ID] * n_ids
        # Free stamp: when the block entered the free list.  Stamps increase
        # strictly from one appended run to the next, so ties between classes
        # break in insertion (LRU) order; blocks of one run share a stamp and
        # keep their list order.
        self.stamp: list[float] = [0.0] * n_ids
        # Stamp by the start of the block's last use instead of its release
        # (``stamp_at_lookup``): the tagger writes, before each release, when
        # the releasing request's prompt was looked up.  A request that ran
        # long (a long prefill, a long reply) then ranks by when it started,
        # as SGLang's FIFO and LRU do with their creation and match times.
        # ``_NO_LOOKUP``: none since the block took its content.
        self.lookup_time: list[float] = [_NO_LOOKUP] * n_ids
        # Per-block "events wanted" flag (hash-sampled), set by the tagger,
        # and the hash it was computed for (hashing every block at every
        # lookup and free would cost more than the eviction).
        self.sampled = bytearray(n_ids)
        self.sampled_hash: list[Any] = [None] * n_ids
        self._last_stamp = -_INF
        self.score_staleness = float(score_staleness)

        self._nohash = cap  # list index of blocks without a hash
        # Blocks that hold a hash yet sit in that list (vLLM prepends cached
        # blocks only with caching off): normally empty; ``refile`` skips them.
        self._hashed_first: set[int] = set()
        self._heads = [KVCacheBlock(block_id=-1) for _ in range(cap + 1)]
        self._tails = [KVCacheBlock(block_id=-1) for _ in range(cap + 1)]
        for h, t in zip(self._heads, self._tails):
            h.next_free_block = t
            t.prev_free_block = h
        self._live: list[int] = []  # classes that have ever held a block
        self._is_live = bytearray(cap + 1)
        self.counters = QueueCounters([0] * cap, [0] * cap, [0] * cap)
        self._active = self._compile(params if params is not None else WAParams.lru())
        # Cached victim selection: blocks at the head of ``_sel_class`` with a
        # stamp below ``_sel_below`` beat every other class's head.
        self._sel_dirty = True
        self._sel_time = -_INF
        self._sel_active: _ActiveParams | None = None
        self._sel_class = -1
        self._sel_below = -_INF

        # Stamp groups of every class list (see _StampGroups), kept while
        # ``_grouped``; releases stamped at the release append at the tails
        # without them, and the next lookup-stamped release rebuilds them.
        self._groups = [_StampGroups() for _ in range(cap)]
        self._is_first = bytearray(n_ids)  # block heads its stamp's group
        self._grouped = True

        # Like vLLM: the given blocks start free, in the given order.  Blocks
        # without a hash go to the evict-first list; blocks that already hold
        # a hash (installing into a live pool) join their class.
        self.num_free_blocks = 0
        blocks = list(blocks)
        hashed = [b for b in blocks if b.wa_block_hash is not None]
        self._link_run(self._nohash, [b for b in blocks if b.wa_block_hash is None], at_front=False)
        self.num_free_blocks = len(blocks) - len(hashed)
        self.append_n(hashed)
        self.counters.freed = [0] * cap
        self.sink = sink

    # ---- parameters -----------------------------------------------------------

    def _compile(self, params: WAParams) -> _ActiveParams:
        if not isinstance(params, WAParams):
            raise ParamsError(f"expected WAParams, got {type(params).__name__}")
        return _ActiveParams(params, self.registry, params.is_uniform, params.stamp == "lookup")

    @property
    def params(self) -> WAParams:
        return self._active.params

    @property
    def stamp_at_lookup(self) -> bool:
        """Whether releases are stamped at their request's lookup (the
        parameters' ``stamp``).  Blocks already free keep their stamps when
        parameters are swapped; releases from then on are stamped as the new
        ones say."""
        return self._active.lookup_stamped

    def set_params(self, params: WAParams) -> None:
        """Swap parameters; safe from any thread, between or during calls.

        The compiled snapshot is replaced by one reference assignment; an
        eviction reads it once, so it uses old or new parameters, never a
        mix.  Which blocks are free does not change.
        """
        self._active = self._compile(params)

    # ---- the FreeKVCacheBlockQueue interface -------------------------------------

    def _link_run(self, c: int, blocks: list[KVCacheBlock], *, at_front: bool) -> None:
        """Splice ``blocks`` (in order) at the tail, or the head, of list ``c``."""
        if at_front:
            prev = self._heads[c]
            after = prev.next_free_block
        else:
            after = self._tails[c]
            prev = after.prev_free_block
        for b in blocks:
            b.prev_free_block = prev
            prev.next_free_block = b
            prev = b
        prev.next_free_block = after
        after.prev_free_block = prev

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Free blocks into their classes (first given is evicted first among equals).

        vLLM appends only blocks that hold a hash (``BlockPool.free_blocks``
        prepends the others); each goes to the class the tagger wrote for it.
        """
        if not blocks:
            return
        if self.stamp_at_lookup:
            self._insert_by_lookup(blocks)
            return
        self._grouped = False
        stamp_of = self.stamp
        cls_of = self.block_class
        tails = self._tails
        freed = self.counters.freed
        now = self.clock()
        last_stamp = self._last_stamp
        eps = max(1e-9, 4.0 * math.ulp(now))
        t = now if now > last_stamp else last_stamp + eps
        cur = cls_of[blocks[0].block_id]
        tail = tails[cur]
        last = tail.prev_free_block
        if last is self._heads[cur]:
            self._went_live(cur)
        run = 0
        for b in blocks:
            bid = b.block_id
            c = cls_of[bid]
            if c != cur:
                last.next_free_block = tail
                tail.prev_free_block = last
                freed[cur] += run
                run = 0
                cur = c
                t += eps
                tail = tails[c]
                last = tail.prev_free_block
                if last is self._heads[c]:
                    self._went_live(c)
            b.prev_free_block = last
            last.next_free_block = b
            last = b
            stamp_of[bid] = t
            run += 1
        last.next_free_block = tail
        tail.prev_free_block = last
        freed[cur] += run
        self._last_stamp = t
        self.num_free_blocks += len(blocks)

    def _insert_by_lookup(self, blocks: list[KVCacheBlock]) -> None:
        """Free blocks stamped with their lookup time, each where that stamp sorts.

        A run (one request, one class, one stamp) goes after every block of
        its class stamped the same or earlier, found by bisecting the class's
        stamp groups; its blocks follow each other.
        """
        if not self._grouped:
            self._rebuild_groups()
        stamp_of, cls_of, start_of = self.stamp, self.block_class, self.lookup_time
        heads = self._heads
        freed = self.counters.freed
        now = self.clock()
        prev_b: KVCacheBlock | None = None
        prev_c, prev_s = -1, _INF
        for b in blocks:
            bid = b.block_id
            c = cls_of[bid]
            raw = start_of[bid]
            if raw > now or raw == _NO_LOOKUP:
                raw = now
            if c == prev_c and raw == prev_s and prev_b is not None:
                prev, after = prev_b, prev_b.next_free_block
            else:
                prev, after = self._group_slot(c, raw, b)
                if prev is heads[c]:
                    self._sel_dirty = True  # a new head: the cached selection is stale
                prev_c, prev_s = c, raw
            b.prev_free_block = prev
            b.next_free_block = after
            prev.next_free_block = b
            after.prev_free_block = b
            stamp_of[bid] = raw
            freed[c] += 1
            prev_b = b
        self.num_free_blocks += len(blocks)

    def _group_slot(self, c: int, s: float, b: KVCacheBlock) -> tuple[KVCacheBlock, KVCacheBlock]:
        """Where ``b``, stamped ``s``, goes in list ``c``: ``(prev, after)``.

        After every block stamped ``s`` or earlier. ``b`` heads a new group
        when no block of the list has its stamp.
        """
        g = self._groups[c]
        tail = self._tails[c]
        if self._heads[c].next_free_block is tail:
            self._went_live(c)
        nxt = g.keys.next_above(s)
        after = tail if nxt is None else g.first[nxt]
        if s not in g.first:
            g.keys.add(s)
            g.first[s] = b
            self._is_first[b.block_id] = 1
        return after.prev_free_block, after

    def _ungroup(self, b: KVCacheBlock, c: int) -> None:
        """``b``, still linked in list ``c``, is leaving it: its group loses it."""
        bid = b.block_id
        self._is_first[bid] = 0
        s = self.stamp[bid]
        g = self._groups[c]
        nxt = b.next_free_block
        if nxt.block_id >= 0 and self.stamp[nxt.block_id] == s:
            g.first[s] = nxt
            self._is_first[nxt.block_id] = 1
        else:
            del g.first[s]
            g.keys.remove(s)

    def _ungroup_popped(self, c: int, head: KVCacheBlock) -> None:
        """Blocks before ``head`` (a block or the tail) were taken off list ``c``'s front."""
        g = self._groups[c]
        is_first = self._is_first
        if head.block_id < 0:
            for blk in g.first.values():
                is_first[blk.block_id] = 0
            self._groups[c] = _StampGroups()
            return
        s = self.stamp[head.block_id]
        for k in g.keys.pop_below(s):
            is_first[g.first.pop(k).block_id] = 0
        old = g.first[s]
        if old is not head:
            is_first[old.block_id] = 0
            g.first[s] = head
            is_first[head.block_id] = 1

    def _rebuild_groups(self) -> None:
        """Stamp groups from the lists (after releases stamped at the release)."""
        is_first = self._is_first = bytearray(len(self._is_first))
        self._groups = [_StampGroups() for _ in range(self.num_classes_cap)]
        for c in self._live:
            keys, first = self._stamp_runs(c)
            self._groups[c] = _StampGroups(_SortedStamps(keys), first)
            for b in first.values():
                is_first[b.block_id] = 1
        self._grouped = True

    def _stamp_runs(self, c: int) -> tuple[list[float], dict[float, KVCacheBlock]]:
        """List ``c``'s distinct stamps in order, and the first block of each (a walk of the list)."""
        stamp_of = self.stamp
        keys: list[float] = []
        first: dict[float, KVCacheBlock] = {}
        b, tail = self._heads[c].next_free_block, self._tails[c]
        while b is not tail:
            s = stamp_of[b.block_id]
            if not keys or s != keys[-1]:
                keys.append(s)
                first[s] = b
            b = b.next_free_block
        return keys, first

    def _insertion_point(
        self, c: int, s: float, near: KVCacheBlock | None = None
    ) -> tuple[KVCacheBlock, KVCacheBlock]:
        """Where a block stamped ``s`` goes in list ``c``: ``(prev, after)``, after
        every block stamped ``s`` or earlier (for lists whose stamp groups are
        not kept). Found by a scan from ``near``, a block of the list (default:
        its tail), forward past blocks stamped ``s`` or earlier, or back past
        blocks stamped later."""
        stamp_of = self.stamp
        head, tail = self._heads[c], self._tails[c]
        if near is None:
            prev, after = tail.prev_free_block, tail
            if prev is head:
                self._went_live(c)
        else:
            prev, after = near, near.next_free_block
        while after is not tail and stamp_of[after.block_id] <= s:
            prev, after = after, after.next_free_block
        while prev is not head and stamp_of[prev.block_id] > s:
            prev, after = prev.prev_free_block, prev
        return prev, after

    def _went_live(self, c: int) -> None:
        """List ``c`` was empty and gets a head: the cached selection is stale."""
        self._sel_dirty = True
        if not self._is_live[c]:
            self._is_live[c] = 1
            self._live.append(c)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the very front: they are evicted before anything else."""
        if not blocks:
            return
        self._link_run(self._nohash, blocks, at_front=True)
        self.num_free_blocks += len(blocks)
        for b in blocks:
            if b.wa_block_hash is not None:
                self._hashed_first.add(b.block_id)

    def remove(self, block: KVCacheBlock) -> None:
        """Take a free block off its list: a prefix-cache hit reuses it."""
        prev_block = block.prev_free_block
        next_block = block.next_free_block
        if prev_block is None or next_block is None:
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        if self._grouped and self._is_first[block.block_id]:
            self._ungroup(block, self.block_class[block.block_id])
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        if self._hashed_first:
            self._hashed_first.discard(block.block_id)
        if prev_block.block_id < 0:
            # A class head changed (sentinels have id -1).
            self._sel_dirty = True

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks <= 0:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks to reuse: blocks without a hash, then lowest scores.

        The blocks take new content: neither the old content's class nor its
        lookups describe them (the tagger keeps a block's latest start among
        its users), so each is reset on the way out.  Such a block freed
        later without the tagger (a sliding window's, mid-request) is then
        filed as an untagged request's, stamped at its release; its sampling
        flag is still its old content's, which ``_emit_evicted`` tells by
        the hash (no FREED event named the new content).  (A block
        found by a prefix lookup keeps its content's class, and the lookup
        dates it: ``BlockTagger.count_reuse``.)
        """
        if n == 0:
            return []
        assert self.num_free_blocks >= n, (
            f"popleft_n({n}) with only {self.num_free_blocks} free blocks"
        )
        self.num_free_blocks -= n
        out: list[KVCacheBlock] = []
        nohash = self._nohash
        head, tail = self._heads[nohash], self._tails[nohash]
        b = head.next_free_block
        if b is not tail:
            while n and b is not tail:
                nxt = b.next_free_block
                b.prev_free_block = b.next_free_block = None
                out.append(b)
                b = nxt
                n -= 1
            head.next_free_block = b
            b.prev_free_block = head
            if self._hashed_first:
                self._hashed_first.difference_update(x.block_id for x in out)
        if n:
            self._pop_scored(n, out)
        lookup_time, cls_of = self.lookup_time, self.block_class
        for b in out:
            bid = b.block_id
            lookup_time[bid] = _NO_LOOKUP
            cls_of[bid] = DEFAULT_ID
        return out

    def _pop_scored(self, n: int, out: list[KVCacheBlock]) -> None:
        stamp_of = self.stamp
        now = self.clock()
        while n:
            forced = False
            if (
                self._sel_dirty
                or self._sel_active is not self._active
                or now - self._sel_time > self.score_staleness
            ):
                self._reselect(now)
                forced = True  # the head of the selected class is the exact minimum
            c = self._sel_class
            below = self._sel_below
            head = self._heads[c]
            tail = self._tails[c]
            start = len(out)
            b = head.next_free_block
            if forced:
                nxt = b.next_free_block
                b.prev_free_block = b.next_free_block = None
                out.append(b)
                b = nxt
                n -= 1
            while n and b is not tail and stamp_of[b.block_id] < below:
                nxt = b.next_free_block
                b.prev_free_block = b.next_free_block = None
                out.append(b)
                b = nxt
                n -= 1
            head.next_free_block = b
            b.prev_free_block = head
            k = len(out) - start
            if k and self._grouped:
                self._ungroup_popped(c, b)
            self.counters.evicted[c] += k
            if b is tail or not k:
                self._sel_dirty = True
            if k and self.sink is not None:
                self._emit_evicted(out, start, now)

    def _head_keys(self, active: _ActiveParams, now: float) -> dict[int, tuple[float, float]]:
        """Exact (score, stamp) of every non-empty class's head at ``now``."""
        keys: dict[int, tuple[float, float]] = {}
        stamp_of = self.stamp
        heads, tails = self._heads, self._tails
        uniform = active.uniform
        for c in self._live:
            b = heads[c].next_free_block
            if b is not tails[c]:
                s = stamp_of[b.block_id]
                keys[c] = (0.0 if uniform else active.scorer(c).log_score(now - s), s)
        return keys

    @staticmethod
    def _first(keys: dict[int, tuple[float, float]]) -> int:
        """The class to evict from first: the lowest score, the oldest stamp among
        the heads that tie with it (within ``_SCORE_TIE``).

        Heads with the very same stamp that tie are equivalent, and their order
        is not defined: the exact scores' last bits decide, or the class order
        when a third, newer head scores lowest (a differential fuzz found it;
        it moves no hit).
        """
        best = min(keys, key=keys.__getitem__)
        low, stamp = keys[best]
        for c, (score, s) in keys.items():
            if s < stamp and score - low <= _SCORE_TIE:
                best, stamp = c, s
        return best

    def _reselect(self, now: float) -> None:
        """Find the class whose head is the exact minimum, and how far its run goes."""
        active = self._active
        keys = self._head_keys(active, now)
        best = self._first(keys)
        self._sel_class = best
        self._sel_below = self._run_below(active, keys, best, now)
        self._sel_time = now
        self._sel_active = active
        self._sel_dirty = False

    @staticmethod
    def _run_below(active: _ActiveParams, keys: dict[int, tuple[float, float]], best: int, now: float) -> float:
        """How far a run from ``best``'s head goes: its blocks stamped below the
        returned stamp are evicted before every other class's head (``keys``:
        every head's exact (score, stamp), ``best``'s included)."""
        if len(keys) == 1:
            return _INF
        best_score = keys[best][0]
        others = [k for c, k in keys.items() if c != best]
        second = min(others)
        if active.uniform:
            return second[1]
        tied = [s for score, s in others if abs(score - best_score) <= _SCORE_TIE]
        # Heads that tie with the best's: stamp order decides, as in LRU, for
        # the run's blocks that still score with them (all of a flat model's;
        # a younger block of a falling score is above).  Otherwise stamps
        # clearly below the crossing beat the runner-up; the few near it are
        # settled by an exact reselect.
        scorer = active.scorer(best)
        if tied:
            first_tied = min(tied)
            if scorer.log_score(now - first_tied) <= best_score + _SCORE_TIE:
                return first_tied  # every block of the run up to it still ties (a flat model's always)
        # (Below the runner-up by more than the tie: a block within the tie of
        # it is settled by stamp, at an exact reselect.)
        idle = scorer.idle_below(best_score + _SCORE_TIE if tied else second[0] - _SCORE_TIE)
        cross = now - (idle * (1.0 + 1e-9) + 1e-9) if idle < _INF else -_INF
        return min(first_tied, cross) if tied else cross

    def _emit_evicted(self, out: list[KVCacheBlock], start: int, now: float) -> None:
        sink = self.sink
        sampled, sampled_hash = self.sampled, self.sampled_hash
        for i in range(start, len(out)):
            b = out[i]
            bid = b.block_id
            if not sampled[bid]:  # most blocks: their hash is not read
                continue
            h = b.wa_block_hash
            # A flag describes the content whose hash it was computed for: a
            # block freed without the tagger holds other content.  (With every
            # block sampled the tagger still flags what it releases, so that
            # holds there too, and another group's blocks stay unflagged.)
            if h is not None and sampled_hash[bid] is h:
                sink.emit(EvictedEvent(EventKind.EVICTED, now, h))

    def iter_eviction_order(self) -> Iterator[KVCacheBlock]:
        """Free blocks in the order they would be evicted now (non-destructive).

        Class run by class run, as :meth:`popleft_n` evicts: a run's block is
        compared with the best other head only, not with every class's, and
        a long run's blocks below its crossing with that head are not scored
        (vLLM's lazy CPU offload walks the next blocks to go at every step).
        """
        nohash = self._nohash
        head, tail = self._heads[nohash], self._tails[nohash]
        b = head.next_free_block
        while b is not tail:
            yield b
            b = b.next_free_block
        active = self._active
        now = self.clock()
        stamp_of = self.stamp
        tails = self._tails
        uniform = active.uniform
        cursors: dict[int, KVCacheBlock] = {}
        keys: dict[int, tuple[float, float]] = {}
        for c in self._live:
            b = self._heads[c].next_free_block
            if b is not tails[c]:
                cursors[c] = b
                s = stamp_of[b.block_id]
                keys[c] = (0.0 if uniform else active.scorer(c).log_score(now - s), s)
        while keys:
            c = self._first(keys)
            b, end = cursors[c], tails[c]
            yield b  # the head is the exact minimum
            # The class's next blocks go while they still come before the
            # best other head (the others do not move meanwhile): one score
            # a block, and no crossing to solve for a short run.
            rival = keys[self._first({k: v for k, v in keys.items() if k != c})] if len(keys) > 1 else None
            scorer = None if uniform else active.scorer(c)
            b = b.next_free_block
            key = None
            scored, below = 0, -_INF
            while b is not end:
                s = stamp_of[b.block_id]
                if s < below:  # a long run: stamps below its crossing need no score
                    yield b
                    b = b.next_free_block
                    continue
                key = (0.0 if scorer is None else scorer.log_score(now - s), s)
                if rival is not None and not _goes_before(key, rival):
                    break
                yield b
                b = b.next_free_block
                scored += 1
                if scored == _RUN_SCORED and scorer is not None and rival is not None:
                    below = self._run_below(active, keys, c, now)
            if b is end:
                del cursors[c], keys[c]
            else:
                cursors[c] = b
                keys[c] = key

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks in current eviction order. Mainly used for testing."""
        return list(self.iter_eviction_order())

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order, from the first, whatever ``cursor``.

        vLLM's lazy CPU offload (``simple_kv_offload``) walks the queue from a
        cursor it keeps between steps, copying the blocks about to be evicted,
        and skips those it has copied already.  In vLLM's queue a block freed
        later always lands after the cursor.  Here it can sort anywhere (a
        colder class, an older lookup stamp), so the blocks after the cursor
        are not the next to go, and a walk from the cursor would miss the
        ones that are: the walk starts at the first block.
        """
        return self.iter_eviction_order()

    # ---- workload-aware extras ------------------------------------------------------

    def refile(self, blocks: Iterable[KVCacheBlock], new_class: int) -> int:
        """Move free blocks to ``new_class``, keeping free-stamp order.

        Used when a late fact about a request (its reply called a tool) changes
        the class of its already-freed blocks.  Each block goes after the
        target list's blocks stamped at or before its own stamp: found by the
        stamp groups when they are kept, else by a scan from the tail for the
        first block and from the block placed before it for the rest (blocks
        given in stamp order, as the tagger gives them, move forward only), so
        the cost is the number of blocks moved plus the blocks freed into that
        class since, however long the lists are.
        Returns the number of blocks moved.
        """
        moved = 0
        stamp_of = self.stamp
        cls_of = self.block_class
        counters = self.counters
        grouped = self._grouped
        placed: KVCacheBlock | None = None  # the block this call placed last (not grouped)
        for b in blocks:
            if b.next_free_block is None or b.wa_block_hash is None:
                continue
            bid = b.block_id
            old = cls_of[bid]
            if old == new_class or bid in self._hashed_first:
                continue
            if grouped and self._is_first[bid]:
                self._ungroup(b, old)
            b.prev_free_block.next_free_block = b.next_free_block
            b.next_free_block.prev_free_block = b.prev_free_block
            s = stamp_of[bid]
            if grouped:
                prev, after = self._group_slot(new_class, s, b)
            else:
                prev, after = self._insertion_point(new_class, s, placed)
            b.prev_free_block = prev
            b.next_free_block = after
            prev.next_free_block = b
            after.prev_free_block = b
            cls_of[bid] = new_class
            counters.freed[new_class] += 1  # (never decreased: the metrics export counters)
            moved += 1
            placed = b
        if moved:
            counters.reclassified += moved
            self._sel_dirty = True
        return moved

    def retire_idle_classes(self, now: float, unused_since: float = -math.inf) -> list[int]:
        """Give back the ids of classes unused for the registry's retire time
        (or since ``unused_since``, if later: the tagger's class key changed).

        Their free blocks join the ``default`` class (in free-stamp order, so
        they are scored by the default model); held blocks still marked with
        a retired id are re-marked, so a reused id never inherits them.
        Runs on the engine thread, between calls; costs a pass over the
        per-block class array when something retires (rarely).
        """
        retired = self.registry.retire_idle(now, unused_since)
        if not retired:
            return retired
        moved = 0
        for c in retired:
            moved += self._merge_into(c, DEFAULT_ID)
            self._active._scorers.pop(c, None)
            self.counters.freed[c] = self.counters.reused[c] = self.counters.evicted[c] = 0
            if self._is_live[c]:
                self._is_live[c] = 0
                self._live.remove(c)
        gone = set(retired)
        self.block_class[:] = [DEFAULT_ID if c in gone else c for c in self.block_class]
        if moved:
            self.registry.touch(DEFAULT_ID, now)
        self._sel_dirty = True
        return retired

    def _merge_into(self, src: int, dst: int) -> int:
        """Move every block of list ``src`` into list ``dst``, keeping free-stamp order."""
        head_s, tail_s = self._heads[src], self._tails[src]
        moving = []
        b = head_s.next_free_block
        while b is not tail_s:
            moving.append(b)
            b = b.next_free_block
        if not moving:
            return 0
        head_s.next_free_block = tail_s
        tail_s.prev_free_block = head_s
        self._grouped = False  # rebuilt by the next lookup-stamped release
        stamp_of, cls_of = self.stamp, self.block_class
        cur, tail = self._heads[dst], self._tails[dst]
        if cur.next_free_block is tail:
            self._went_live(dst)
        for b in moving:
            s = stamp_of[b.block_id]
            nxt = cur.next_free_block
            while nxt is not tail and stamp_of[nxt.block_id] <= s:
                cur, nxt = nxt, nxt.next_free_block
            b.prev_free_block, b.next_free_block = cur, nxt
            cur.next_free_block = nxt.prev_free_block = b
            cls_of[b.block_id] = dst
            cur = b
        return len(moving)

    def free_blocks_by_class(self) -> dict[str, int]:
        """Number of free blocks per class name (walks the lists: tests, demos)."""
        reg = self.registry
        out: dict[str, int] = {}
        for c in self._live:
            n, b, tail = 0, self._heads[c].next_free_block, self._tails[c]
            while b is not tail:
                n, b = n + 1, b.next_free_block
            if n:
                out[reg.name_of(c)] = n
        return out

    def check_invariants(self) -> None:
        """Walk every list and check links, classes, stamps and the count (tests)."""
        total = 0
        first_to_go: set[int] = set()  # the ids in the evict-first list
        for c in range(self.num_classes_cap + 1):
            head, tail = self._heads[c], self._tails[c]
            b, prev, n, last_stamp = head.next_free_block, head, 0, -_INF
            while b is not tail:
                assert b is not None, f"list {c} is broken"
                assert b.prev_free_block is prev, f"bad prev link in list {c}"
                if c != self._nohash:
                    assert self.block_class[b.block_id] == c, "block filed under wrong class"
                    s = self.stamp[b.block_id]
                    assert s >= last_stamp, f"list {c} is not in free-stamp order"
                    last_stamp = s
                else:
                    first_to_go.add(b.block_id)
                    assert b.wa_block_hash is None or b.block_id in self._hashed_first, "cached block first-to-go untracked"
                prev, b, n = b, b.next_free_block, n + 1
            assert tail.prev_free_block is prev
            assert n == 0 or c == self._nohash or self._is_live[c], f"list {c} not marked live"
            if self._grouped and c != self._nohash:
                self._check_groups(c)
            total += n
        assert total == self.num_free_blocks, f"{total} linked != {self.num_free_blocks} counted"
        assert self._hashed_first <= first_to_go, "a tracked first-to-go block left that list"
        if self._grouped:
            firsts = {blk.block_id for g in self._groups for blk in g.first.values()}
            flagged = {i for i, f in enumerate(self._is_first) if f}
            assert firsts == flagged, "group-first flags differ from the groups"

    def _check_groups(self, c: int) -> None:
        """List ``c``'s kept stamp groups are those a walk of the list finds."""
        keys, first = self._stamp_runs(c)
        g = self._groups[c]
        assert list(g.keys) == keys, f"list {c}: stamp groups {list(g.keys)} != {keys}"
        assert set(g.first) == set(keys), f"list {c}: group firsts for stamps it does not hold"
        assert all(g.first[k] is first[k] for k in keys), f"list {c}: a group's first block is wrong"

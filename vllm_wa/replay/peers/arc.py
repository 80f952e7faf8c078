"""``arc``: vLLM's ``ARCCachePolicy`` on the GPU prefix cache.

Source: vLLM 0.32's ``vllm/v1/kv_offload/cpu/policies/arc.py``
(``ARCCachePolicy``) driven by ``vllm/v1/kv_offload/cpu/manager.py``
(``CPUOffloadingManager``), the version this project installs (it is also
what https://github.com/vllm-project/vllm/pull/27039 became after the T1
fallback of https://github.com/vllm-project/vllm/pull/55461 and the
request-scoped accesses that replaced per-lookup ``touch``). ARC itself:
Megiddo & Modha, FAST '03.

The calls follow the manager, one request at a time:

* ``prepare_store`` (the request's new keys): the keys not resident are
  store misses; each one found in ghost list B1 (B2), in reverse prompt order,
  raises (lowers) the adaptive target size of T1 by ``max(1, |B2|/|B1|)``
  (``max(1, |B1|/|B2|)``), bounded by the capacity (``on_store_miss``, once
  per request); then room is made by eviction and the new keys are
  ``insert``-ed into T1 and leave the ghost lists;
* eviction takes, while the (virtual) size of T1 is at least its target, T1's
  least recent evictable entry, else T2's, else T1's (#55461); victims go to
  B1/B2, and each ghost list is trimmed to the capacity;
* when the request finishes (``on_request_finished``), its keys are walked in
  reverse prompt order: a key it only inserted keeps its list and moves to
  that list's MRU end ("a store is not a frequency hit"), a ready key it
  reused (loaded, or found already stored) moves from T1 to T2 or to T2's MRU
  end. So a request's blocks leave it head-most-recent: the tail of a prompt
  is evicted before its head, as with vLLM's own free queue.

GPU-side translation: a request's reused keys are its prefix-cache hits (and
any key of its prompt still held by another block past the hit prefix, which
vLLM recomputes into a block of its own); its inserted keys are its new
blocks. Only free blocks (``ref_cnt == 0`` in the source) are eligible.
Resident entries are blocks, ghosts are keys (trace block hashes). Knobs:
none (the T1/T2 split adapts online). Client hints: none.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.replay.peers.base import PeerQueue, RequestHints, ResidentKeys

_T1, _T2 = 1, 2


class ARCQueue(PeerQueue):
    """ARC over cached blocks; free entries wait in per-list queues by recency stamp.

    Stamps come from one counter, and the engines file a request's blocks right
    after ``on_free`` re-stamps them, in stamp order: each list's entries wait
    in a deque while they arrive in order, and in the list's heap when one
    arrives out of order (a driver that files blocks later, or in another
    order). A pop takes the smaller of the two heads: the order one heap of all
    entries gives, at a deque's cost (ARC's replays ran 20 to 28 % faster).

    Args:
        blocks: the free blocks.
        capacity: the cache size in blocks (bounds the target and ghost lists).
        num_block_ids: size of the per-block arrays.
    """

    def __init__(self, blocks: list[KVCacheBlock], capacity: int, num_block_ids: int | None = None) -> None:
        self.capacity = capacity
        self.target_t1_size = 0.0
        self.resident = ResidentKeys()
        self.b1: OrderedDict[Any, None] = OrderedDict()
        self.b2: OrderedDict[Any, None] = OrderedDict()
        self.t1_size = 0
        self.t2_size = 0
        self._tick = 0
        # Free resident entries of T1 / T2 as ``stamp << id_bits | block id``,
        # ascending in ``_runs``, the rest in ``_heaps``; stale ones (stamp
        # renewed, block pinned) are skipped when popped.
        self._runs: tuple[deque[int], deque[int], deque[int]] = (deque(), deque(), deque())
        self._heaps: tuple[list[int], list[int], list[int]] = ([], [], [])
        # Running requests: (hit blocks, cached blocks, prompt positions of keys
        # another block held when the request was stored).
        self._running: dict[str, tuple[int, int, list[int]]] = {}
        super().__init__(blocks, num_block_ids)
        n = self.num_block_ids
        self.where = bytearray(n)
        self.stamp = [0] * n
        self.id_bits = max(1, n.bit_length())

    # ---- store miss, insert, request finished -----------------------------------------------

    def on_lookup(
        self, req: RequestHints, hit_blocks: Sequence[KVCacheBlock], hashes: Sequence[Any], now: float,
        full_blocks: int | None = None,
    ) -> None:
        # on_store_miss: before the eviction that makes room for the new keys.
        b1, b2 = self.b1, self.b2
        if not (b1 or b2):
            return
        # A ghost key is never resident (a key leaves the ghost lists when it
        # is stored, and joins one only when no block holds it), so the store
        # misses that meet a ghost are the prompt's keys past the hit prefix
        # found in B1 or B2, found with C-level set intersections.
        misses = hashes[len(hit_blocks) :]
        in_b1 = b1.keys() & misses
        in_b2 = b2.keys() & misses
        if not (in_b1 or in_b2):
            return
        if in_b1 and in_b2:  # both lists: the updates interleave, in reverse prompt order
            for key in reversed(misses):
                if key in in_b1:
                    r = len(b2) / len(b1)
                    self.target_t1_size = min(self.target_t1_size + max(1.0, r), self.capacity)
                    b1.move_to_end(key)
                elif key in in_b2:
                    r = len(b1) / len(b2)
                    self.target_t1_size = max(self.target_t1_size - max(1.0, r), 0.0)
                    b2.move_to_end(key)
            return
        # One list (a move keeps its size, so each step is the same): the
        # same float steps, with the list reordered by C-level calls.
        ghosts, found = (b1, in_b1) if in_b1 else (b2, in_b2)
        keys = [key for key in reversed(misses) if key in found]
        r = (len(b2) / len(b1)) if ghosts is b1 else (len(b1) / len(b2))
        step = max(1.0, r)
        t, cap = self.target_t1_size, self.capacity
        if ghosts is b1:
            for _ in keys:
                t = min(t + step, cap)
        else:
            for _ in keys:
                t = max(t - step, 0.0)
        self.target_t1_size = t
        deque(map(ghosts.move_to_end, keys), maxlen=0)

    def on_admitted(self, req: RequestHints, blocks: Sequence[KVCacheBlock], n_hit: int, now: float) -> None:
        hashes, key_of, where, stamp = req.hashes, self.key_of, self.where, self.stamp
        b1, b2, resident = self.b1, self.b2, self.resident
        setdefault = resident.primary.setdefault
        new_keys = hashes[n_hit : len(blocks)]
        # Stored keys leave the ghost lists (C-level intersections).
        if b1:
            deque(map(b1.__delitem__, b1.keys() & new_keys), maxlen=0)
        if b2:
            deque(map(b2.__delitem__, b2.keys() & new_keys), maxlen=0)
        tick = self._tick
        bids = [b.block_id for b in blocks[n_hit:]]
        held_elsewhere: list[int] = []
        for bid, key, t in zip(bids, new_keys, range(tick + 1, tick + 1 + len(bids))):
            key_of[bid] = key
            where[bid] = _T1
            stamp[bid] = t
            if setdefault(key, bid) != bid:
                resident.add(key, bid)  # a second block holding the key
                held_elsewhere.append(n_hit + bids.index(bid))
        self.t1_size += len(bids)
        self._tick = tick + len(bids)
        self._running[req.request_id] = (n_hit, len(blocks), held_elsewhere)

    def on_free(self, req: RequestHints, blocks: Sequence[KVCacheBlock], now: float) -> None:
        got = self._running.pop(req.request_id, None)
        if got is None:
            return
        n_hit, n_cached, held_elsewhere = got
        where, stamp, is_free, shift = self.where, self.stamp, self.is_free, self.id_bits
        primary, h2, r2 = self.resident.primary, self._heaps[_T2], self._runs[_T2]
        hashes = req.hashes
        tick = self._tick
        promoted = 0
        if not held_elsewhere:
            # Inserted only: each to its list's MRU end, tail first.
            for bid in reversed([b.block_id for b in blocks[n_hit:n_cached]]):
                tick += 1
                stamp[bid] = tick
            # Reused (hits, pinned by this request): to T2's MRU end, tail first.
            for bid in reversed([b.block_id for b in blocks[:n_hit]]):
                if where[bid] == _T1:
                    where[bid] = _T2
                    promoted += 1
                tick += 1
                stamp[bid] = tick
            self.t1_size -= promoted
            self.t2_size += promoted
            self._tick = tick
            return
        other = set(held_elsewhere)
        for j in range(n_cached - 1, -1, -1):
            bid = blocks[j].block_id
            if j >= n_hit:
                # Inserted only: its list's MRU end.
                tick += 1
                stamp[bid] = tick
                if j not in other:
                    continue
                # The key was also found stored (another block): reused.
                bid = primary.get(hashes[j], -1)
                if bid < 0 or bid == blocks[j].block_id or not where[bid]:
                    continue
            if where[bid] == _T1:
                where[bid] = _T2
                promoted += 1
            tick += 1
            stamp[bid] = tick
            if is_free[bid]:  # someone else's free block: re-queue it in place
                e = (tick << shift) | bid
                if not r2 or e > r2[-1]:
                    r2.append(e)
                else:
                    heapq.heappush(h2, e)
        self.t1_size -= promoted
        self.t2_size += promoted
        self._tick = tick

    # ---- queue ------------------------------------------------------------------------------

    def _unfree_cached_n(self, blocks: list[KVCacheBlock]) -> None:
        """Nothing to do: a pinned block's queued entries are skipped when popped."""

    def _free_cached(self, blocks: list[KVCacheBlock]) -> None:
        heaps, runs, where, stamp, shift = self._heaps, self._runs, self.where, self.stamp, self.id_bits
        heappush = heapq.heappush
        for b in blocks:
            bid = b.block_id
            e = (stamp[bid] << shift) | bid
            run = runs[where[bid]]
            if not run or e > run[-1]:
                run.append(e)
            else:
                heappush(heaps[where[bid]], e)
        queued = len(heaps[_T1]) + len(heaps[_T2]) + len(runs[_T1]) + len(runs[_T2])
        if queued > 4 * (self.num_free_blocks + 1024):
            self._compact()

    def _evict(self, n: int) -> list[KVCacheBlock]:
        stamp, is_free = self.stamp, self.is_free
        h1, h2 = self._heaps[_T1], self._heaps[_T2]
        r1, r2 = self._runs[_T1], self._runs[_T2]
        heappop = heapq.heappop
        shift = self.id_bits
        mask = (1 << shift) - 1
        # Victims in eviction order, and those taken from T1 / T2.
        order: list[int] = []
        from_t1: list[int] = []
        from_t2: list[int] = []
        virtual_t1 = self.t1_size
        target = int(self.target_t1_size)
        # Stamps are unique and renewed on every move between lists, so an
        # entry whose stamp still matches is in the list its run or heap stands for.

        def take(run: deque[int], heap: list[int], k: int, into: list[int]) -> int:
            # Up to k entries of the list, least stamp first (the smaller head
            # of its run and its heap), appended to ``into``; how many.
            start = len(into)
            if not heap:  # the usual case: the run alone
                popleft = run.popleft
                while k and run:
                    e = popleft()
                    b = e & mask
                    if is_free[b] and stamp[b] == e >> shift:
                        is_free[b] = 0  # not eligible again in this pass
                        into.append(b)
                        k -= 1
            else:
                while k:
                    if heap and (not run or heap[0] < run[0]):
                        e = heappop(heap)
                    elif run:
                        e = run.popleft()
                    else:
                        break
                    b = e & mask
                    if is_free[b] and stamp[b] == e >> shift:
                        is_free[b] = 0
                        into.append(b)
                        k -= 1
            got = len(into) - start
            if got:
                order.extend(into[start:])
            return got

        # Per victim, ARC takes T1's LRU entry while T1 is at or above its
        # target, else T2's, else T1's (vLLM #55461); taken here in runs.
        while len(order) < n:
            need = n - len(order)
            if virtual_t1 >= target:
                got = take(r1, h1, min(need, virtual_t1 - target + 1), from_t1)
                virtual_t1 -= got
                if got or take(r2, h2, need, from_t2):
                    continue
            elif take(r2, h2, need, from_t2):
                continue
            else:
                got = take(r1, h1, need, from_t1)
                virtual_t1 -= got
                if got:
                    continue
            raise RuntimeError("ARC found fewer evictable blocks than the queue counts")
        # Commit: the victims leave T1/T2 for the ghost lists.
        key_of, where, resident = self.key_of, self.where, self.resident
        if not resident._others:
            # No key is held twice: every victim's key goes (C-level loops;
            # each ghost list keeps its victims' eviction order).
            primary = resident.primary
            for victims, ghosts in ((from_t1, self.b1), (from_t2, self.b2)):
                if victims:
                    keys = [key_of[bid] for bid in victims]
                    deque(map(primary.__delitem__, keys), maxlen=0)
                    ghosts.update(dict.fromkeys(keys))
        else:
            t1 = set(from_t1)
            b1, b2, discard = self.b1, self.b2, resident.discard
            for bid in order:
                key = key_of[bid]
                if discard(key, bid):
                    (b1 if bid in t1 else b2)[key] = None
        for bid in order:
            where[bid] = 0
            key_of[bid] = None
        self.t1_size -= len(from_t1)
        self.t2_size -= len(from_t2)
        cap = self.capacity
        for ghosts in (self.b1, self.b2):
            for _ in range(len(ghosts) - cap):
                ghosts.popitem(last=False)
        block = self.block
        return [block[bid] for bid in order]

    def _compact(self) -> None:
        stamp, is_free, shift = self.stamp, self.is_free, self.id_bits
        mask = (1 << shift) - 1
        for lst in (_T1, _T2):
            live = [e for e in self._heaps[lst] if is_free[e & mask] and stamp[e & mask] == e >> shift]
            heapq.heapify(live)
            self._heaps[lst][:] = live
            run = self._runs[lst]
            kept = [e for e in run if is_free[e & mask] and stamp[e & mask] == e >> shift]
            run.clear()
            run.extend(kept)

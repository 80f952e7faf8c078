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

    def on_lookup(self, req: RequestHints, hit_blocks: Sequence[KVCacheBlock], hashes: Sequence[Any], now: float) -> None:
        # on_store_miss: before the eviction that makes room for the new keys.
        b1, b2 = self.b1, self.b2
        if not (b1 or b2):
            return
        primary = self.resident.primary
        for j in range(len(hashes) - 1, len(hit_blocks) - 1, -1):
            key = hashes[j]
            if key in primary:
                continue  # stored already: not a store miss
            if b1 and key in b1:
                r = len(b2) / len(b1)
                self.target_t1_size = min(self.target_t1_size + (r if r > 1.0 else 1.0), self.capacity)
                b1.move_to_end(key)
            elif b2 and key in b2:
                r = len(b1) / len(b2)
                self.target_t1_size = max(self.target_t1_size - (r if r > 1.0 else 1.0), 0.0)
                b2.move_to_end(key)

    def on_admitted(self, req: RequestHints, blocks: Sequence[KVCacheBlock], n_hit: int, now: float) -> None:
        hashes, key_of, where, stamp = req.hashes, self.key_of, self.where, self.stamp
        b1, b2, resident = self.b1, self.b2, self.resident
        primary = resident.primary
        tick = self._tick
        held_elsewhere: list[int] = []
        for j in range(n_hit, len(blocks)):
            bid = blocks[j].block_id
            key = hashes[j]
            key_of[bid] = key
            where[bid] = _T1
            tick += 1
            stamp[bid] = tick
            if b1 and key in b1:
                del b1[key]
            if b2 and key in b2:
                del b2[key]
            if primary.setdefault(key, bid) != bid:
                resident.add(key, bid)  # a second block holding the key
                held_elsewhere.append(j)
        self.t1_size += len(blocks) - n_hit
        self._tick = tick
        self._running[req.request_id] = (n_hit, len(blocks), held_elsewhere)

    def on_free(self, req: RequestHints, blocks: Sequence[KVCacheBlock], now: float) -> None:
        got = self._running.pop(req.request_id, None)
        if got is None:
            return
        n_hit, n_cached, held_elsewhere = got
        where, stamp, is_free, shift = self.where, self.stamp, self.is_free, self.id_bits
        primary, h2, r2 = self.resident.primary, self._heaps[_T2], self._runs[_T2]
        hashes = req.hashes
        other = set(held_elsewhere)
        tick = self._tick
        promoted = 0
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
        stamp, is_free, block = self.stamp, self.is_free, self.block
        h1, h2 = self._heaps[_T1], self._heaps[_T2]
        r1, r2 = self._runs[_T1], self._runs[_T2]
        heappop = heapq.heappop
        shift = self.id_bits
        mask = (1 << shift) - 1
        out: list[KVCacheBlock] = []
        from_t1: list[bool] = []
        virtual_t1 = self.t1_size
        target = int(self.target_t1_size)
        # Stamps are unique and renewed on every move between lists, so an
        # entry whose stamp still matches is in the list its run or heap stands for.

        def pop_valid(run: deque[int], heap: list[int]) -> int:
            # The least stamp of the list: the smaller head of its run and its heap.
            while True:
                if heap and (not run or heap[0] < run[0]):
                    e = heappop(heap)
                elif run:
                    e = run.popleft()
                else:
                    return -1
                b = e & mask
                if is_free[b] and stamp[b] == e >> shift:
                    return b

        for _ in range(n):
            bid = pop_valid(r1, h1) if virtual_t1 >= target else -1
            if bid >= 0:
                virtual_t1 -= 1
                from_t1.append(True)
            else:
                bid = pop_valid(r2, h2)
                if bid >= 0:
                    from_t1.append(False)
                else:  # vLLM #55461: fall back to T1
                    bid = pop_valid(r1, h1)
                    if bid < 0:
                        raise RuntimeError("ARC found fewer evictable blocks than the queue counts")
                    virtual_t1 -= 1
                    from_t1.append(True)
            is_free[bid] = 0  # not eligible again in this pass
            out.append(block[bid])
        # Commit: the victims leave T1/T2 for the ghost lists.
        b1, b2, key_of, resident, where = self.b1, self.b2, self.key_of, self.resident, self.where
        primary, others = resident.primary, resident._others
        n1 = 0
        for b, t1 in zip(out, from_t1):
            bid = b.block_id
            key = key_of[bid]
            if others and key in others:
                gone = resident.discard(key, bid)
            else:
                del primary[key]
                gone = True
            if t1:
                n1 += 1
                if gone:
                    b1[key] = None
            elif gone:
                b2[key] = None
            where[bid] = 0
            key_of[bid] = None
        self.t1_size -= n1
        self.t2_size -= len(out) - n1
        cap = self.capacity
        while len(b1) > cap:
            b1.popitem(last=False)
        while len(b2) > cap:
            b2.popitem(last=False)
        return out

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

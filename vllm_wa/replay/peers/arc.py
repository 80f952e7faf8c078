"""``arc``: vLLM's ``ARCCachePolicy`` on the GPU prefix cache.

Source: vLLM ``vllm/v1/kv_offload/cpu/policies/arc.py`` (``ARCCachePolicy``,
introduced by https://github.com/vllm-project/vllm/pull/27039, read at commit
02957b5ac0f91813c434af93d5498b55f2aeaad1), with the T1 fallback of
https://github.com/vllm-project/vllm/pull/55461 (evict from T1 when T2 has no
eligible entry left instead of failing). ARC itself: Megiddo & Modha, FAST '03.

The calls follow vLLM's offloading connector, which drives the policy:

* every lookup ``touch``-es all of the prompt's keys, in reverse order: a key
  in T1 moves to T2, a key in T2 moves to T2's MRU end, a key in ghost list
  B1 (B2) raises (lowers) the adaptive target size of T1 by
  ``max(1, |B2|/|B1|)`` (``max(1, |B1|/|B2|)``), bounded by the capacity;
* the request's new blocks are ``insert``-ed into T1 in prompt order, and
  leave the ghost lists;
* eviction takes, while the (virtual) size of T1 is at least its target, T1's
  least recent evictable entry, else T2's (else T1's); victims go to B1/B2,
  and each ghost list is trimmed to the capacity.

Only free blocks (``ref_cnt == 0`` in the source) are eligible; pinned ones
are skipped, as in the source. Resident entries are blocks, ghosts are keys
(trace block hashes). Knobs: none (the T1/T2 split adapts online). Client
hints: none.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.replay.peers.base import PeerQueue, RequestHints, ResidentKeys

_T1, _T2 = 1, 2


class ARCQueue(PeerQueue):
    """ARC over cached blocks; free entries wait in per-list heaps by recency stamp.

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
        # Free resident entries of T1 / T2 as (stamp, block id); stale entries
        # (stamp or list changed, block pinned) are skipped when popped.
        self._heaps: tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]] = ([], [], [])
        self._pending_hits: Sequence[KVCacheBlock] = ()
        super().__init__(blocks, num_block_ids)
        n = self.num_block_ids
        self.where = bytearray(n)
        self.stamp = [0] * n

    # ---- touch and insert -------------------------------------------------------------------

    def on_lookup(self, req: RequestHints, hit_blocks: Sequence[KVCacheBlock], hashes: Sequence[Any], now: float) -> None:
        primary = self.resident.primary
        where, stamp, is_free, heaps = self.where, self.stamp, self.is_free, self._heaps
        b1, b2 = self.b1, self.b2
        n_hit = len(hit_blocks)
        tick = self._tick
        for j in range(len(hashes) - 1, -1, -1):
            key = hashes[j]
            bid = primary.get(key)
            if bid is not None:
                w = where[bid]
                if w == _T1:
                    where[bid] = _T2
                    self.t1_size -= 1
                    self.t2_size += 1
                tick += 1
                stamp[bid] = tick
                # Hits are pinned right after; other free entries move in place.
                if j >= n_hit and is_free[bid]:
                    heapq.heappush(heaps[_T2], (tick, bid))
            elif key in b1:
                delta = max(1.0, len(b2) / len(b1))
                self.target_t1_size = min(self.target_t1_size + delta, self.capacity)
                b1.move_to_end(key)
            elif key in b2:
                delta = max(1.0, len(b1) / len(b2))
                self.target_t1_size = max(self.target_t1_size - delta, 0.0)
                b2.move_to_end(key)
        self._tick = tick
        self._pending_hits = hit_blocks

    def forget(self, request_id: str, now: float) -> None:
        # The hits stay free: they keep their new place in T2.
        for b in self._pending_hits:
            bid = b.block_id
            if self.is_free[bid]:
                heapq.heappush(self._heaps[self.where[bid]], (self.stamp[bid], bid))
        self._pending_hits = ()

    def on_admitted(self, req: RequestHints, blocks: Sequence[KVCacheBlock], n_hit: int, now: float) -> None:
        self._pending_hits = ()
        hashes, key_of, where, stamp = req.hashes, self.key_of, self.where, self.stamp
        b1, b2, resident = self.b1, self.b2, self.resident
        tick = self._tick
        for j in range(n_hit, len(blocks)):
            bid = blocks[j].block_id
            key = hashes[j]
            key_of[bid] = key
            where[bid] = _T1
            tick += 1
            stamp[bid] = tick
            b1.pop(key, None)
            b2.pop(key, None)
            resident.add(key, bid)
        self.t1_size += len(blocks) - n_hit
        self._tick = tick

    # ---- queue ------------------------------------------------------------------------------

    def _free_cached(self, blocks: list[KVCacheBlock]) -> None:
        heaps, where, stamp = self._heaps, self.where, self.stamp
        for b in blocks:
            bid = b.block_id
            heapq.heappush(heaps[where[bid]], (stamp[bid], bid))
        if len(heaps[_T1]) + len(heaps[_T2]) > 4 * (self.num_free_blocks + 1024):
            self._compact()

    def _pop(self, lst: int) -> int | None:
        heap, where, stamp, is_free = self._heaps[lst], self.where, self.stamp, self.is_free
        while heap:
            s, bid = heapq.heappop(heap)
            if is_free[bid] and where[bid] == lst and stamp[bid] == s:
                return bid
        return None

    def _evict(self, n: int) -> list[KVCacheBlock]:
        out: list[KVCacheBlock] = []
        virtual_t1 = self.t1_size
        target = int(self.target_t1_size)
        while len(out) < n:
            bid = None
            if virtual_t1 >= target:
                bid = self._pop(_T1)
                if bid is not None:
                    virtual_t1 -= 1
            if bid is None:
                bid = self._pop(_T2)
            if bid is None:  # vLLM #55461: fall back to T1
                bid = self._pop(_T1)
                if bid is not None:
                    virtual_t1 -= 1
            if bid is None:
                raise RuntimeError("ARC found fewer evictable blocks than the queue counts")
            self.is_free[bid] = 0  # not eligible again in this pass
            out.append(self.block[bid])
        # Commit: the victims leave T1/T2 for the ghost lists.
        b1, b2, where, key_of, resident = self.b1, self.b2, self.where, self.key_of, self.resident
        for b in out:
            bid = b.block_id
            key = key_of[bid]
            gone = resident.discard(key, bid)
            if where[bid] == _T1:
                self.t1_size -= 1
                if gone:
                    b1[key] = None
            else:
                self.t2_size -= 1
                if gone:
                    b2[key] = None
            where[bid] = 0
            key_of[bid] = None
        cap = self.capacity
        while len(b1) > cap:
            b1.popitem(last=False)
        while len(b2) > cap:
            b2.popitem(last=False)
        return out

    def _compact(self) -> None:
        where, stamp, is_free = self.where, self.stamp, self.is_free
        for lst in (_T1, _T2):
            live = [(s, bid) for s, bid in self._heaps[lst] if is_free[bid] and where[bid] == lst and stamp[bid] == s]
            heapq.heapify(live)
            self._heaps[lst][:] = live

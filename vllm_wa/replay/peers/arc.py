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
        # Free resident entries of T1 / T2 as ``stamp << id_bits | block id``;
        # stale ones (stamp renewed, block pinned) are skipped when popped.
        self._heaps: tuple[list[int], list[int], list[int]] = ([], [], [])
        self._pending_hits: Sequence[KVCacheBlock] = ()
        super().__init__(blocks, num_block_ids)
        n = self.num_block_ids
        self.where = bytearray(n)
        self.stamp = [0] * n
        self.id_bits = max(1, n.bit_length())

    # ---- touch and insert -------------------------------------------------------------------

    def on_lookup(self, req: RequestHints, hit_blocks: Sequence[KVCacheBlock], hashes: Sequence[Any], now: float) -> None:
        primary = self.resident.primary
        where, stamp, is_free = self.where, self.stamp, self.is_free
        h2, shift = self._heaps[_T2], self.id_bits
        b1, b2 = self.b1, self.b2
        n_hit = len(hit_blocks)
        tick = self._tick
        promoted = 0
        # Reverse prompt order, as the source; first the part past the hit prefix.
        for j in range(len(hashes) - 1, n_hit - 1, -1):
            key = hashes[j]
            bid = primary.get(key)
            if bid is not None:
                if where[bid] == _T1:
                    where[bid] = _T2
                    promoted += 1
                tick += 1
                stamp[bid] = tick
                if is_free[bid]:  # stays free: it moves in place
                    heapq.heappush(h2, (tick << shift) | bid)
            elif b1 and key in b1:
                r = len(b2) / len(b1)
                self.target_t1_size = min(self.target_t1_size + (r if r > 1.0 else 1.0), self.capacity)
                b1.move_to_end(key)
            elif b2 and key in b2:
                r = len(b1) / len(b2)
                self.target_t1_size = max(self.target_t1_size - (r if r > 1.0 else 1.0), 0.0)
                b2.move_to_end(key)
        # The hit prefix: the blocks lookups find for these keys, pinned right after.
        for b in reversed(hit_blocks):
            bid = b.block_id
            if where[bid] == _T1:
                where[bid] = _T2
                promoted += 1
            tick += 1
            stamp[bid] = tick
        self.t1_size -= promoted
        self.t2_size += promoted
        self._tick = tick
        self._pending_hits = hit_blocks

    def forget(self, request_id: str, now: float) -> None:
        # The hits stay free: they keep their new place in T2.
        for b in self._pending_hits:
            bid = b.block_id
            if self.is_free[bid]:
                heapq.heappush(self._heaps[self.where[bid]], (self.stamp[bid] << self.id_bits) | bid)
        self._pending_hits = ()

    def on_admitted(self, req: RequestHints, blocks: Sequence[KVCacheBlock], n_hit: int, now: float) -> None:
        self._pending_hits = ()
        hashes, key_of, where, stamp = req.hashes, self.key_of, self.where, self.stamp
        b1, b2, resident = self.b1, self.b2, self.resident
        primary = resident.primary
        tick = self._tick
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
        self.t1_size += len(blocks) - n_hit
        self._tick = tick

    # ---- queue ------------------------------------------------------------------------------

    def _unfree_cached_n(self, blocks: list[KVCacheBlock]) -> None:
        """Nothing to do: a pinned block's heap entries are skipped when popped."""

    def _free_cached(self, blocks: list[KVCacheBlock]) -> None:
        heaps, where, stamp, shift = self._heaps, self.where, self.stamp, self.id_bits
        for b in blocks:
            bid = b.block_id
            heapq.heappush(heaps[where[bid]], (stamp[bid] << shift) | bid)
        if len(heaps[_T1]) + len(heaps[_T2]) > 4 * (self.num_free_blocks + 1024):
            self._compact()

    def _evict(self, n: int) -> list[KVCacheBlock]:
        stamp, is_free, block = self.stamp, self.is_free, self.block
        h1, h2 = self._heaps[_T1], self._heaps[_T2]
        heappop = heapq.heappop
        shift = self.id_bits
        mask = (1 << shift) - 1
        out: list[KVCacheBlock] = []
        from_t1: list[bool] = []
        virtual_t1 = self.t1_size
        target = int(self.target_t1_size)
        # Stamps are unique and renewed on every move between lists, so an
        # entry whose stamp still matches is in the list its heap stands for.
        for _ in range(n):
            bid = -1
            if virtual_t1 >= target:
                while h1:
                    e = heappop(h1)
                    b = e & mask
                    if is_free[b] and stamp[b] == e >> shift:
                        bid = b
                        break
            if bid >= 0:
                virtual_t1 -= 1
                from_t1.append(True)
            else:
                while h2:
                    e = heappop(h2)
                    b = e & mask
                    if is_free[b] and stamp[b] == e >> shift:
                        bid = b
                        break
                if bid >= 0:
                    from_t1.append(False)
                else:  # vLLM #55461: fall back to T1
                    while h1:
                        e = heappop(h1)
                        b = e & mask
                        if is_free[b] and stamp[b] == e >> shift:
                            bid = b
                            break
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

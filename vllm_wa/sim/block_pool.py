"""A block-level model of vLLM's prefix-caching block pool, for fast replays.

It runs the very same free-queue objects as the engine (vLLM's
``FreeKVCacheBlockQueue``, :class:`WorkloadAwareFreeQueue`, the Belady queue)
over real ``KVCacheBlock`` objects (a queue may offer ``remove_n``, the
same as ``remove`` on each block in turn, to take a prompt's hits at once), and mirrors the order of operations of
``KVCacheManager`` for a single full-attention group: look the prompt up
(the last block is never a hit, as vLLM recomputes it for logits), check that
new blocks plus touched free hits fit, touch the hits, pop new blocks
(evicting their old hashes), cache the prompt, and on release free the blocks
tail first.  A test checks that it gives the same hits as the real manager.

Hashes here are the trace's integer block ids (or any hashable).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import is_
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.kv_block import install_hash_alias

# Blocks a prefix lookup checks first; each further chunk is twice as long.
_FIRST_CHUNK = 64


class SimBlockPool:
    """Prefix cache of ``num_blocks`` blocks (block 0 is vLLM's null block).

    Args:
        num_blocks: pool size including the null block.
        make_queue: builds the free queue from the block list.
        prefix_hits: True for vLLM's rule (a hit is the longest cached
            prefix); False counts every cached block.
        last_block_hits: whether a prompt's last block can hit (vLLM always
            recomputes it; a hash-sampled prompt's last sample is not special).
        id_space: ``n`` when every hash is an int in ``0 .. n-1`` (a replay's
            renumbered ids): the hash map is then a list indexed by hash,
            ``None`` where nothing is cached. A lookup reads one slot of an
            array instead of probing a dict (2.5x faster on cold keys).
    """

    def __init__(
        self,
        num_blocks: int,
        make_queue: Any,
        *,
        prefix_hits: bool = True,
        last_block_hits: bool = False,
        id_space: int | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("a pool needs at least 2 blocks (one is the null block)")
        install_hash_alias()  # the hash slot under one name (vllm_wa.kv_block)
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.queue = make_queue(self.blocks)
        self.null_block = self.queue.popleft()
        self.null_block.is_null = True
        # hash -> the block lookups find; further blocks holding the same hash
        # (vLLM caches the recomputed last block again) wait in ``_dups``,
        # oldest first, like ``BlockHashToBlockMap``.
        self._dense = id_space is not None
        self.cached: dict[Any, KVCacheBlock] | list[KVCacheBlock | None] = (
            [None] * id_space if id_space is not None else {}
        )
        self._dups: dict[Any, list[KVCacheBlock]] = {}
        self.held: dict[str, list[KVCacheBlock]] = {}
        self.prefix_hits = prefix_hits
        self.last_block_hits = last_block_hits

    @property
    def num_free_blocks(self) -> int:
        return self.queue.num_free_blocks

    def lookup(self, hashes: Sequence[Any]) -> list[KVCacheBlock]:
        """Cached blocks of a prompt: its longest cached prefix, minus the last block."""
        limit = len(hashes) if self.last_block_hits else len(hashes) - 1
        if limit <= 0:
            return []
        get = self.cached.__getitem__ if self._dense else self.cached.get
        if not self.prefix_hits:
            return [b for b in map(get, hashes[:limit]) if b is not None]
        # C-level passes over chunks of the prompt, each twice the last, until
        # one holds a miss (``is``: blocks compare by value, which would cost a
        # Python call each): a prompt's uncached tail past that chunk is not
        # looked up (half the lookups of a long prompt that half hits).
        found: list[KVCacheBlock] = []
        start, step = 0, _FIRST_CHUNK
        while start < limit:
            chunk = list(map(get, hashes[start:min(start + step, limit)]))
            missed = list(map(is_, chunk, repeat(None)))
            if True in missed:
                found += chunk[:missed.index(True)]
                return found
            found += chunk
            start += step
            step *= 2
        return found

    def allocate(self, rid: str, hashes: Sequence[Any], hits: list[KVCacheBlock]) -> bool:
        """Pin ``hits`` and new blocks for the rest of the prompt; False if it does not fit."""
        queue = self.queue
        if self.prefix_hits:
            misses = hashes[len(hits):]
        else:
            hit_set = {b.wa_block_hash for b in hits}
            misses = [h for h in hashes if h not in hit_set]
        n_new = len(misses)
        evictable = [b.ref_cnt for b in hits].count(0)
        if n_new + evictable > queue.num_free_blocks:
            return False
        if evictable:
            # A queue may take the free hits in one call (same order, same effect).
            remove_n = getattr(queue, "remove_n", None)
            if remove_n is not None:
                # A prompt that repeats a hash hits one block twice: it leaves
                # the free queue once (in order of first hit), as in vLLM's touch().
                free = []
                for b in hits:
                    if not b.ref_cnt:
                        free.append(b)
                    b.ref_cnt += 1
                remove_n(free)
            else:
                remove = queue.remove
                for b in hits:
                    if b.ref_cnt == 0:
                        remove(b)
                    b.ref_cnt += 1
        else:
            for b in hits:
                b.ref_cnt += 1
        new = queue.popleft_n(n_new)
        cached, dups = self.cached, self._dups
        # The same steps for a list map and a dict map, written out twice: this
        # loop runs for every new block of every prompt, the hottest loop of a
        # replay, and a shared helper would add a Python call per block.
        if self._dense:
            for b, h in zip(new, misses):
                old = b.wa_block_hash
                if old is not None:
                    # Without duplicates the block is the one lookups find.
                    if dups and old in dups:
                        self._uncache(b)
                    else:
                        cached[old] = None
                b.ref_cnt = 1
                b.wa_block_hash = h
                if cached[h] is None:
                    cached[h] = b
                else:
                    dups.setdefault(h, []).append(b)
        else:
            for b, h in zip(new, misses):
                old = b.wa_block_hash
                if old is not None:
                    if dups and old in dups:
                        self._uncache(b)
                    else:
                        del cached[old]
                b.ref_cnt = 1
                b.wa_block_hash = h
                if cached.setdefault(h, b) is not b:
                    dups.setdefault(h, []).append(b)
        if self.prefix_hits:
            hits.extend(new)
            self.held[rid] = hits
        else:
            self.held[rid] = hits + new
        return True

    def _uncache(self, b: KVCacheBlock) -> None:
        """Evict ``b``'s hash (the block is being reallocated)."""
        h = b.wa_block_hash
        dups = self._dups.get(h)
        if (self.cached[h] if self._dense else self.cached.get(h)) is b:
            if dups:
                self.cached[h] = dups.pop(0)
                if not dups:
                    del self._dups[h]
            elif self._dense:
                self.cached[h] = None
            else:
                del self.cached[h]
        elif dups and b in dups:
            dups.remove(b)
            if not dups:
                del self._dups[h]
        b.wa_block_hash = None

    def release(self, rid: str) -> list[KVCacheBlock]:
        """Free a request's blocks, tail first (like ``KVCacheManager.free``)."""
        blocks = self.held.pop(rid)
        # A block is freed where its count reaches zero: once, also when a
        # prompt that repeats an id (trace ids need not be chained) held it twice.
        free = []
        for b in blocks:
            b.ref_cnt -= 1
            if not b.ref_cnt:
                free.append(b)
        free.reverse()
        self.queue.append_n(free)
        return blocks

    def held_blocks(self, rid: str) -> list[KVCacheBlock]:
        return self.held.get(rid, [])

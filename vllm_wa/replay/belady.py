"""Belady's optimum as a free queue: evict the block whose next use is furthest.

The replay knows the future: for every (request, prompt position) it
precomputes the index of the next request whose prompt holds the same block.
Each time a request uses a block the oracle writes that next use into the
queue's per-block array; on eviction the free block with the largest next use
goes (ties: in the order freed, which puts a prompt's deeper blocks first).  A prefix cache cannot use a block
whose parent is gone: a request that misses the parent recomputes it and
everything after it, so a free block whose parent was evicted ("orphan") is
dead weight and is evicted before any block with a future; so is a copy of a
block that another block serves (vLLM recomputes a fully cached prompt's last
block into a second copy).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.kv_block import install_hash_alias
from vllm_wa.replay.trace import Trace

NEVER = np.iinfo(np.int64).max


def blocks_after(order: Iterable[KVCacheBlock], cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
    """The blocks of ``order`` after ``cursor`` (all of them when it is None)."""
    found = cursor is None
    for b in order:
        if found:
            yield b
        elif b is cursor:
            found = True


def next_use_table(trace: Trace, unserved: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """``next_req[offsets[i] + j]``: index of the next request using block j of request i.

    ``NEVER`` when no later request holds that block.  The requests in
    ``unserved`` (indices of requests that do not fit the pool) use nothing:
    they hit no block, so keeping a block for one of them is a loss.
    """
    lengths = np.fromiter((len(r.hash_ids) for r in trace.requests), dtype=np.int64, count=len(trace.requests))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    flat = np.empty(total, dtype=np.int64)
    for i, r in enumerate(trace.requests):
        flat[offsets[i] : offsets[i + 1]] = np.frombuffer(r.hash_ids, dtype=np.int64)
    # Stable sort by hash keeps each hash's occurrences in request order.
    order = np.argsort(flat, kind="stable")
    keys_sorted = flat[order]
    del flat
    sorted_req = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)[order]
    # A prompt's last block is never a hit (vLLM recomputes it), so an
    # occurrence there is no use of the cached block: skip to the next one.
    is_last = np.zeros(total, dtype=bool)
    is_last[offsets[1:][lengths > 0] - 1] = True
    if len(unserved):
        gone = np.zeros(len(lengths), dtype=bool)
        gone[np.asarray(unserved, dtype=np.int64)] = True
        is_last |= np.repeat(gone, lengths)  # no occurrence of theirs is a use either
    hittable = np.flatnonzero(~is_last[order])
    del is_last
    nxt_sorted = np.full(total, NEVER, dtype=np.int64)
    if total > 1 and hittable.size:
        k = np.searchsorted(hittable, np.arange(1, total + 1))
        ok = k < hittable.size
        q = hittable[np.minimum(k, hittable.size - 1)]
        ok &= keys_sorted[q] == keys_sorted
        nxt_sorted[ok] = sorted_req[q[ok]]
    del keys_sorted, sorted_req
    nxt = np.empty(total, dtype=np.int64)
    nxt[order] = nxt_sorted
    return nxt, offsets


class BeladyFreeQueue:
    """Drop-in free queue that evicts by furthest next use (see module doc).

    Free blocks wait in one FIFO bucket per next-use value (request indices,
    so few distinct values); a heap holds the bucket keys.  Re-ranked or
    removed blocks leave stale entries behind, skipped by version.
    """

    def __init__(self, blocks: list[KVCacheBlock], num_block_ids: int | None = None) -> None:
        install_hash_alias()  # the hash slot under one name (vllm_wa.kv_block)
        n = num_block_ids if num_block_ids is not None else max((b.block_id for b in blocks), default=-1) + 1
        self.next_use = [NEVER] * n
        self._version = [0] * n
        self._is_free = bytearray(n)
        # Bucket entries are ``version << id_bits | block id``.
        self._buckets: dict[int, deque[int]] = {}
        self.id_bits = max(1, n.bit_length())
        self._keys: list[int] = []  # max-heap (negated) of bucket keys
        self._entries = 0
        self._fresh: list[KVCacheBlock] = []  # blocks without a hash, evicted first
        # Free blocks no lookup will use: their parent was evicted, or another
        # copy serves their hash. Entries as in the buckets, popped from the end.
        self._orphans: list[int] = []
        self._blocks: list[KVCacheBlock | None] = [None] * n
        # Prefix links recorded by the oracle: the parent block and the hash it
        # held, and each block's children (its first in ``child``, -1 for
        # none; any others in ``more_children``). Entries of blocks that since
        # moved are stale, skipped by the parent check.
        self.parent: list[KVCacheBlock | None] = [None] * n
        self.parent_hash: list[object] = [None] * n
        self.child = [-1] * n
        self.more_children: dict[int, set[int]] = {}
        # Called with an evicted block and its children: True when another
        # block holding its hash keeps them reachable (vLLM looks blocks up by
        # hash), now or once the request being placed holds it; set by the oracle.
        self.keep_children: Callable[[KVCacheBlock, list[int]], bool] | None = None
        self.num_free_blocks = 0
        unhashed = [b for b in blocks if b.wa_block_hash is None]
        self.prepend_n(unhashed)
        self.append_n([b for b in blocks if b.wa_block_hash is not None])

    def _push(self, b: KVCacheBlock) -> None:
        bid = b.block_id
        ver = self._version[bid] + 1
        self._version[bid] = ver
        self._is_free[bid] = 1
        self._blocks[bid] = b
        p = self.parent[bid]
        if p is not None and p.wa_block_hash != self.parent_hash[bid]:
            self._orphans.append((ver << self.id_bits) | bid)
            return
        key = self.next_use[bid]
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = deque()
            heapq.heappush(self._keys, -key)
        bucket.append((ver << self.id_bits) | bid)
        self._entries += 1

    def rekey(self, b: KVCacheBlock) -> None:
        """The oracle changed ``b``'s next use: re-rank it if it is free."""
        if self._is_free[b.block_id] and b.wa_block_hash is not None:
            self._push(b)

    def evict_first(self, b: KVCacheBlock) -> None:
        """``b`` has no use that another block will not serve: if it is free, it
        goes with the orphans, before any block with a future or none (a lookup
        that found it instead of the other copy would pin one more block)."""
        if b.wa_block_hash is not None:
            self.orphan(b.block_id)

    def _orphan_children(self, b: KVCacheBlock) -> None:
        """``b`` is being evicted: its free children can no longer be hit,
        unless another block holds its hash, now or once the request being
        placed writes it (then that block is their parent)."""
        bid = b.block_id
        first = self.child[bid]
        if first < 0:
            return
        self.child[bid] = -1
        parent = self.parent
        kids = [cid for cid in (first, *self.more_children.pop(bid, ())) if parent[cid] is b]
        if not kids or (self.keep_children is not None and self.keep_children(b, kids)):
            return
        for cid in kids:
            self.orphan(cid)

    def is_free(self, bid: int) -> bool:
        """Block ``bid`` is in the queue (not pinned, not popped for eviction)."""
        return bool(self._is_free[bid])

    def orphan(self, cid: int) -> None:
        """Block ``cid`` can no longer be hit: if it is free, it is evicted first."""
        if self._is_free[cid]:
            ver = self._version[cid] + 1  # drops its bucket entry
            self._version[cid] = ver
            self._orphans.append((ver << self.id_bits) | cid)

    def adopt(self, heir: KVCacheBlock, cid: int) -> None:
        """Block ``cid``'s parent is now ``heir`` (which holds the same hash as the one it had)."""
        self.parent[cid] = heir
        hid = heir.block_id
        first = self.child[hid]
        if first < 0:
            self.child[hid] = cid
        elif first != cid:
            self.more_children.setdefault(hid, set()).add(cid)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        version, is_free, parent, parent_hash, next_use = (
            self._version, self._is_free, self.parent, self.parent_hash, self.next_use
        )
        buckets, blocks_by_id, shift = self._buckets, self._blocks, self.id_bits
        last_key, bucket = None, None  # a prompt's blocks mostly share their next use
        for b in blocks:
            bid = b.block_id
            if b.wa_block_hash is None:
                self._fresh.append(b)
                is_free[bid] = 1
                continue
            ver = version[bid] + 1
            version[bid] = ver
            is_free[bid] = 1
            blocks_by_id[bid] = b
            p = parent[bid]
            if p is not None and p.wa_block_hash != parent_hash[bid]:
                self._orphans.append((ver << shift) | bid)
                continue
            key = next_use[bid]
            if key != last_key:
                last_key = key
                bucket = buckets.get(key)
                if bucket is None:
                    bucket = buckets[key] = deque()
                    heapq.heappush(self._keys, -key)
            bucket.append((ver << shift) | bid)
        self._entries += len(blocks)
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        # _fresh is popped from its end: put these where they come out first.
        for b in reversed(blocks):
            self._fresh.append(b)
            self._is_free[b.block_id] = 1
        self.num_free_blocks += len(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if not self._is_free[bid]:
            raise RuntimeError(f"remove() called on a block that is not free: {bid}")
        self._is_free[bid] = 0
        self._version[bid] += 1  # its bucket entry is now stale
        if block.wa_block_hash is None:
            self._fresh.remove(block)
        self.num_free_blocks -= 1
        # (its entry in the buckets or _orphans is stale now)

    def remove_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``remove`` on each block in turn."""
        is_free, version = self._is_free, self._version
        for block in blocks:
            bid = block.block_id
            if not is_free[bid]:
                raise RuntimeError(f"remove() called on a block that is not free: {bid}")
            is_free[bid] = 0
            version[bid] += 1
            if block.wa_block_hash is None:
                self._fresh.remove(block)
        self.num_free_blocks -= len(blocks)

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks <= 0:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        assert n <= self.num_free_blocks
        out: list[KVCacheBlock] = []
        fresh, version, is_free = self._fresh, self._version, self._is_free
        orphans, buckets, keys, blocks = self._orphans, self._buckets, self._keys, self._blocks
        child = self.child
        shift = self.id_bits
        mask = (1 << shift) - 1
        while len(out) < n and fresh:
            b = fresh.pop()
            is_free[b.block_id] = 0
            out.append(b)
        while len(out) < n:
            if orphans:
                e = orphans.pop()
                bid = e & mask
                if e >> shift != version[bid] or not is_free[bid]:
                    continue
                b = blocks[bid]
            else:
                key = -keys[0]
                bucket = buckets[key]
                if not bucket:
                    del buckets[key]
                    heapq.heappop(keys)
                    continue
                e = bucket.popleft()
                bid = e & mask
                self._entries -= 1
                if e >> shift != version[bid] or not is_free[bid]:
                    continue
                b = blocks[bid]
            is_free[b.block_id] = 0
            out.append(b)
            if child[b.block_id] >= 0:
                self._orphan_children(b)
        self.num_free_blocks -= n
        if self._entries > 4 * (self.num_free_blocks + 1024):
            self._compact()
        return out

    def _compact(self) -> None:
        version, is_free, shift = self._version, self._is_free, self.id_bits
        mask = (1 << shift) - 1
        for key, bucket in list(self._buckets.items()):
            live = deque(e for e in bucket if e >> shift == version[e & mask] and is_free[e & mask])
            if live:
                self._buckets[key] = live
            else:
                del self._buckets[key]
        self._keys = [-k for k in self._buckets]
        heapq.heapify(self._keys)
        self._entries = sum(len(b) for b in self._buckets.values())

    def iter_eviction_order(self) -> Iterator[KVCacheBlock]:
        yield from reversed(self._fresh)
        mask = (1 << self.id_bits) - 1
        for e in reversed(self._orphans):
            bid = e & mask
            if e >> self.id_bits == self._version[bid] and self._is_free[bid]:
                yield self._blocks[bid]
        for key in sorted(self._buckets, reverse=True):
            for e in self._buckets[key]:
                bid = e & mask
                if e >> self.id_bits == self._version[bid] and self._is_free[bid]:
                    yield self._blocks[bid]

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self.iter_eviction_order())

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        return blocks_after(self.iter_eviction_order(), cursor)


class BeladyOracle:
    """Keeps each cached block's next use current in a :class:`BeladyFreeQueue`.

    A block's next use is written when a request holds it, and taken back when
    a later request arrives with its hash: that request either hits the block
    (and writes its next use again) or recomputes the position into a new
    block that then holds the hash's next use. Without this a block the
    request does not reach keeps a next use in the past and is never evicted;
    that was the copy vLLM leaves behind when it recomputes a fully cached
    prompt's last block.
    """

    def __init__(self, queue: BeladyFreeQueue, next_req: np.ndarray, offsets: np.ndarray) -> None:
        # (Blocks' hashes are read as wa_block_hash: ``queue`` named the slot so.)
        self.queue = queue
        self.next_req = next_req
        self.offsets = offsets
        self.trace_hash: list[int | None] = [None] * len(queue.next_use)
        self.blocks_of: dict[int, set[int]] = {}  # trace hash -> ids of blocks holding it
        self.copied: set[int] = set()  # the trace hashes more than one block holds
        self._block: dict[int, KVCacheBlock] = {}
        # Children of copies evicted while the request being placed recomputes
        # their hash: they wait for its new copy (on_admitted).
        self._placing: set[int] = set()
        self._waiting: list[tuple[int, KVCacheBlock, list[int]]] = []
        queue.keep_children = self.keep_children

    def keep_children(self, b: KVCacheBlock, kids: list[int]) -> bool:
        """``b`` is evicted: another block holding its hash (free or pinned, or
        the one the request being placed will write) becomes its children's parent."""
        bid = b.block_id
        h = self.trace_hash[bid]
        if h in self.copied:
            is_free, block_of = self.queue.is_free, self._block
            for oid in self.blocks_of[h]:
                o = block_of[oid]
                # (A block popped for eviction is neither free nor pinned.)
                if oid != bid and o.wa_block_hash == b.wa_block_hash and (is_free(oid) or o.ref_cnt > 0):
                    for cid in kids:
                        self.queue.adopt(o, cid)
                    return True
        if h in self._placing:
            self._waiting.append((h, b, kids))
            return True
        return False

    def _next_uses(self, index: int, n: int) -> list[int]:
        start = int(self.offsets[index])
        return self.next_req[start : start + n].tolist()

    def on_arrival(self, index: int, hashes: Sequence[int], n_hit: int) -> None:
        """Request ``index`` is looked up with ``n_hit`` prefix hits, before it is served.

        Every cached copy of its hashes gets no next use and is evicted
        first: if the request is served, :meth:`on_admitted` gives the hit
        blocks theirs back and the positions it recomputes go to new blocks,
        so other copies have no use of their own left (and one kept could be
        found by a later lookup instead of the copy in use, pinning one more
        block). A hash's only copy within the hit is the hit block itself:
        it is left alone (the request pins it before anything is evicted), so
        the hit part is walked only when it holds a copied hash.
        :meth:`on_not_served` undoes this if the request does not fit.
        """
        blocks_of, block_of = self.blocks_of, self._block
        next_use, evict_first = self.queue.next_use, self.queue.evict_first
        first = 0 if n_hit and not self.copied.isdisjoint(hashes[:n_hit]) else n_hit
        # Shallowest first: dead copies are popped from the end, so a child
        # goes before its parent, as the queue does on a tie.
        placing = self._placing
        placing.clear()
        for j in range(first, len(hashes)):
            bs = blocks_of.get(hashes[j])
            if not bs or (j < n_hit and len(bs) == 1):
                continue
            if j >= n_hit:
                placing.add(hashes[j])
            for bid in bs:
                next_use[bid] = NEVER
                evict_first(block_of[bid])

    def on_not_served(self, index: int, hashes: Sequence[int]) -> None:
        """Request ``index`` did not fit: every copy of its hashes waits for the next request using it."""
        self._placing.clear()
        self._waiting.clear()  # (nothing was evicted for it)
        blocks_of, block_of = self.blocks_of, self._block
        next_use, rekey = self.queue.next_use, self.queue.rekey
        nxt = None
        for j in range(len(hashes) - 1, -1, -1):
            bs = blocks_of.get(hashes[j])
            if not bs:
                continue
            if nxt is None:
                nxt = self._next_uses(index, len(hashes))
            for bid in bs:
                next_use[bid] = nxt[j]
                rekey(block_of[bid])

    def on_admitted(
        self, index: int, blocks: Sequence[KVCacheBlock], hashes: Sequence[int], n_hit: int = 0
    ) -> None:
        """Request ``index`` holds ``blocks`` (prompt order), the first ``n_hit`` hits.

        Hit blocks only get their new next use; new blocks are also indexed
        by trace hash and linked to their prefix parent.
        """
        nxt = self._next_uses(index, len(blocks))
        q = self.queue
        next_use, parent, parent_hash, child, more_children = (
            q.next_use, q.parent, q.parent_hash, q.child, q.more_children
        )
        for b, u in zip(blocks[:n_hit], nxt):
            next_use[b.block_id] = u
        trace_hash, blocks_of, block_of, copied = self.trace_hash, self.blocks_of, self._block, self.copied
        prev = blocks[n_hit - 1] if n_hit > 0 else None
        prev_id = prev.block_id if prev is not None else -1
        prev_hash = prev.wa_block_hash if prev is not None else None
        for b, h, u in zip(blocks[n_hit:], hashes[n_hit : len(blocks)], nxt[n_hit:]):
            bid = b.block_id
            old = trace_hash[bid]
            if old != h:
                if old is not None:
                    stale = blocks_of.get(old)
                    if stale is not None:
                        stale.discard(bid)
                        if len(stale) == 1:
                            copied.discard(old)
                        elif not stale:
                            del blocks_of[old]
                trace_hash[bid] = h
                s = blocks_of.get(h)
                if s is None:
                    blocks_of[h] = {bid}
                else:
                    s.add(bid)
                    if len(s) > 1:
                        copied.add(h)
                block_of[bid] = b
            next_use[bid] = u
            parent[bid] = prev
            parent_hash[bid] = prev_hash
            if prev_id >= 0:  # (the queue's adopt(), inlined: this loop runs for every new block)
                c = child[prev_id]
                if c < 0:
                    child[prev_id] = bid
                elif c != bid:
                    kids = more_children.get(prev_id)
                    if kids is None:
                        more_children[prev_id] = {bid}
                    else:
                        kids.add(bid)
            prev, prev_id, prev_hash = b, bid, b.wa_block_hash
        self._placing.clear()
        if self._waiting:
            self._hand_down(blocks, hashes, n_hit)

    def _hand_down(self, blocks: Sequence[KVCacheBlock], hashes: Sequence[int], n_hit: int) -> None:
        """The children of copies evicted while this request was placed go to its new copy of their hash."""
        new_of = dict(zip(hashes[n_hit : len(blocks)], blocks[n_hit:]))
        q = self.queue
        for h, old, kids in self._waiting:
            heir = new_of.get(h)
            for cid in kids:
                if q.parent[cid] is not old:  # evicted since and placed anew
                    continue
                if heir is not None:
                    q.adopt(heir, cid)
                else:
                    q.orphan(cid)
        self._waiting.clear()

"""SGLang's radix-cache eviction, block by block: priorities over evictable leaves.

Source: SGLang ``python/sglang/srt/mem_cache/radix_cache.py`` (``RadixCache.evict``,
``_match_prefix_helper``, ``_insert_helper``, ``_inc_hit_count``) and
``evict_policy.py`` (the ``EvictionStrategy`` classes), as merged with
https://github.com/sgl-project/sglang/pull/18843 (SLRU and the hit-count fix).

What this driver reproduces, with every cache block as its own tree node
(``page_size`` = the block size):

* only leaves are evicted: a free block with no cached child; evicting it may
  turn its parent into a leaf, which joins the candidates
  (``RadixCache.evict``). A prefix is therefore never evicted before its
  continuations, so nothing is orphaned;
* candidates go in ascending ``strategy.get_priority(node)``;
* node statistics move where SGLang moves them: ``match_prefix`` stamps the
  matched nodes' ``last_access_time``; ``insert`` stamps every node on the
  path, adds one to each one's ``hit_count`` and creates the new nodes
  (``creation_time``, ``hit_count`` 1). SGLang inserts a request twice: after
  prefill (``cache_unfinished_req``, skipped when the request finishes at
  prefill) and when it finishes (``cache_finished_req``). Both are applied
  when the request is freed, when its reply length is known: the path is
  pinned in between, so its priority is only read afterwards.

Differences from a token-level radix tree: nodes are whole blocks, so a split
never resets a node's ``creation_time``, and the output's own KV (which the
replay does not model) adds no node. Times are a logical clock (SGLang reads
``time.monotonic()``; only their order matters). A prompt of whole blocks,
every one cached: vLLM recomputes its last block into a second block that
holds the same key, and that block is a node of its own here (created, then
counted at release), while SGLang's insert walks the existing node (stamps
it, counts the hit) and frees the duplicate at once; so the block lookups
find is neither stamped nor counted (LFU and SLRU lose that count, FIFO keeps
the key longer). Such prompts are 0.0 % of the bundled agentic sample's
requests, 0.8 % of the Mooncake sample's and 1.1 % of the arXiv excerpt's
(a review of 2026-12-07).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.replay.peers.base import PeerQueue, RequestHints


class RadixLeafQueue(PeerQueue):
    """Free blocks as radix leaves, evicted in ascending :meth:`priority`.

    Subclasses define ``priority(bid)`` from the per-block statistics below,
    packed into one integer whose low ``id_bits`` bits are the block id (a
    total order, compared without building tuples). A free block's priority
    only changes while it is pinned (or when a lookup that did not fit touched
    it), so candidates wait in a heap, each entry valid while it is the key
    last queued for its block.

    Args:
        blocks: the free blocks.
        block_size: tokens per block (for length-based strategies).
        num_block_ids: size of the per-block arrays.
    """

    def __init__(self, blocks: list[KVCacheBlock], block_size: int, num_block_ids: int | None = None) -> None:
        self.block_size = block_size
        self._heap: list[int] = []
        self._clock = 0
        self._pending_hits: Sequence[KVCacheBlock] = ()
        n = max((b.block_id for b in blocks), default=-1) + 1 if num_block_ids is None else num_block_ids
        self.parent = [-1] * n
        self.children = [0] * n  # cached children
        self.depth = [0] * n  # position in its prompt (blocks before it)
        self.last_access = [0] * n
        self.creation = [0] * n
        self.hit_count = [0] * n
        self.queued = [-1] * n  # the key last pushed for a block (-1: none valid)
        self.id_bits = max(1, n.bit_length())
        super().__init__(blocks, num_block_ids)

    def priority(self, bid: int) -> int:
        """The block's eviction key: lowest first; its low ``id_bits`` bits are ``bid``."""
        raise NotImplementedError

    # ---- statistics (match and insert) ------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def on_lookup(
        self, req: RequestHints, hit_blocks: Sequence[KVCacheBlock], hashes: Sequence[Any], now: float,
        full_blocks: int | None = None,
    ) -> None:
        t = self._tick()
        last = self.last_access
        for b in hit_blocks:  # match_prefix stamps the matched path
            last[b.block_id] = t
        self._pending_hits = hit_blocks

    def forget(self, request_id: str, now: float) -> None:
        for b in self._pending_hits:  # stamped but still free: re-rank
            if self.is_free[b.block_id]:
                self._push(b.block_id)
        self._pending_hits = ()

    def _insert(self, bids: list[int], total_tokens: int, inserts: int) -> None:
        """``_insert_helper`` ``inserts`` times over the request's path (block ids): stamp it, count hits."""
        t = self._tick()
        last, hits = self.last_access, self.hit_count
        for bid in bids:
            last[bid] = t
            hits[bid] += inserts

    def on_admitted(self, req: RequestHints, blocks: Sequence[KVCacheBlock], n_hit: int, now: float) -> None:
        self._pending_hits = ()
        self._clock += 1  # prefill's insert creates the new nodes
        if n_hit == len(blocks):
            return
        key_of, parent, children, depth = self.key_of, self.parent, self.children, self.depth
        creation, hits, queued = self.creation, self.hit_count, self.queued
        t = self._clock
        prev = blocks[n_hit - 1].block_id if n_hit > 0 else -1
        if prev >= 0:
            children[prev] += 1
        # The new blocks are a chain: each is the parent of the next, the last a leaf.
        bids = [b.block_id for b in blocks[n_hit:]]
        for j, bid, key in zip(range(n_hit, len(blocks)), bids, req.hashes[n_hit : len(blocks)]):
            key_of[bid] = key
            parent[bid] = prev
            children[bid] = 1
            depth[bid] = j
            creation[bid] = t
            hits[bid] = 0
            queued[bid] = -1
            prev = bid
        children[prev] = 0

    def on_free(self, req: RequestHints, blocks: Sequence[KVCacheBlock], now: float) -> None:
        # cache_unfinished_req after prefill (unless the reply ended there),
        # then cache_finished_req with prompt + output.
        out = req.output_tokens or 0
        self._insert([b.block_id for b in blocks], req.input_tokens + out, 2 if out > 1 else 1)

    # ---- queue ------------------------------------------------------------------------------

    def _push(self, bid: int) -> None:
        key = self.priority(bid)
        self.queued[bid] = key
        heapq.heappush(self._heap, key)

    def _unfree_cached_n(self, blocks: list[KVCacheBlock]) -> None:
        """Nothing to do: a pinned block's heap entries are skipped when popped."""

    def _free_cached(self, blocks: list[KVCacheBlock]) -> None:
        children = self.children
        for b in blocks:
            if not children[b.block_id]:
                self._push(b.block_id)
        if len(self._heap) > 4 * (self.num_free_blocks + 1024):
            self._compact()

    def _evict(self, n: int) -> list[KVCacheBlock]:
        heap, queued, is_free, children, parent = self._heap, self.queued, self.is_free, self.children, self.parent
        key_of, block, priority = self.key_of, self.block, self.priority
        mask = (1 << self.id_bits) - 1
        heappop, heappush = heapq.heappop, heapq.heappush
        out: list[int] = []
        nxt = -1  # a leaf known to come before everything in the heap
        while len(out) < n:
            if nxt >= 0:
                bid, nxt = nxt, -1
            else:
                if not heap:
                    raise RuntimeError("no evictable leaf although the queue counts free blocks")
                key = heappop(heap)
                bid = key & mask
                if queued[bid] != key or not is_free[bid] or children[bid]:
                    continue
            is_free[bid] = 0
            queued[bid] = -1
            out.append(bid)
            key_of[bid] = None
            p = parent[bid]
            if p >= 0:
                parent[bid] = -1
                left = children[p] - 1
                children[p] = left
                if not left and is_free[p]:
                    # The new leaf usually goes next (a chain is evicted tail
                    # first): skip the heap when it beats the heap's minimum.
                    pr = priority(p)
                    if heap and pr > heap[0]:
                        queued[p] = pr
                        heappush(heap, pr)
                    else:
                        nxt = p
        if nxt >= 0:
            self._push(nxt)
        return [block[bid] for bid in out]

    def _compact(self) -> None:
        queued, is_free, children = self.queued, self.is_free, self.children
        mask = (1 << self.id_bits) - 1
        self._heap = [k for k in self._heap if queued[k & mask] == k and is_free[k & mask] and not children[k & mask]]
        heapq.heapify(self._heap)

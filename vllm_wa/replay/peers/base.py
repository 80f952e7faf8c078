"""What every peer policy shares: the request facts it is told, and its queue's frame.

A peer is a free-block queue (the interface of vLLM's ``FreeKVCacheBlockQueue``,
so it plugs into the replay's pool and into vLLM's ``BlockPool``) that is also
told about requests, at the four points where a real engine knows something:

* ``on_lookup``: a prompt was matched against the prefix cache (before any
  block is pinned or evicted for it);
* ``forget``: the request did not fit and holds nothing;
* ``on_admitted``: its blocks are pinned, the new ones cached;
* ``on_free``: it finished; its blocks go back to the queue right after
  (``append_n``, tail first).

Peers key cached blocks by the trace's block hash ids, which both replay
engines hand them identically, so a peer makes the same decisions in both.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.kv_block import install_hash_alias


@dataclass(frozen=True, slots=True)
class RequestHints:
    """What a peer may know about a request.

    ``input_tokens``, ``output_tokens`` and ``hashes`` are the engine's own
    facts (``output_tokens`` only once the request finished; ``hashes``: the
    trace's block hash ids, or any hashable keys of blocks no prompt shares). ``conversation``
    and ``outcome`` are client hints: the conversation id (None when the trace
    has none) and, at release, whether the reply called a tool (None when the
    trace does not say).
    """

    request_id: str
    hashes: Sequence[Any]
    input_tokens: int
    output_tokens: int | None = None
    conversation: int | None = None
    outcome: str | None = None


class PeerQueue:
    """Frame of a peer's free queue: unhashed blocks first, then the peer's choice.

    Subclasses keep their own order of the free cached blocks through
    ``_free_cached`` (blocks just freed, tail first), ``_unfree_cached`` (a
    free block was hit) and ``_evict`` (pick victims among free cached
    blocks); the frame keeps the count, the free flags and the unhashed
    blocks, which are handed out first in block-id order, as in vLLM.

    Args:
        blocks: the free blocks, as for ``FreeKVCacheBlockQueue``.
        num_block_ids: size of the per-block arrays (default: max id + 1).
    """

    def __init__(self, blocks: list[KVCacheBlock], num_block_ids: int | None = None) -> None:
        install_hash_alias()  # the hash slot under one name (vllm_wa.kv_block)
        n = max((b.block_id for b in blocks), default=-1) + 1
        if num_block_ids is not None:
            if num_block_ids < n:
                raise ValueError(f"num_block_ids={num_block_ids} but a block has id {n - 1}")
            n = num_block_ids
        self.num_block_ids = n
        self.is_free = bytearray(n)
        # Trace hash id of each cached block, set when its request is admitted.
        self.key_of: list[Any] = [None] * n
        self.block: list[KVCacheBlock | None] = [None] * n
        self._unhashed: deque[KVCacheBlock] = deque()
        self.num_free_blocks = 0
        for b in blocks:
            self.block[b.block_id] = b
        self.prepend_n([b for b in blocks if b.wa_block_hash is None])
        self.append_n([b for b in blocks if b.wa_block_hash is not None])

    # ---- what subclasses implement ------------------------------------------------

    def _free_cached(self, blocks: list[KVCacheBlock]) -> None:
        """Cached blocks became free (in the order vLLM frees them)."""
        raise NotImplementedError

    def _unfree_cached(self, block: KVCacheBlock) -> None:
        """A free cached block was hit and is pinned again."""

    def _unfree_cached_n(self, blocks: list[KVCacheBlock]) -> None:
        """Several were (``_unfree_cached`` on each, in order)."""
        for b in blocks:
            self._unfree_cached(b)

    def _evict(self, n: int) -> list[KVCacheBlock]:
        """Choose ``n`` free cached blocks to reuse; they are no longer cached after."""
        raise NotImplementedError

    # ---- request hooks (engine facts and client hints) --------------------------------

    def on_lookup(
        self, req: RequestHints, hit_blocks: Sequence[KVCacheBlock], hashes: Sequence[Any], now: float,
        full_blocks: int | None = None,
    ) -> None:
        """The prompt's cached prefix is ``hit_blocks``; nothing is pinned yet.

        ``full_blocks`` (how many of ``hashes`` are full blocks) is for the
        conversation tracker; a peer treats every listed block alike.
        """

    def forget(self, request_id: str, now: float) -> None:
        """The request looked up did not fit: it holds no block."""

    def on_admitted(self, req: RequestHints, blocks: Sequence[KVCacheBlock], n_hit: int, now: float) -> None:
        """The request holds ``blocks`` (prompt order); the first ``n_hit`` were hits."""
        key_of, hashes = self.key_of, req.hashes
        for j in range(n_hit, len(blocks)):
            key_of[blocks[j].block_id] = hashes[j]

    def on_free(self, req: RequestHints, blocks: Sequence[KVCacheBlock], now: float) -> None:
        """The request finished; its free blocks reach ``append_n`` right after."""

    def advance(self, now: float) -> None:
        """Trace time moved on (for timers)."""

    # ---- FreeKVCacheBlockQueue interface ------------------------------------------------

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks <= 0:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n == 0:
            return []
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        unhashed, is_free = self._unhashed, self.is_free
        while unhashed and len(out) < n:
            b = unhashed.popleft()
            is_free[b.block_id] = 0
            out.append(b)
        if len(out) < n:
            victims = self._evict(n - len(out))
            for b in victims:
                is_free[b.block_id] = 0
            out.extend(victims)
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if not self.is_free[bid]:
            raise RuntimeError(f"remove() called on a block that is not free: {bid}")
        self.is_free[bid] = 0
        self.num_free_blocks -= 1
        if block.wa_block_hash is None:
            self._unhashed.remove(block)
        else:
            self._unfree_cached(block)

    def remove_n(self, blocks: list[KVCacheBlock]) -> None:
        """``remove`` on each block in turn."""
        is_free = self.is_free
        for b in blocks:
            if not is_free[b.block_id]:
                raise RuntimeError(f"remove() called on a block that is not free: {b.block_id}")
            is_free[b.block_id] = 0
        self.num_free_blocks -= len(blocks)
        if None in [b.wa_block_hash for b in blocks]:
            for b in blocks:
                if b.wa_block_hash is None:
                    self._unhashed.remove(b)
            blocks = [b for b in blocks if b.wa_block_hash is not None]
        self._unfree_cached_n(blocks)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        is_free = self.is_free
        for b in blocks:
            is_free[b.block_id] = 1
        self.num_free_blocks += len(blocks)
        if None in [b.wa_block_hash for b in blocks]:  # rare: vLLM prepends these instead
            self._unhashed.extend(b for b in blocks if b.wa_block_hash is None)
            blocks = [b for b in blocks if b.wa_block_hash is not None]
            if not blocks:
                return
        self._free_cached(blocks if isinstance(blocks, list) else list(blocks))

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        for b in reversed(blocks):
            self.is_free[b.block_id] = 1
            self._unhashed.appendleft(b)
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks: unhashed ones first, then by block id (not eviction order)."""
        rest = [b for b in self.block if b is not None and self.is_free[b.block_id] and b.wa_block_hash is not None]
        return list(self._unhashed) + rest


@dataclass
class ResidentKeys:
    """Which cached block a lookup of a key finds, like the pool's hash map.

    vLLM caches a prompt's recomputed last block again, so a key can be held by
    several blocks; the first one keeps answering lookups until it is evicted.
    """

    primary: dict[Any, int] = field(default_factory=dict)
    _others: dict[Any, list[int]] = field(default_factory=dict)

    def get(self, key: Any) -> int | None:
        return self.primary.get(key)

    def add(self, key: Any, bid: int) -> bool:
        """Record ``bid`` holding ``key``; True if it is the block lookups find."""
        if key in self.primary:
            self._others.setdefault(key, []).append(bid)
            return False
        self.primary[key] = bid
        return True

    def discard(self, key: Any, bid: int) -> bool:
        """``bid`` no longer holds ``key``; True if no block holds it any more."""
        if self.primary.get(key) == bid:
            others = self._others.get(key)
            if others:
                self.primary[key] = others.pop(0)
                if not others:
                    del self._others[key]
                return False
            del self.primary[key]
            return True
        others = self._others.get(key)
        if others and bid in others:
            others.remove(bid)
            if not others:
                del self._others[key]
        return False

    def __contains__(self, key: Any) -> bool:
        return key in self.primary

    def __len__(self) -> int:
        return len(self.primary)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.primary)

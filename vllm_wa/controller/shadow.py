"""Miniature caches that measure candidate configurations on live traffic.

Each candidate runs in its own small pool fed with a hash-sampled slice of
every prompt (spatial sampling: the same fraction of block hashes, in a pool
scaled by the same fraction), using the very same queue and tagger classes as
the engine.  Hits follow the prefix rule on the sampled subsequence: once a
sampled block misses, the rest of the prompt misses too.  Each request's hits
in every miniature cache go to the tuner, which compares the candidates on
the same requests.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

from vllm_wa.controller.config import CandidateSpec
from vllm_wa.controller.features import FeatureKey
from vllm_wa.controller.learned_key import LearnedKey
from vllm_wa.engine_patch.block_tagger import MAX_LIVE_REQUESTS, BlockTagger, RequestTags
from vllm_wa.engine_patch.free_queue import WorkloadAwareFreeQueue
from vllm_wa.params import WAParams
from vllm_wa.sim.clock import SettableClock
from vllm_wa.sim.prefix_cache import SimPrefixCache
from vllm_wa.workload_classes import ClassRegistry

ClassKey = FeatureKey | LearnedKey
# Released requests a late outcome can still refile (as many as the engine's tagger keeps).
REMEMBER_FINISHED = 4096


class ShadowCache:
    """One candidate's miniature cache."""

    def __init__(
        self,
        spec: CandidateSpec,
        num_blocks: int,
        max_classes: int,
        key: ClassKey | None,
        retire_after_s: float = float("inf"),
    ) -> None:
        """``key`` is the candidate's class key (None for LRU); classes idle for
        ``retire_after_s`` give their slot back, as in the live queue."""
        self.spec = spec
        self.name = spec.name
        self.key = key
        self.clock = SettableClock()
        self.tagger: BlockTagger | None = None
        self.queue: Any = None
        self.registry = ClassRegistry(max_classes=max_classes, retire_after_s=retire_after_s)
        # Prefix hits over the sampled blocks: a candidate that keeps deep
        # blocks but loses their prefix gains nothing, as in the real cache.
        self.cache = SimPrefixCache(max(2, num_blocks), self._make_queue, last_block_hits=True)
        self.cache.hooks = self.tagger
        self.overflow = 0
        self._tags: dict[str, str] = {}
        self._since: dict[str, float] = {}  # request -> when it was admitted
        # Requests released because more than MAX_LIVE_REQUESTS were held, and
        # those released because none came for ``max_hold_s`` (see expire):
        # both are finishes the controller never saw.
        self.lost_finishes = 0
        self.expired = 0

    def _make_queue(self, blocks: list) -> Any:
        if self.spec.lru:
            self.queue = FreeKVCacheBlockQueue(blocks)
        else:
            self.queue = WorkloadAwareFreeQueue(blocks, None, clock=self.clock, registry=self.registry)
            # It is told each request's outcome at its release, and a late one
            # (OUTCOME events) for the requests it remembers: it starts keeping
            # them at the first (a replay, which tells outcomes at the release,
            # never pays for the records).
            self.tagger = BlockTagger(self.queue, blocks, class_key=self.key, remember_finished=0)
        return self.queue

    def set_key(self, key: ClassKey) -> None:
        """A new class key (a learned key's table changed); takes effect at the next release."""
        self.key = key
        if self.tagger is not None:
            self.tagger.set_class_key(key)

    def set_params(self, params: WAParams) -> None:
        if self.queue is not None and not self.spec.lru:
            self.queue.set_params(params)

    def lookup(self, request_id: str, tag: str, hashes: list[Any], t: float) -> int:
        """A prompt (its sampled block hashes) arrives; returns its hit blocks.

        The caller skips repeated lookups of a request any miniature cache still holds.
        """
        self.clock.t = t
        cache = self.cache
        n_hit = cache.admit(request_id, hashes, t, RequestTags(request_id, tag))
        if n_hit < 0:
            self.overflow += 1
            n_hit = 0
        else:
            self._tags[request_id] = tag
            self._since[request_id] = t
            if len(self._since) > MAX_LIVE_REQUESTS:
                # Finishes lost (a full event sink) would otherwise hold
                # requests until they expire: release the oldest, as the
                # engine's tagger forgets its oldest live request.
                self.finish(next(iter(self._since)), None, t)
                self.lost_finishes += 1
        return n_hit

    def finish(self, request_id: str, request: RequestTags | None, t: float) -> None:
        """The request released its blocks in the engine; ``request`` is what it
        was filed under there (tag, outcome, turn timing), None if it held none."""
        self.clock.t = t
        tag = self._tags.pop(request_id, None)
        if tag is None:
            return
        del self._since[request_id]
        if request is None:
            request = RequestTags(request_id, tag)
        self.cache.release(request_id, t, request)

    def reclassify(self, request: RequestTags, t: float) -> None:
        """A request it released got a late outcome in the engine: refile its blocks here too."""
        if self.tagger is not None and request.outcome is not None:
            self.clock.t = t
            self.tagger.remember_finished(REMEMBER_FINISHED)  # from the first late outcome on
            self.tagger.reclassify(request.request_id, request.outcome, pending=False)

    def expire(self, now: float, max_hold_s: float) -> int:
        """Release requests held longer than ``max_hold_s`` (their finish was lost)."""
        stale = [rid for rid, t in self._since.items() if now - t > max_hold_s]
        for rid in stale:
            self.finish(rid, None, now)
        self.expired += len(stale)
        return len(stale)

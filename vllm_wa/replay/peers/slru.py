"""``slru``: SGLang's ``--radix-eviction-policy slru`` (segmented LRU).

Source: SGLang ``python/sglang/srt/mem_cache/evict_policy.py``, ``SLRUStrategy``,
added by https://github.com/sgl-project/sglang/pull/18843: priority
``(hit_count >= protected_threshold, last_access_time)``: the probationary
segment goes first, each segment in LRU order, leaves only
(:class:`RadixLeafQueue`).

Knob: ``protected_threshold`` (SGLang's default 2). SGLang has no capacity
split between the segments; the threshold is what decides who is protected.
Because SGLang inserts a request's path twice (after prefill and when it
finishes), one request that decodes more than a token already gives its prompt
blocks two hits: threshold 2 protects every block used once, 2k+1 protects
blocks used by k+1 requests. Client hints: none.
"""

from __future__ import annotations

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.replay.peers.radix import RadixLeafQueue


class SLRUQueue(RadixLeafQueue):
    def __init__(
        self, blocks: list[KVCacheBlock], block_size: int, num_block_ids: int | None = None, protected_threshold: float = 2
    ) -> None:
        if not (protected_threshold >= 1 and float(protected_threshold).is_integer()):
            raise ValueError(f"slru protected_threshold must be an integer >= 1, got {protected_threshold}")
        self.protected_threshold = int(protected_threshold)
        super().__init__(blocks, block_size, num_block_ids)

    def priority(self, bid: int) -> int:
        # (protected segment, last_access_time), then the block id
        protected = 1 << 40 if self.hit_count[bid] >= self.protected_threshold else 0
        return ((protected | self.last_access[bid]) << self.id_bits) | bid

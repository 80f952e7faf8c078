"""``lfu``: SGLang's ``--radix-eviction-policy lfu``.

Source: SGLang ``python/sglang/srt/mem_cache/evict_policy.py``, ``LFUStrategy``:
priority ``(node.hit_count, node.last_access_time)``, lowest evicted first,
with the hit counting of https://github.com/sgl-project/sglang/pull/18843
(every insert through a node adds one). Driven by :class:`RadixLeafQueue`
(leaves only). Knobs: none. Client hints: none.
"""

from __future__ import annotations

from vllm_wa.replay.peers.radix import RadixLeafQueue


class LFUQueue(RadixLeafQueue):
    def priority(self, bid: int) -> int:
        # (hit_count, last_access_time), then the block id
        return (((self.hit_count[bid] << 40) | self.last_access[bid]) << self.id_bits) | bid

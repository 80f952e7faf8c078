"""``fifo``: SGLang's ``--radix-eviction-policy fifo``.

Source: SGLang ``python/sglang/srt/mem_cache/evict_policy.py``, ``FIFOStrategy``:
priority ``node.creation_time``, oldest evicted first, among leaves only
(:class:`RadixLeafQueue`). Knobs: none. Client hints: none.
"""

from __future__ import annotations

from vllm_wa.replay.peers.radix import RadixLeafQueue


class FIFOQueue(RadixLeafQueue):
    def priority(self, bid: int) -> int:
        # creation_time, then the block id
        return (self.creation[bid] << self.id_bits) | bid

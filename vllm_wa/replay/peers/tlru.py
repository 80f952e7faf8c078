"""``tlru``: Tail-Optimized LRU (Zhang, Li, Moallemi, Peng, NeurIPS '25).

Sources: the paper, arXiv 2510.15152 (T-LRU: a conversation with history
length L whose next prompt adds about Q_hat tokens needs only its first
``L + Q_hat - xi`` tokens cached to keep the next prefill's uncached tokens,
and so its TTFT, within the budget ``xi``; the rest of its tail is
"TEL-safe" and is evicted first, then LRU); SGLang's ``TLRUStrategy`` in
``python/sglang/srt/mem_cache/evict_policy.py`` from
https://github.com/sgl-project/sglang/pull/34012 (``--radix-eviction-policy
tlru --tlru-threshold xi --tlru-next-prompt-estimate Q_hat``), whose semantics
this follows:

* priority ``(-1 if TEL-safe else 0, last_access_time)``, leaves only
  (:class:`RadixLeafQueue`);
* L is the node's ``_tlru_history_len``: the longest sequence ever inserted
  through it (prompt plus output when the request finishes), a high-water
  mark that does not shrink when the tail is trimmed;
* a node is TEL-safe when the tokens cached before it are at least
  ``max(L + Q_hat - xi, 0)``.

L comes from the prefix chain, as in SGLang (and as in vLLM's reference
implementation, vllm-project/vllm#37825, which takes it from the finishing
request): no client hint. Knobs: ``xi = slo_s * prefill_tokens_per_s`` (the
TTFT SLO at a prefill rate; the replay's lifetime model prefills 10k tokens/s)
and ``qhat_tokens`` (vLLM's default 200). Only ``xi - qhat`` matters.
"""

from __future__ import annotations

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.replay.peers.radix import RadixLeafQueue


class TLRUQueue(RadixLeafQueue):
    def __init__(
        self,
        blocks: list[KVCacheBlock],
        block_size: int,
        num_block_ids: int | None = None,
        *,
        xi_tokens: float,
        qhat_tokens: float = 200.0,
    ) -> None:
        if not (0 <= xi_tokens < float("inf") and 0 <= qhat_tokens < float("inf")):
            raise ValueError(f"tlru xi and Q_hat must be >= 0 tokens, got {xi_tokens}, {qhat_tokens}")
        self.xi_tokens = xi_tokens
        self.qhat_tokens = qhat_tokens
        super().__init__(blocks, block_size, num_block_ids)
        self.history_len = [0] * len(self.parent)  # tokens, high-water

    def _insert(self, bids: list[int], total_tokens: int, inserts: int) -> None:
        super()._insert(bids, total_tokens, inserts)
        hw = self.history_len
        # SGLang inserts the tokens with KV (prompt + output - 1: the last
        # sampled token has none yet), page-aligned.
        length = max(0, total_tokens - 1) // self.block_size * self.block_size
        for bid in bids:
            if hw[bid] < length:
                hw[bid] = length

    def on_admitted(self, req, blocks, n_hit, now) -> None:
        hw = self.history_len
        for b in blocks[n_hit:]:
            hw[b.block_id] = 0
        super().on_admitted(req, blocks, n_hit, now)

    def priority(self, bid: int) -> int:
        # TEL-safe: the tokens cached before it reach max(L + Q_hat - xi, 0).
        safe = self.depth[bid] * self.block_size >= self.history_len[bid] + self.qhat_tokens - self.xi_tokens
        # (-1 if TEL-safe else 0, last_access_time), then the block id
        return (((0 if safe else 1 << 40) | self.last_access[bid]) << self.id_bits) | bid

"""``ttl-tool``: Continuum's KV time-to-live after tool calls.

Source: Li et al., "Continuum: Efficient and Robust Multi-Turn LLM Agent
Scheduling with KV Cache Time-to-Live", arXiv 2511.02230 (v2, Dec 2025;
renamed CacheTTL in v4), Sections 3-4; preview code
https://github.com/Hanchenli/vllm-continuum (its estimator,
``vllm/v1/core/estimate_with_func.py``, keeps per-job histories of when a
tool-call reply left and when the job's next request arrived).

* When a request's reply calls a tool, its KV stays pinned for a TTL instead
  of being freed; the job's next request picks it up. When the TTL expires
  the blocks are freed (they join vLLM's LRU queue at that time). Under
  memory pressure the scheduler unpins victims: here, free unpinned blocks
  are reused first and then pinned ones, earliest deadline first.
* The TTL maximizes ``P(tool returns within tau) * benefit - cost(tau)``:
  with the benefit (prefill avoided) and the cost (memory held for tau) both
  proportional to the blocks held, that is ``argmax_tau F(tau) - tau / B``,
  where F is the empirical CDF of the tool durations seen so far (the time
  from a tool-call reply leaving to its conversation's next request) and ``B``
  the break-even hold time, the knob. Before ``MIN_SAMPLES`` durations the
  paper's cold start assumes exponential durations (the mean of those seen,
  ``COLD_START_MEAN_S`` before any).

The public code is simpler than the paper: as a port that copies
``estimate_with_func.py`` reads, it pins for a fixed 2 s
(``FIXED_THRESHOLD_CONTINUUM``) when that tool's mean run time is at most
2 s, and not at all otherwise, per tool name. The traces name no tools, so
this module runs the paper's rule over all tool durations, whose TTL is
chosen from the data, with ``B`` swept on the profile half.

Client hints: the conversation id (which request continues which job) and
the reply's outcome (tool call or not). Without them (Mooncake: neither; the
synthetic Bailian trace: no outcome) nothing is ever pinned and the queue is
vLLM's LRU.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from vllm_wa.replay.peers.base import PeerQueue, RequestHints

MIN_SAMPLES = 32
COLD_START_MEAN_S = 10.0


def best_ttl(durations: Sequence[float], break_even_s: float) -> float:
    """``argmax_tau F(tau) - tau / B`` over the empirical CDF of sorted ``durations``; 0: do not pin."""
    n = len(durations)
    if n == 0:
        return 0.0
    d = np.asarray(durations, dtype=float)
    gain = np.arange(1, n + 1) / n - d / break_even_s
    i = int(np.argmax(gain))
    return float(d[i]) if gain[i] > 0 else 0.0


def exponential_ttl(mean_s: float, break_even_s: float) -> float:
    """The same argmax for exponential durations: ``tau = m ln(B / m)`` when ``B > m``."""
    if mean_s <= 0 or break_even_s <= mean_s:
        return 0.0
    return mean_s * math.log(break_even_s / mean_s)


@dataclass
class _Pin:
    deadline: float
    # The tool-call request's blocks (ids), which the pin holds as they are
    # freed: another running request may still hold some at its release.
    members: list[int] = field(default_factory=list)
    blocks: list[KVCacheBlock] = field(default_factory=list)  # pinned free blocks


class TTLToolQueue(PeerQueue):
    """vLLM's LRU queue plus pinned tool-call contexts.

    Args:
        blocks: the free blocks.
        break_even_s: the cost/benefit knob B (seconds).
        num_block_ids: size of the per-block arrays.
        fixed_ttl_s: pin for this TTL instead of the estimate (tests).
    """

    def __init__(
        self,
        blocks: list[KVCacheBlock],
        break_even_s: float,
        num_block_ids: int | None = None,
        fixed_ttl_s: float | None = None,
    ) -> None:
        if not 0 < break_even_s < float("inf"):
            raise ValueError(f"ttl-tool break_even_s must be positive, got {break_even_s}")
        self.break_even_s = break_even_s
        self.fixed_ttl_s = fixed_ttl_s
        self.lru = FreeKVCacheBlockQueue([])
        n = max((b.block_id for b in blocks), default=-1) + 1 if num_block_ids is None else num_block_ids
        self.pin_of: list[Any] = [None] * n  # conversation whose pin holds the free block
        self.member_of: list[Any] = [None] * n  # conversation whose pin claims the block, free or held
        self.pins: dict[Any, _Pin] = {}
        self._deadlines: list[tuple[float, int, Any]] = []
        self._seq = 0
        self.pinned_free = 0
        self._left_at: dict[Any, float] = {}  # conversation -> when its tool-call reply left
        self.durations: list[float] = []  # sorted
        self.ttl = 0.0
        self.ttls_used: list[float] = []
        super().__init__(blocks, num_block_ids)

    # ---- TTL estimate -------------------------------------------------------------------------

    def _observe(self, duration: float) -> None:
        bisect.insort(self.durations, duration)
        n = len(self.durations)
        if n < MIN_SAMPLES:
            self.ttl = exponential_ttl(sum(self.durations) / n, self.break_even_s)
        elif n < 4 * MIN_SAMPLES or n % 16 == 0:
            self.ttl = best_ttl(self.durations, self.break_even_s)

    def current_ttl(self) -> float:
        if self.fixed_ttl_s is not None:
            return self.fixed_ttl_s
        if not self.durations:
            return exponential_ttl(COLD_START_MEAN_S, self.break_even_s)
        return self.ttl

    # ---- pins ---------------------------------------------------------------------------------

    def _unpin(self, conv: Any) -> None:
        """The pin ends: its blocks are freed now (LRU tail), in their order."""
        pin = self.pins.pop(conv, None)
        if pin is None:
            return
        member_of = self.member_of
        for bid in pin.members:
            if member_of[bid] == conv:
                member_of[bid] = None
        pin_of = self.pin_of
        freed = []
        for b in pin.blocks:
            if pin_of[b.block_id] == conv:
                pin_of[b.block_id] = None
                freed.append(b)
        self.pinned_free -= len(freed)
        self.lru.append_n(freed)

    def advance(self, now: float) -> None:
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            deadline, _, conv = heapq.heappop(dl)
            pin = self.pins.get(conv)
            if pin is not None and pin.deadline == deadline:
                self._unpin(conv)

    def on_lookup(
        self, req: RequestHints, hit_blocks: Sequence[KVCacheBlock], hashes: Sequence[Any], now: float,
        full_blocks: int | None = None,
    ) -> None:
        conv = req.conversation
        if conv is None:
            return
        left = self._left_at.pop(conv, None)
        if left is not None:
            self._observe(now - left)
        self._unpin(conv)  # the job's next request takes its context over

    def on_free(self, req: RequestHints, blocks: Sequence[KVCacheBlock], now: float) -> None:
        conv = req.conversation
        if conv is None:
            return
        self._unpin(conv)
        if req.outcome != "tool":
            self._left_at.pop(conv, None)
            return
        self._left_at[conv] = now
        ttl = self.current_ttl()
        self.ttls_used.append(ttl)
        if ttl > 0:
            # The blocks it frees now (right after this call) are pinned, and
            # those another request still holds when that one frees them.
            pin = self.pins[conv] = _Pin(now + ttl, [b.block_id for b in blocks])
            member_of = self.member_of
            for bid in pin.members:
                member_of[bid] = conv
            self._seq += 1
            heapq.heappush(self._deadlines, (pin.deadline, self._seq, conv))

    # ---- queue --------------------------------------------------------------------------------

    def _free_cached(self, blocks: list[KVCacheBlock]) -> None:
        member_of = self.member_of
        if not self.pins or all(member_of[b.block_id] is None for b in blocks):
            self.lru.append_n(blocks)
            return
        pin_of, pins = self.pin_of, self.pins
        unpinned = []
        for b in blocks:
            conv = member_of[b.block_id]
            if conv is None:
                unpinned.append(b)
            else:
                pin_of[b.block_id] = conv
                pins[conv].blocks.append(b)
                self.pinned_free += 1
        self.lru.append_n(unpinned)

    def _unfree_cached(self, block: KVCacheBlock) -> None:
        if self.pin_of[block.block_id] is not None:
            self.pin_of[block.block_id] = None
            self.pinned_free -= 1
        else:
            self.lru.remove(block)

    def _evict(self, n: int) -> list[KVCacheBlock]:
        lru = self.lru
        # Memory pressure: unpin earliest deadlines until the LRU queue suffices.
        while lru.num_free_blocks < n and self.pins:
            deadline, _, conv = heapq.heappop(self._deadlines)
            pin = self.pins.get(conv)
            if pin is not None and pin.deadline == deadline:
                self._unpin(conv)
        out = lru.popleft_n(n)
        key_of = self.key_of
        for b in out:
            key_of[b.block_id] = None
        return out

"""Shipped and published eviction policies, as replay baselines ("peers").

Each module implements one source faithfully (its docstring cites it); this
registry says how to build each, which client hints it reads and which knob,
if any, the replay tunes on the profile half of a trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.replay.peers.arc import ARCQueue
from vllm_wa.replay.peers.base import PeerQueue, RequestHints
from vllm_wa.replay.peers.fifo import FIFOQueue
from vllm_wa.replay.peers.lfu import LFUQueue
from vllm_wa.replay.peers.session import SessionQueue
from vllm_wa.replay.peers.slru import SLRUQueue
from vllm_wa.replay.peers.tlru import TLRUQueue
from vllm_wa.replay.peers.ttl_tool import TTLToolQueue

__all__ = ["PEERS", "Knob", "PeerContext", "PeerQueue", "PeerSpec", "RequestHints", "check_setting"]


@dataclass(frozen=True)
class PeerContext:
    """What a peer's queue is built with, besides its knob."""

    capacity: int  # usable blocks
    block_size: int  # tokens per block
    num_block_ids: int | None = None
    prefill_tokens_per_s: float = 10_000.0  # the replay's lifetime model


@dataclass(frozen=True)
class Knob:
    """A peer's tunable: the candidates swept on a trace's profile half."""

    name: str
    values: tuple[float, ...]
    default: float
    unit: str = ""

    def label(self, value: float) -> str:
        return f"{self.name}={value:g}{self.unit}"

    def parse(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{self.name} takes a number, got {text!r}") from None
        return value


@dataclass(frozen=True)
class PeerSpec:
    name: str
    source: str
    hints: tuple[str, ...]  # client hints read: "conversation", "outcome"
    build: Callable[[list[KVCacheBlock], PeerContext, float | None], PeerQueue]
    knob: Knob | None = None


def _tlru(blocks: list[KVCacheBlock], ctx: PeerContext, slo_s: Any) -> PeerQueue:
    return TLRUQueue(blocks, ctx.block_size, ctx.num_block_ids, xi_tokens=slo_s * ctx.prefill_tokens_per_s)


PEERS: dict[str, PeerSpec] = {
    p.name: p
    for p in (
        PeerSpec(
            "arc",
            "vLLM 0.32 ARCCachePolicy (kv_offload/cpu/policies/arc.py, #27039, #55461)",
            (),
            lambda blocks, ctx, _: ARCQueue(blocks, ctx.capacity, ctx.num_block_ids),
        ),
        PeerSpec(
            "slru",
            "SGLang SLRUStrategy (mem_cache/evict_policy.py, #18843)",
            (),
            lambda blocks, ctx, k: SLRUQueue(blocks, ctx.block_size, ctx.num_block_ids, protected_threshold=k),
            Knob("protected_threshold", (2, 3, 5, 7, 9), 2),
        ),
        PeerSpec(
            "lfu",
            "SGLang LFUStrategy (mem_cache/evict_policy.py)",
            (),
            lambda blocks, ctx, _: LFUQueue(blocks, ctx.block_size, ctx.num_block_ids),
        ),
        PeerSpec(
            "fifo",
            "SGLang FIFOStrategy (mem_cache/evict_policy.py)",
            (),
            lambda blocks, ctx, _: FIFOQueue(blocks, ctx.block_size, ctx.num_block_ids),
        ),
        PeerSpec(
            "tlru",
            "T-LRU, arXiv 2510.15152; SGLang TLRUStrategy (#34012)",
            (),
            _tlru,
            # Up to budgets where every block is TEL-safe (radix LRU): the
            # agentic split's profile half chose the largest of 0.03 to 2 s.
            Knob("slo", (0.03, 0.06, 0.12, 0.5, 2.0, 8.0, 32.0, 128.0), 0.4096, "s"),
        ),
        PeerSpec(
            "session",
            "vLLM SAECachePolicy (kv_offload/cpu/policies/sae.py, #50422)",
            (),
            lambda blocks, ctx, _: SessionQueue(blocks, ctx.num_block_ids),
        ),
        PeerSpec(
            "ttl-tool",
            "Continuum, arXiv 2511.02230 (KV time-to-live after tool calls)",
            ("conversation", "outcome"),
            lambda blocks, ctx, b: TTLToolQueue(blocks, float(b), ctx.num_block_ids),
            Knob("break_even", (30, 100, 300, 1000, 3000, 10000), 30, "s"),
        ),
    )
}


def check_setting(name: str, value: float) -> float:
    """``value`` if peer ``name`` accepts it as its knob's setting; ValueError saying why not."""
    spec = PEERS[name]
    if spec.knob is None:
        raise ValueError(f"{name} has no knob")
    spec.build([KVCacheBlock(0), KVCacheBlock(1)], PeerContext(capacity=1, block_size=16), value)
    return value

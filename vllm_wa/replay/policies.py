"""Eviction policies a replay can run, each a free queue plugged into a pool.

A policy builds its queue either inside the replay's block-level pool
(``queue_factory``) or inside a real vLLM ``BlockPool`` (``install_vllm``);
either way the same queue classes and the same block tagger do the work.
Peer policies (``vllm_wa.replay.peers``) are also told about requests: both
engines call their ``request_hooks`` at the same points, with the hints
``request_info`` gives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from vllm_wa.engine_patch.block_tagger import BlockTagger, ClassKeyFunction
from vllm_wa.engine_patch.events import EventSink
from vllm_wa.engine_patch.free_queue import WorkloadAwareFreeQueue
from vllm_wa.engine_patch.install import install_wa_queue
from vllm_wa.params import WAParams
from vllm_wa.replay.belady import BeladyFreeQueue, BeladyOracle, next_use_table
from vllm_wa.replay.peers import PEERS, PeerContext, PeerQueue, PeerSpec, RequestHints
from vllm_wa.replay.trace import Trace, TraceRequest
from vllm_wa.sim.clock import SettableClock
from vllm_wa.workload_classes import ClassRegistry

POLICIES = ("lru", "wa-offline", "opt", "infinite", "wa-online", "wa-reprofiled", *PEERS)
# The fast engine tells a tagger each request's outcome at its release: no
# late facts arrive (the vLLM engine reports them as the API server does), so
# its taggers keep no records for them (BlockTagger's remember_finished).
NO_LATE_FACTS = 0


@dataclass
class ReplayPolicy:
    """Base: vLLM's LRU queue, no tagging."""

    name: str = "lru"
    queue: Any = None
    tagger: BlockTagger | None = None
    oracle: BeladyOracle | None = None
    unbounded: bool = False  # the replay sizes the pool so nothing is evicted
    # Replayed again once it is told which requests did not fit (skip_unserved).
    replays_unserved: bool = False
    # Told about each request (lookup, admission, release) by the engines.
    request_hooks: Any = None

    def queue_factory(self, clock: SettableClock) -> Callable[[list[KVCacheBlock]], Any]:
        def make(blocks: list[KVCacheBlock]) -> Any:
            self.queue = FreeKVCacheBlockQueue(blocks)
            return self.queue

        return make

    def install_vllm(self, block_pool: Any, clock: SettableClock) -> None:
        self.queue = block_pool.free_block_queue

    def advance(self, now: float) -> None:
        """Run whatever is due at trace time ``now`` (the online controller)."""

    def request_info(self, req: TraceRequest, finished: bool = False) -> Any:
        """What ``request_hooks`` are told about ``req`` (at release when ``finished``)."""
        return None

    def report(self) -> dict[str, Any]:
        return {}

    def skip_unserved(self, trace: Trace, unserved: Sequence[int]) -> None:
        """The requests ``unserved`` (trace indices) did not fit the pool on the last pass."""


@dataclass
class StaticWAPolicy(ReplayPolicy):
    """The WA queue with fixed parameters (the PR's offline-profiled workflow)."""

    params: WAParams = field(default_factory=WAParams.lru)
    class_key: ClassKeyFunction | None = None
    sink: EventSink | None = None
    registry: ClassRegistry = field(default_factory=ClassRegistry)

    def queue_factory(self, clock: SettableClock) -> Callable[[list[KVCacheBlock]], Any]:
        def make(blocks: list[KVCacheBlock]) -> Any:
            self.queue = WorkloadAwareFreeQueue(
                blocks, self.params, clock=clock, registry=self.registry, sink=self.sink
            )
            self.tagger = BlockTagger(
                self.queue, blocks, sink=self.sink, class_key=self.class_key, remember_finished=NO_LATE_FACTS
            )
            return self.queue

        return make

    def install_vllm(self, block_pool: Any, clock: SettableClock) -> None:
        handle = install_wa_queue(
            block_pool,
            self.params,
            clock=clock,
            sink=self.sink,
            registry=self.registry,
            class_key=self.class_key,
        )
        self.queue, self.tagger = handle.queue, handle.tagger

    def report(self) -> dict[str, Any]:
        return {"params": self.params.to_pr_json()}


@dataclass
class OptPolicy(ReplayPolicy):
    """Belady's optimum, from the trace's future.

    The future includes which requests will not fit the pool (its pinned
    blocks leave too few): they hit nothing, so their prompts are no reason
    to keep a block.  An LRU replay finds them first (``runner.scout_unserved``);
    a pass that finds others than it was told runs again without those.
    """

    next_req: Any = None
    offsets: Any = None
    replays_unserved: bool = True

    def skip_unserved(self, trace: Trace, unserved: Sequence[int]) -> None:
        self.next_req, self.offsets = next_use_table(trace, unserved)

    def queue_factory(self, clock: SettableClock) -> Callable[[list[KVCacheBlock]], Any]:
        def make(blocks: list[KVCacheBlock]) -> Any:
            self.queue = BeladyFreeQueue(blocks)
            self.oracle = BeladyOracle(self.queue, self.next_req, self.offsets)
            return self.queue

        return make

    def install_vllm(self, block_pool: Any, clock: SettableClock) -> None:
        free = block_pool.free_block_queue.get_all_free_blocks()
        for b in free:
            b.prev_free_block = b.next_free_block = None
        self.queue = BeladyFreeQueue(free, num_block_ids=len(block_pool.blocks))
        self.oracle = BeladyOracle(self.queue, self.next_req, self.offsets)
        block_pool.free_block_queue = self.queue


@dataclass
class PeerPolicy(ReplayPolicy):
    """A shipped or published policy (see ``vllm_wa.replay.peers``) at one knob setting.

    ``conversations`` says whether the trace's conversation ids are real; a
    peer only receives the client hints its spec declares.
    """

    spec: PeerSpec | None = None
    setting: float | None = None
    block_size: int = 16
    conversations: bool = False
    outcomes: bool = True  # whether the trace says how replies ended
    prefill_tokens_per_s: float = 10_000.0

    def _build(self, blocks: list[KVCacheBlock], capacity: int, num_block_ids: int | None) -> PeerQueue:
        assert self.spec is not None
        ctx = PeerContext(capacity, self.block_size, num_block_ids, self.prefill_tokens_per_s)
        queue = self.spec.build(blocks, ctx, self.setting)
        self.queue = self.request_hooks = queue
        return queue

    def queue_factory(self, clock: SettableClock) -> Callable[[list[KVCacheBlock]], Any]:
        # The pool's first pop is vLLM's null block.
        return lambda blocks: self._build(blocks, len(blocks) - 1, None)

    def install_vllm(self, block_pool: Any, clock: SettableClock) -> None:
        free = block_pool.free_block_queue.get_all_free_blocks()
        for b in free:
            b.prev_free_block = b.next_free_block = None
        block_pool.free_block_queue = self._build(free, len(free), len(block_pool.blocks))

    def advance(self, now: float) -> None:
        if self.queue is not None:
            self.queue.advance(now)

    def request_info(self, req: TraceRequest, finished: bool = False) -> RequestHints:
        hints = self.spec.hints if self.spec is not None else ()
        return RequestHints(
            request_id=req.request_id,
            hashes=req.hash_ids,
            input_tokens=req.input_tokens,
            output_tokens=req.output_tokens if finished else None,
            conversation=req.conversation if self.conversations and "conversation" in hints else None,
            outcome=req.outcome if finished and "outcome" in hints else None,
        )

    def report(self) -> dict[str, Any]:
        assert self.spec is not None
        available = {"conversation": self.conversations, "outcome": self.outcomes}
        out: dict[str, Any] = {
            "source": self.spec.source,
            "client_hints": list(self.spec.hints),
            "client_hints_missing": [h for h in self.spec.hints if not available[h]],
        }
        if self.spec.knob is not None:
            out["knob"] = self.spec.knob.name
            out["setting"] = self.setting
        stats = getattr(self.queue, "stats", None)
        if callable(stats):
            out.update(stats())
        return out

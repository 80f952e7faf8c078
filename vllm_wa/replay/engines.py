"""The two replay drivers: a block-level pool, and vLLM's real KVCacheManager.

Both take trace requests one at a time (``admit`` at arrival, ``release`` at
finish) and report the prompt blocks that hit the prefix cache; both drive
the policy's queue (and its tagger) in the same order of operations, so they
give identical hit counts (tested).
"""

from __future__ import annotations

from typing import Any

from vllm_wa.replay.policies import ReplayPolicy
from vllm_wa.replay.served import ServedEngine
from vllm_wa.replay.trace import Trace, TraceRequest
from vllm_wa.sim.clock import SettableClock
from vllm_wa.sim.kv_manager import model_free_kv_cache_manager
from vllm_wa.sim.prefix_cache import SimPrefixCache

ENGINES = ("fast", "vllm")


def _outcome(req: TraceRequest) -> str:
    # A finished request's engine-side outcome is "stop" unless the trace
    # says what its reply did (the API server reports tool calls).
    return req.outcome or "stop"


class FastEngine:
    """Block-level driver over :class:`SimPrefixCache` (for sweeps)."""

    def __init__(self, trace: Trace | None, policy: ReplayPolicy, num_blocks: int, clock: SettableClock) -> None:
        self.policy = policy
        self.clock = clock
        id_space = trace.id_space if trace is not None else None
        self.cache = SimPrefixCache(num_blocks, policy.queue_factory(clock), id_space=id_space)
        self.hooks = policy.request_hooks
        self.cache.hooks = policy.tagger if policy.tagger is not None else self.hooks
        self.cache.oracle = policy.oracle

    def admit(self, index: int, req: TraceRequest) -> int:
        """Serve a request's prompt; returns its hit blocks, or -1 if it did not fit."""
        tagger, hooks = self.policy.tagger, self.hooks
        if tagger is not None:
            info = tagger.request_tags(req.request_id, req.tag)
        else:
            info = self.policy.request_info(req)
        n_hit = self.cache.admit(req.request_id, req.hash_ids, self.clock.t, info, index)
        if n_hit >= 0 and hooks is not None:
            hooks.on_admitted(info, self.cache.pool.held[req.request_id], n_hit, self.clock.t)
        return n_hit

    def release(self, req: TraceRequest) -> None:
        tagger = self.policy.tagger
        if tagger is not None:
            info = tagger.request_tags(req.request_id, req.tag, _outcome(req), req.output_tokens)
        else:
            info = self.policy.request_info(req, finished=True)
        self.cache.release(req.request_id, self.clock.t, info)


class VLLMEngine:
    """Drives vLLM's own ``KVCacheManager`` with synthesized token ids.

    Every trace block becomes ``tokens_per_block`` token ids derived from its
    hash id, so vLLM's chained block hashing reproduces the trace's prefix
    structure; the manager's block size is ``tokens_per_block``.  Nothing is
    generated (the trace's next prompt carries a reply as blocks of its own),
    so the engine hooks see replies of length 0.
    """

    def __init__(
        self,
        trace: Trace,
        policy: ReplayPolicy,
        num_blocks: int,
        clock: SettableClock,
        tokens_per_block: int = 4,
    ) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        k = tokens_per_block
        self.k = k
        self.policy = policy
        self.clock = clock
        self._hasher = get_request_block_hasher(k, sha256)
        max_len = max(len(r.hash_ids) for r in trace.requests) * k + 1
        self.manager = model_free_kv_cache_manager(num_blocks, k, max_len)
        policy.install_vllm(self.manager.block_pool, clock)
        # Peers' hooks are called here; the WA tagger is wrapped into the manager.
        self.hooks = policy.request_hooks
        self._live: dict[str, Any] = {}

    def _request(self, req: TraceRequest) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        k = self.k
        tokens = [h * k + j for h in req.hash_ids for j in range(k)]
        sp = SamplingParams(max_tokens=1, extra_args={"type_info": req.tag})
        sp.update_from_generation_config({}, eos_token_id=None)
        return Request(
            request_id=req.request_id,
            prompt_token_ids=tokens,
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self._hasher,
        )

    def admit(self, index: int, req: TraceRequest) -> int:
        m = self.manager
        oracle, hooks, now = self.policy.oracle, self.hooks, self.clock.t
        vreq = self._request(req)
        blocks, n_hit_tokens, _ = m.get_computed_blocks(vreq)
        n_hit = n_hit_tokens // self.k
        if oracle is not None:
            oracle.on_arrival(index, req.hash_ids, n_hit)
        info = None
        if hooks is not None:
            info = self.policy.request_info(req)
            hooks.on_lookup(info, blocks.blocks[0] if blocks.blocks else [], req.hash_ids, now)
        new = m.allocate_slots(vreq, vreq.num_tokens - n_hit_tokens, n_hit_tokens, blocks)
        if new is None:
            m.free(vreq)  # nothing is held; lets the hooks forget the lookup
            if oracle is not None:
                oracle.on_arrival(index, req.hash_ids, 0, n_hit)
            if hooks is not None:
                hooks.forget(req.request_id, now)
            return -1
        vreq.num_computed_tokens = vreq.num_tokens
        self._live[req.request_id] = vreq
        if oracle is not None:
            oracle.on_admitted(index, m.coordinator.get_blocks(req.request_id)[0], req.hash_ids, n_hit)
        if hooks is not None:
            hooks.on_admitted(info, m.coordinator.get_blocks(req.request_id)[0], n_hit, now)
        return n_hit

    def release(self, req: TraceRequest) -> None:
        from vllm.v1.request import RequestStatus

        vreq = self._live.pop(req.request_id)
        tagger = self.policy.tagger
        if tagger is not None and req.outcome is not None:
            # What the API server would report once it parsed the reply.
            tagger.reclassify(req.request_id, req.outcome)
        if self.hooks is not None:
            blocks = self.manager.coordinator.get_blocks(req.request_id)[0]
            self.hooks.on_free(self.policy.request_info(req, finished=True), blocks, self.clock.t)
        vreq.status = RequestStatus.FINISHED_STOPPED
        self.manager.free(vreq)


def make_engine(kind: str, trace: Trace, policy: ReplayPolicy, num_blocks: int, clock: SettableClock) -> Any:
    if kind == "fast":
        return FastEngine(trace, policy, num_blocks, clock)
    if kind == "vllm":
        if trace.fmt == "served":
            # What a benchmark server saw: its own tokens, block size and reply slots.
            return ServedEngine(trace, policy, num_blocks, clock)
        return VLLMEngine(trace, policy, num_blocks, clock)
    raise ValueError(f"unknown engine {kind!r}; expected one of {ENGINES}")

"""The replay's drivers: a block-level pool (here), and vLLM's real
KVCacheManager (``replay.vllm_engine``; ``replay.served`` for a served trace).

They take trace requests one at a time (``admit`` at arrival, ``release`` at
finish) and report the prompt blocks that hit the prefix cache; both drive
the policy's queue (and its tagger) in the same order of operations, so they
give identical hit counts (tested). ``make_engine`` picks one.
"""

from __future__ import annotations

from typing import Any

from vllm_wa.replay.policies import ReplayPolicy
from vllm_wa.replay.served import ServedEngine
from vllm_wa.replay.trace import Trace, TraceRequest
from vllm_wa.replay.vllm_engine import VLLMEngine
from vllm_wa.sim.clock import SettableClock
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
        self.trace = trace

    def admit(self, index: int, req: TraceRequest) -> int:
        """Serve a request's prompt; returns its hit blocks, or -1 if it did not fit."""
        tagger, hooks = self.policy.tagger, self.hooks
        if tagger is not None:
            info = tagger.request_tags(req.request_id, req.tag)
        else:
            info = self.policy.request_info(req)
        full = self.trace.full_blocks(req) if self.trace is not None else None
        n_hit = self.cache.admit(req.request_id, req.hash_ids, self.clock.t, info, index, full)
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


def make_engine(kind: str, trace: Trace, policy: ReplayPolicy, num_blocks: int, clock: SettableClock) -> Any:
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; expected one of {ENGINES}")
    if trace.fmt == "served":
        # What a benchmark server saw: its own tokens, block size and reply
        # slots, on vLLM's manager whichever engine was asked for (the fast
        # pool caches a prompt's partial last block and no reply slots: on a
        # two-request trace it read 46.15 % where the server's 30.77 % is right).
        return ServedEngine(trace, policy, num_blocks, clock)
    if kind == "fast":
        return FastEngine(trace, policy, num_blocks, clock)
    return VLLMEngine(trace, policy, num_blocks, clock)

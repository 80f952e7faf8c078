"""The replay's ``--engine vllm`` driver: vLLM's real ``KVCacheManager``.

:class:`VLLMEngine` replays a trace file: every trace block becomes
``tokens_per_block`` token ids derived from its hash id, so vLLM's chained
block hashing reproduces the trace's prefix structure. Nothing is generated
(the trace's next prompt carries a reply as blocks of its own), so the engine
hooks see replies of length 0. A served trace's driver
(``replay.served.ServedEngine``) is this one with the server's tokens and
reply slots: it overrides the request it builds and what happens between the
prompt's allocation and the peers' ``on_admitted``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request, RequestStatus

from vllm_wa.engine_patch.install import REPLAY_FULL_BLOCKS
from vllm_wa.replay.policies import ReplayPolicy
from vllm_wa.replay.trace import Trace, TraceRequest
from vllm_wa.sim.clock import SettableClock
from vllm_wa.sim.kv_manager import model_free_kv_cache_manager
from vllm_wa.sim.token_ids import FIRST_TOKEN


class VLLMEngine:
    """Drives vLLM's own ``KVCacheManager`` with a trace's requests.

    Args:
        trace, policy, num_blocks, clock: as for ``FastEngine``.
        tokens_per_block: the manager's block size (tokens each trace block becomes).
    """

    # How a replayed request ends (what vLLM's ``free`` is told).
    finished_status = RequestStatus.FINISHED_STOPPED

    def __init__(
        self,
        trace: Trace,
        policy: ReplayPolicy,
        num_blocks: int,
        clock: SettableClock,
        tokens_per_block: int = 4,
    ) -> None:
        init_none_hash(sha256)
        self.block_size = tokens_per_block
        self.policy = policy
        self.clock = clock
        self._hasher = get_request_block_hasher(tokens_per_block, sha256)
        self.trace = trace
        self.manager = model_free_kv_cache_manager(num_blocks, tokens_per_block, self._max_len(trace))
        policy.install_vllm(self.manager.block_pool, clock)
        # Peers' hooks are called here; the WA tagger is wrapped into the manager.
        self.hooks = policy.request_hooks
        self._live: dict[str, Any] = {}
        # Trace hash id -> its place in order of first sight (see _prompt).
        self._block_index: dict[Any, int] = {}

    # ---- what a served trace's driver overrides -------------------------------------

    def _max_len(self, trace: Trace) -> int:
        return max(len(r.hash_ids) for r in trace.requests) * self.block_size + 1

    def _prompt(self, req: TraceRequest) -> tuple[list[int], int]:
        """The prompt's token ids and the request's ``max_tokens``.

        Block ``i`` of the trace (in order of first sight) becomes the ids
        ``i * k .. i * k + k - 1``: one run per hash id, so prefixes are
        shared exactly as the trace's ids say, and every id fits the 32-bit
        token buffer vLLM 0.34 keeps (trace ids need not: the agentic
        loader's are namespaced above 2**40).
        """
        k = self.block_size
        index = self._block_index
        places = [index.setdefault(h, len(index)) for h in req.hash_ids]
        return [i * k + j for i in places for j in range(k)], 1

    def _looked_up(self, req: TraceRequest) -> Sequence[Any]:
        """The hash ids of the blocks the prompt's lookup can match."""
        return req.hash_ids

    def _full_blocks(self, req: TraceRequest) -> int | None:
        """How many looked-up blocks are full: a trace's partial last block is a block here."""
        return self.trace.full_blocks(req)

    def _generate(self, vreq: Request, req: TraceRequest) -> None:
        """After the prompt's allocation: the reply's KV (none here)."""

    def _admitted(self, req: TraceRequest, info: Any) -> tuple[Any, list[Any]]:
        """What a peer's ``on_admitted`` is told: the request's facts and its cached blocks."""
        return info, self.manager.coordinator.get_blocks(req.request_id)[0]

    # ---- the driver -----------------------------------------------------------------

    def _request(self, req: TraceRequest) -> Request:
        tokens, max_tokens = self._prompt(req)
        sp = SamplingParams(max_tokens=max_tokens, extra_args={"type_info": req.tag})
        sp.update_from_generation_config({}, eos_token_id=None)
        return Request(
            request_id=req.request_id,
            prompt_token_ids=tokens,
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self._hasher,
        )

    def admit(self, index: int, req: TraceRequest) -> int:
        """Serve a request's prompt; returns its hit blocks, or -1 if it did not fit."""
        m = self.manager
        oracle, hooks, now = self.policy.oracle, self.hooks, self.clock.t
        vreq = self._request(req)
        full = self._full_blocks(req)
        if full is not None:  # read by the WA tagger's lookup hook
            setattr(vreq, REPLAY_FULL_BLOCKS, full)
        blocks, n_hit_tokens, _ = m.get_computed_blocks(vreq)
        n_hit = n_hit_tokens // self.block_size
        if oracle is not None:
            oracle.on_arrival(index, req.hash_ids, n_hit)
        info = None
        if hooks is not None:
            info = self.policy.request_info(req)
            hits = blocks.blocks[0] if blocks.blocks else []
            hooks.on_lookup(info, hits, self._looked_up(req), now, full_blocks=full)
        new = m.allocate_slots(vreq, vreq.num_tokens - n_hit_tokens, n_hit_tokens, blocks)
        if new is None:
            m.free(vreq)  # nothing is held; lets the hooks forget the lookup
            if oracle is not None:
                oracle.on_not_served(index, req.hash_ids)
            if hooks is not None:
                hooks.forget(req.request_id, now)
            return -1
        vreq.num_computed_tokens = vreq.num_tokens
        if oracle is not None:
            oracle.on_admitted(index, m.coordinator.get_blocks(req.request_id)[0], req.hash_ids, n_hit)
        self._generate(vreq, req)
        if hooks is not None:
            info, cached = self._admitted(req, info)
            hooks.on_admitted(info, cached, n_hit, now)
        self._live[req.request_id] = vreq
        return n_hit

    def release(self, req: TraceRequest) -> None:
        vreq = self._live.pop(req.request_id)
        if vreq.num_output_tokens < req.output_tokens:
            # The reply's length, as the engine's hooks read it at the release
            # (the fast engine tells the trace's): no KV is allocated for it.
            vreq.append_output_token_ids([FIRST_TOKEN] * (req.output_tokens - vreq.num_output_tokens))
        tagger = self.policy.tagger
        if tagger is not None and req.outcome is not None:
            # What the API server reports once it parsed the reply (a served
            # trace: what the server's engine learned before the request finished).
            tagger.reclassify(req.request_id, req.outcome)
        if self.hooks is not None:
            blocks = self.manager.coordinator.get_blocks(req.request_id)[0]
            self.hooks.on_free(self.policy.request_info(req, finished=True), blocks, self.clock.t)
        vreq.status = self.finished_status
        self.manager.free(vreq)

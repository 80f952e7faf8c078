"""One request's trip through a simulated prefix cache: look up, pin, release.

:class:`SimPrefixCache` is the order of operations of vLLM's
``KVCacheManager`` over a :class:`SimBlockPool`, with the policy's hooks called
where the engine patch calls them in a real engine.  The replay's fast engine
and the controller's miniature caches both drive it, so a candidate is
measured by the same code that replays it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.sim.block_pool import SimBlockPool


class RequestHooks(Protocol):
    """What a policy learns about requests (the block tagger implements it)."""

    def on_lookup(
        self,
        req: Any,
        hit_blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[Any],
        now: float,
        full_blocks: int | None = None,
    ) -> None: ...

    def forget(self, request_id: str, now: float) -> None: ...

    def on_free(self, req: Any, blocks: Sequence[KVCacheBlock], now: float) -> None: ...


class AdmissionOracle(Protocol):
    """A policy that knows the future (Belady) and is told each admission."""

    def on_arrival(self, index: int, hashes: Sequence[Any], start: int = 0, stop: int | None = None) -> None: ...

    def on_admitted(self, index: int, blocks: Sequence[KVCacheBlock], hashes: Sequence[Any], n_hit: int = 0) -> None: ...


class SimPrefixCache:
    """A prefix cache of ``num_blocks`` blocks whose free queue ``make_queue`` builds.

    ``hooks`` (a block tagger) and ``oracle`` are set once the queue exists;
    either may be None.
    """

    def __init__(
        self,
        num_blocks: int,
        make_queue: Callable[[list[KVCacheBlock]], Any],
        *,
        last_block_hits: bool = False,
        id_space: int | None = None,
    ) -> None:
        self.pool = SimBlockPool(num_blocks, make_queue, last_block_hits=last_block_hits, id_space=id_space)
        self.hooks: RequestHooks | None = None
        self.oracle: AdmissionOracle | None = None

    def admit(
        self,
        request_id: str,
        hashes: Sequence[Any],
        now: float,
        info: Any = None,
        index: int = -1,
        full_blocks: int | None = None,
    ) -> int:
        """Serve a prompt: its hit blocks, or -1 when its blocks do not fit.

        ``info`` is what the hooks know of the request (``RequestTags``);
        ``index`` is its position in the trace, for the oracle;
        ``full_blocks``: how many of ``hashes`` are full blocks (None: all),
        for the hooks (the cache holds a partial last block like any other).
        """
        pool, hooks, oracle = self.pool, self.hooks, self.oracle
        hits = pool.lookup(hashes)
        n_hit = len(hits)
        if oracle is not None:
            oracle.on_arrival(index, hashes, n_hit)
        if hooks is not None:
            hooks.on_lookup(info, hits, hashes, now, full_blocks=full_blocks)
        if not pool.allocate(request_id, hashes, hits):
            if hooks is not None:
                hooks.forget(request_id, now)
            if oracle is not None:
                oracle.on_not_served(index, hashes)
            return -1
        if oracle is not None:
            oracle.on_admitted(index, pool.held[request_id], hashes, n_hit)
        return n_hit

    def release(self, request_id: str, now: float, info: Any = None) -> None:
        """The request finished: its blocks go back to the free queue, tail first."""
        if self.hooks is not None:
            self.hooks.on_free(info, self.pool.held[request_id], now)
        self.pool.release(request_id)

    def holds(self, request_id: str) -> bool:
        return request_id in self.pool.held

"""Install the workload-aware queue into a live vLLM ``BlockPool``.

``install_wa_queue(block_pool)`` swaps the pool's ``FreeKVCacheBlockQueue``
for a :class:`WorkloadAwareFreeQueue` holding the same free blocks in the same
order, and wraps three ``KVCacheManager`` methods so the queue learns which
request used each block:

* ``get_computed_blocks``: the prefix lookup (reuse counts, lookup events),
  and ``get_computed_blocks_for_connector``, the lookup with a KV connector;
* ``free`` and ``pop_blocks_for_free``: a request releases its blocks; they
  are filed under the request's class before they reach the pool.

The wrappers are installed once per process, only when asked, and do nothing
for managers whose pool has no workload-aware queue.  Errors inside them are
caught and counted: a bug here must never take the engine down.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_wa.engine_patch.block_tagger import BlockTagger, ClassKeyFunction, RequestTags
from vllm_wa.engine_patch.compat import check_vllm_version
from vllm_wa.engine_patch.conversations import ConversationTracker
from vllm_wa.engine_patch.events import EventSink
from vllm_wa.engine_patch.free_queue import Clock, WorkloadAwareFreeQueue
from vllm_wa.params import WAParams
from vllm_wa.workload_classes import ClassRegistry

logger = logging.getLogger(__name__)

HANDLE_ATTR = "_vllm_wa_handle"
TAG_KEY = "type_info"
# Set on a vLLM Request by a replay whose trace lists a partial last block as
# a block: how many of its block hashes are full (the conversation tracker's
# tips are full blocks).  A served request never has it: vLLM hashes full
# blocks only.
REPLAY_FULL_BLOCKS = "_vllm_wa_full_blocks"
# Blocks past vLLM's hit that a lookup probes for the conversation tracker:
# EAGLE's dropped block and a whole-block prompt's recomputed last one.
MAX_CUT_BLOCKS = 2
_WRAPPED_MARK = "__vllm_wa_wrapped__"
_install_lock = threading.Lock()

_FINISH_REASON_OUTCOME = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


@dataclass
class WAHandle:
    """Everything installed into one block pool."""

    block_pool: Any
    queue: WorkloadAwareFreeQueue
    tagger: BlockTagger
    sink: EventSink | None
    hook_errors: int = 0
    _logged_error: bool = field(default=False, repr=False)
    _reported_group: int | None = field(default=None, repr=False)
    _own_groups: frozenset[int] | None = field(default=None, repr=False)

    @property
    def registry(self) -> ClassRegistry:
        return self.queue.registry

    def set_params(self, params: WAParams) -> None:
        self.queue.set_params(params)

    def guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """Run a hook; count and log (once) instead of raising into vLLM."""
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - the engine must keep running
            self.hook_errors += 1
            if not self._logged_error:
                self._logged_error = True
                logger.exception("vllm-wa hook failed; counting further failures silently")

    # ---- hook bodies ---------------------------------------------------------------

    def request_tags(self, request: Any, *, finished: bool = False) -> RequestTags:
        sp = getattr(request, "sampling_params", None)
        extra = getattr(sp, "extra_args", None) if sp is not None else None
        raw = extra.get(TAG_KEY) if isinstance(extra, dict) else None
        outcome = None
        reply_tokens = 0
        if finished:
            reason = request.get_finished_reason() if request.is_finished() else None
            if reason is not None:
                outcome = _FINISH_REASON_OUTCOME.get(str(reason))
            reply_tokens = request.num_output_tokens
        return self.tagger.request_tags(request.request_id, raw, outcome, reply_tokens)

    def reported_group(self, manager: Any) -> int:
        """The KV-cache group whose blocks the controller learns from: the first
        full-attention group (it holds every block of a cached prefix; vLLM's
        hybrid coordinator scans it first by the same test), else group 0.

        vLLM numbers the groups in layer order, so a model whose first layer
        uses a sliding window (Gemma 3, gpt-oss) has it as group 0, where the
        blocks that left the window are null.  Only this pool's groups count
        (:meth:`own_groups`).  Worked out at the first call:
        a handle serves one block pool, so one manager.
        """
        if self._reported_group is None:
            from vllm.v1.kv_cache_interface import FullAttentionSpec

            groups = manager.kv_cache_config.kv_cache_groups
            own = self.own_groups(manager)
            full = (
                i for i, group in enumerate(groups) if isinstance(group.kv_cache_spec, FullAttentionSpec) and i in own
            )
            self._reported_group = next(full, min(own, default=0))
        return self._reported_group

    def own_groups(self, manager: Any) -> frozenset[int]:
        """The KV-cache groups whose blocks come from this handle's pool.

        A group can allocate from another pool (vLLM's HiSparse keeps a host
        pool beside the GPU one); its block ids would index this queue's
        per-block arrays and file other blocks.  Worked out at the first call.
        """
        if self._own_groups is None:
            managers = manager.coordinator.single_type_managers
            self._own_groups = frozenset(
                i for i, m in enumerate(managers) if getattr(m, "block_pool", self.block_pool) is self.block_pool
            )
        return self._own_groups

    def _split_groups(self, manager: Any, groups: Any) -> tuple[int, list]:
        """The reported group's index, and the other groups' blocks (a hybrid
        model's), of this pool's groups only."""
        if len(groups) == 1:
            return 0, []
        g = self.reported_group(manager)
        own = self.own_groups(manager)
        return g, [blocks for i, blocks in enumerate(groups) if i != g and i in own]

    def on_lookup(self, manager: Any, request: Any, result: Any) -> None:
        from vllm.v1.core.kv_cache_utils import (
            make_block_hash_with_group_id,
            resolve_block_hashes,
        )

        blocks = result[0].blocks
        g, others = self._split_groups(manager, blocks)
        hits = blocks[g] if blocks else []
        block_size = manager.coordinator.single_type_managers[g].block_size
        hashes = resolve_block_hashes(request.block_hashes, self.block_pool.hash_block_size, block_size)
        cached = len(hits)
        if self.tagger.conversations is not None:
            # vLLM may stop short of blocks it holds (EAGLE drops the last
            # matched one; a prompt of whole blocks recomputes its last).
            for h in hashes[cached : cached + MAX_CUT_BLOCKS]:
                if self.block_pool.get_cached_block(h, [g]) is None:
                    break
                cached += 1
        self.tagger.on_lookup(
            self.request_tags(request),
            hits,
            hashes,
            to_key=lambda h: make_block_hash_with_group_id(h, g),
            extra_hits=others,
            prompt_tokens=request.num_tokens,
            full_blocks=getattr(request, REPLAY_FULL_BLOCKS, None),
            cached_blocks=cached,
        )

    def on_free(self, manager: Any, request: Any) -> None:
        groups = manager.coordinator.get_blocks(request.request_id)
        if not groups or not any(groups):
            self.tagger.forget(request.request_id)
            return
        tags = self.request_tags(request, finished=True)
        groups = [_still_held(blocks) for blocks in groups]
        g, others = self._split_groups(manager, groups)
        self.tagger.on_free(tags, groups[g], finished=request.is_finished(), extra_groups=others)


def _still_held(blocks: Any) -> Any:
    """The blocks this release can free: a request's list may hold a block
    that is free already (vLLM's ``BlockPool.unpin_blocks``, as sparse
    attention uses it, frees a page its request still lists).  Filed again,
    such a block would carry another class than the free list it sits in,
    and a later prefix hit on it would fail in the queue.  vLLM's null block
    (never in the free queue) keeps its place: positions count from it."""
    for b in blocks:
        if not b.ref_cnt and not b.is_null:
            return [b for b in blocks if b.ref_cnt or b.is_null]
    return blocks


def get_wa_handle(block_pool: Any) -> WAHandle | None:
    return getattr(block_pool, HANDLE_ATTR, None)


def install_wa_queue(
    block_pool: Any,
    params: WAParams | None = None,
    *,
    clock: Clock = time.monotonic,
    sink: EventSink | None = None,
    registry: ClassRegistry | None = None,
    class_key: ClassKeyFunction | None = None,
    conversations: ConversationTracker | None = None,
) -> WAHandle:
    """Replace ``block_pool``'s free queue by the workload-aware one (idempotent).

    Only the GPU-medium pool that the scheduler allocates from should be
    passed; pools of other media (CPU offload) are refused.  With
    ``conversations`` the tagger places each request in its conversation
    (turn timing features).
    """
    check_vllm_version()
    from vllm.distributed.kv_events import MEDIUM_GPU

    with _install_lock:
        existing = get_wa_handle(block_pool)
        if existing is not None:
            if params is not None:
                existing.set_params(params)
            return existing
        medium = getattr(block_pool, "medium", MEDIUM_GPU)
        if medium != MEDIUM_GPU:
            raise ValueError(f"vllm-wa only replaces the {MEDIUM_GPU} pool's queue, not {medium!r}")
        free_in_order = block_pool.free_block_queue.get_all_free_blocks()
        queue = WorkloadAwareFreeQueue(
            free_in_order,
            params,
            clock=clock,
            registry=registry,
            sink=sink,
            num_block_ids=len(block_pool.blocks),
        )
        tagger = BlockTagger(queue, block_pool.blocks, sink=sink, class_key=class_key, conversations=conversations)
        handle = WAHandle(block_pool, queue, tagger, sink)
        _install_manager_hooks()
        block_pool.free_block_queue = queue
        setattr(block_pool, HANDLE_ATTR, handle)
        logger.info(
            "vllm-wa: workload-aware free queue installed (%d blocks, %d free)",
            len(block_pool.blocks),
            queue.num_free_blocks,
        )
        return handle


def uninstall_wa_queue(block_pool: Any) -> None:
    """Give the pool back a vLLM queue with the same free blocks, in eviction order."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    with _install_lock:
        handle = get_wa_handle(block_pool)
        if handle is None:
            return
        free = handle.queue.get_all_free_blocks()
        for b in free:
            b.prev_free_block = b.next_free_block = None
        block_pool.free_block_queue = FreeKVCacheBlockQueue(free)
        delattr(block_pool, HANDLE_ATTR)


# ---- KVCacheManager wrappers ------------------------------------------------------------


# Lookups reported on this thread since a connector lookup began (see _wrap_connector_lookup).
_lookups = threading.local()


def _wrap_lookup(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def get_computed_blocks(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, request, *args, **kwargs)
        handle = getattr(self.block_pool, HANDLE_ATTR, None)
        if handle is not None:
            _lookups.reported = True
            handle.guarded(handle.on_lookup, self, request, result)
        return result

    setattr(get_computed_blocks, _WRAPPED_MARK, orig)
    return get_computed_blocks


def _wrap_connector_lookup(orig: Callable[..., Any]) -> Callable[..., Any]:
    """The scheduler's lookup with a KV connector that takes divergent hybrid
    hits (vLLM 0.32, hybrid Mamba models): it calls ``get_computed_blocks``
    (reported there) except on the hybrid path, reported here.  A hit that
    ran deeper than a lagging group (``result[3]``) is not: without external
    tokens the scheduler settles it with ``get_computed_blocks`` (reported
    then), and a request is reported once, so the deeper hit would stand."""

    @functools.wraps(orig)
    def get_computed_blocks_for_connector(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _lookups.reported = False
        result = orig(self, request, *args, **kwargs)
        handle = getattr(self.block_pool, HANDLE_ATTR, None)
        if handle is not None and not _lookups.reported and not result[3]:
            handle.guarded(handle.on_lookup, self, request, result)
        return result

    setattr(get_computed_blocks_for_connector, _WRAPPED_MARK, orig)
    return get_computed_blocks_for_connector


def _wrap_release(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def release(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        handle = getattr(self.block_pool, HANDLE_ATTR, None)
        if handle is not None:
            handle.guarded(handle.on_free, self, request)
        return orig(self, request, *args, **kwargs)

    setattr(release, _WRAPPED_MARK, orig)
    return release


_WRAPPERS = {
    "get_computed_blocks": _wrap_lookup,
    "get_computed_blocks_for_connector": _wrap_connector_lookup,
    "free": _wrap_release,
    "pop_blocks_for_free": _wrap_release,
}


def _install_manager_hooks() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    for name, wrap in _WRAPPERS.items():
        current = getattr(KVCacheManager, name, None)
        if current is None or getattr(current, _WRAPPED_MARK, None) is not None:
            continue  # (the connector lookup is not in every supported vLLM)
        setattr(KVCacheManager, name, wrap(current))


def manager_hooks_installed() -> bool:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return all(getattr(getattr(KVCacheManager, n), _WRAPPED_MARK, None) for n in _WRAPPERS if hasattr(KVCacheManager, n))

"""The queue installed into vLLM's real KVCacheManager / BlockPool."""

from __future__ import annotations

import hashlib
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from vllm.v1.request import RequestStatus

from vllm_wa.engine_patch import EventKind, EventSink, WorkloadAwareFreeQueue, block_tagger
from vllm_wa.engine_patch.compat import UnsupportedVLLMError, check_vllm_version
from vllm_wa.engine_patch.conversations import ConversationTracker
from vllm_wa.engine_patch.events import FreedEvent, LookupEvent
from vllm_wa.engine_patch.install import (
    get_wa_handle,
    install_wa_queue,
    manager_hooks_installed,
    uninstall_wa_queue,
)
from vllm_wa.kv_block import set_hash
from vllm_wa.params import ParamsError, ReuseModel, WAParams
from vllm_wa.sim.clock import SettableClock
from vllm_wa.sim.prefix_cache import SimPrefixCache
from vllm_wa.workload_classes import ClassRegistry

from conftest import finish, make_hybrid_manager, make_manager, make_request, run_prefill

BS = 16


def tokens(start: int, n_blocks: int, tail: int = 1) -> list[int]:
    """A prompt of ``n_blocks`` full blocks plus ``tail`` extra tokens."""
    return list(range(start, start + n_blocks * BS + tail))


def block_ids_of(manager, request_id):
    return [b.block_id for b in manager.coordinator.get_blocks(request_id)[0]]


class OutcomeKey:
    """Classes by tag and reply outcome (what a late outcome changes)."""

    uses_block_features = False

    def __call__(self, req, position, reuse_count):
        return f"{req.tag}.{req.outcome or 'unknown'}"


def release_then_hit(m, clock):
    """``r1`` (4 full blocks) finishes; ``r2`` (6) is prefilled on its 4-block hit and returned."""
    r1 = make_request("r1", tokens(0, 4, 1), tag="chat")
    run_prefill(m, r1)
    clock.advance(1)
    finish(m, r1)
    r2 = make_request("r2", tokens(0, 6, 1), tag="chat")
    assert run_prefill(m, r2) == 4 * BS
    return r2


def test_importing_vllm_wa_patches_nothing():
    code = (
        "import vllm_wa, vllm_wa.engine_patch, vllm_wa.engine_patch.install as i;"
        "from vllm.v1.core.kv_cache_manager import KVCacheManager as M;"
        "assert not i.manager_hooks_installed();"
        "assert not hasattr(M.free, '__vllm_wa_wrapped__');"
        "print('clean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "clean" in out.stdout


def test_install_swaps_queue_keeps_free_blocks_and_is_idempotent(clock):
    m = make_manager(20)
    pool = m.block_pool
    before = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    handle = install_wa_queue(pool, clock=clock)
    assert isinstance(pool.free_block_queue, WorkloadAwareFreeQueue)
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == before
    assert pool.get_num_free_blocks() == 19  # the null block stays out
    again = install_wa_queue(pool, clock=clock)
    assert again is handle
    assert manager_hooks_installed()
    uninstall_wa_queue(pool)
    assert isinstance(pool.free_block_queue, FreeKVCacheBlockQueue)
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == before
    assert get_wa_handle(pool) is None


def test_install_refuses_other_media(clock):
    m = make_manager(8)
    m.block_pool.medium = "CPU"
    with pytest.raises(ValueError, match="GPU"):
        install_wa_queue(m.block_pool, clock=clock)


def test_unsupported_vllm_version_is_a_clear_error():
    with pytest.raises(UnsupportedVLLMError, match=r"supports vLLM >=0.32,<0.35.*0\.31\.0"):
        check_vllm_version("0.31.0")
    with pytest.raises(UnsupportedVLLMError, match="0.35"):
        check_vllm_version("0.35.0")
    assert check_vllm_version("0.33.0") == "0.33.0"
    assert check_vllm_version("0.34.0") == "0.34.0"
    assert check_vllm_version().startswith("0.3")


def test_a_block_s_hash_is_read_and_written_in_the_slot_this_vllm_has():
    """vLLM 0.34 renamed KVCacheBlock's ``_block_hash`` slot to ``block_hash``
    (0.32 and 0.33 read it through a property of that name); the queue reads
    and writes that slot under one name, an alias of its own descriptor."""
    from vllm_wa.kv_block import HASH_SLOT, hash_of, install_hash_alias, set_hash

    b = KVCacheBlock(3)
    assert HASH_SLOT in KVCacheBlock.__slots__
    set_hash(b, b"h" * 32)
    assert hash_of(b) == b.block_hash == b"h" * 32
    install_hash_alias()
    install_hash_alias()  # idempotent
    assert b.wa_block_hash == b"h" * 32
    b.reset_hash()  # vLLM's own writes are seen through the alias ...
    assert hash_of(b) is None and b.wa_block_hash is None
    b.wa_block_hash = b"g" * 32  # ... and the alias's by vLLM
    assert b.block_hash == b"g" * 32
    assert "wa_block_hash" not in KVCacheBlock.__slots__  # no new slot: blocks are as large as before


# ---- vLLM's own prefix-caching scenarios, re-run on the patched pool ------------------------


def _scenario_prefill_then_hit(m):
    """Request 2 shares request 1's first 3 blocks and hits them."""
    r1 = make_request("r1", tokens(0, 3, 7))
    assert run_prefill(m, r1) == 0
    assert block_ids_of(m, "r1") == [1, 2, 3, 4]
    r2 = make_request("r2", tokens(0, 3, 0) + [999] * 5)
    assert run_prefill(m, r2) == 3 * BS
    assert block_ids_of(m, "r2")[:3] == [1, 2, 3]
    finish(m, r1)
    finish(m, r2)
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def _scenario_evict_tail_first(m):
    """Freed blocks are evicted tail first; partial blocks before all cached ones."""
    r1 = make_request("r1", tokens(0, 4, 5))
    run_prefill(m, r1)
    finish(m, r1)
    r2 = make_request("r2", tokens(5000, 4, 5))
    run_prefill(m, r2)
    finish(m, r2)
    order = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    # Fill the cache with a third prompt: it must evict r1's blocks tail first.
    r3 = make_request("r3", tokens(9000, 6, 0))
    run_prefill(m, r3)
    r4 = make_request("r4", tokens(0, 4, 5))
    hit = run_prefill(m, r4)
    return order, block_ids_of(m, "r3"), hit


def _scenario_many_requests(m, seed):
    """Random shared-prefix traffic; returns every request's hit count and blocks."""
    rng = random.Random(seed)
    prefixes = [tokens(10000 * i, rng.randint(1, 4), 0) for i in range(5)]
    live = []
    log = []
    for i in range(120):
        if live and (rng.random() < 0.5 or len(live) > 3):
            r = live.pop(rng.randrange(len(live)))
            finish(m, r)
            continue
        p = rng.choice(prefixes) + [rng.randint(0, 10**6) for _ in range(rng.randint(1, 40))]
        r = make_request(f"q{i}", p, tag=rng.choice(["text_1", "file_1", "image_2"]))
        blocks, n_hit, _ = m.get_computed_blocks(r)
        new = m.allocate_slots(r, r.num_tokens - n_hit, n_hit, blocks)
        if new is None:
            log.append((r.request_id, "wait"))
            continue
        r.num_computed_tokens = r.num_tokens
        live.append(r)
        log.append((r.request_id, n_hit, tuple(block_ids_of(m, r.request_id))))
    return log, [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


@pytest.mark.parametrize(
    "scenario",
    [_scenario_prefill_then_hit, _scenario_evict_tail_first]
    + [lambda m, s=s: _scenario_many_requests(m, s) for s in range(3)],
)
def test_vllm_scenarios_identical_with_uniform_wa(scenario, clock):
    """With LRU-equivalent parameters the patched pool behaves exactly like vLLM."""
    plain = make_manager(14)
    patched = make_manager(14)
    install_wa_queue(patched.block_pool, clock=clock)
    assert scenario(plain) == scenario(patched)
    get_wa_handle(patched.block_pool).queue.check_invariants()


def test_evict_tail_first_details(clock):
    m = make_manager(14)
    install_wa_queue(m.block_pool, clock=clock)
    order, r3_blocks, hit = _scenario_evict_tail_first(m)
    # r2 reused r1's partial block 5; its own partial block 9 goes first, then
    # never-used blocks, then r1's cached blocks tail first, then r2's.
    assert order == [9, 10, 11, 12, 13, 4, 3, 2, 1, 8, 7, 6, 5]
    assert r3_blocks == [9, 10, 11, 12, 13, 4]
    assert hit == 3 * BS  # r1's tail block was evicted; its first three still hit


def test_reset_prefix_cache_with_wa_queue(clock):
    m = make_manager(10)
    install_wa_queue(m.block_pool, clock=clock)
    r1 = make_request("r1", tokens(0, 3, 2))
    run_prefill(m, r1)
    finish(m, r1)
    assert m.reset_prefix_cache()
    r2 = make_request("r2", tokens(0, 3, 2))
    assert run_prefill(m, r2) == 0


# ---- tags to classes ---------------------------------------------------------------------------


def test_tags_from_sampling_params_become_block_classes(clock):
    m = make_manager(20)
    h = install_wa_queue(m.block_pool, clock=clock)
    reg = h.registry
    for rid, tag, start in [("a", "text_1", 0), ("b", "file_2", 1000), ("c", None, 2000)]:
        r = make_request(rid, tokens(start, 2, 3), tag=tag)
        run_prefill(m, r)
        ids = block_ids_of(m, rid)
        finish(m, r)
        want = reg.id_of(tag or "default")
        assert [h.queue.block_class[i] for i in ids] == [want] * len(ids)
    assert h.queue.free_blocks_by_class() == {"text_1": 2, "file_2": 2, "default": 2}
    assert h.tagger.tag_counters.missing >= 1


# "chat.o:stop": a tag holding the separators of class names would be named
# as another key names tag "chat" with outcome "stop".
@pytest.mark.parametrize("bad", [17, "x" * 65, "text 1", "täg", "", ["text_1"], "chat.o:stop", "a:b"])
def test_bad_tags_go_to_invalid_and_are_counted(bad, clock):
    m = make_manager(10)
    h = install_wa_queue(m.block_pool, clock=clock)
    r = make_request("r", tokens(0, 2, 3), extra_args={"type_info": bad})
    run_prefill(m, r)
    finish(m, r)
    assert h.queue.free_blocks_by_class() == {"invalid": 2}
    assert h.tagger.tag_counters.invalid >= 1
    assert h.hook_errors == 0


def test_class_cap_sends_new_tags_to_other(clock):
    m = make_manager(40)
    reg = ClassRegistry(max_classes=5)  # default, invalid, other + 2
    h = install_wa_queue(m.block_pool, clock=clock, registry=reg)
    for i in range(4):
        r = make_request(f"r{i}", tokens(1000 * i, 1, 2), tag=f"t{i}")
        run_prefill(m, r)
        finish(m, r)
    assert set(h.queue.free_blocks_by_class()) == {"t0", "t1", "other"}
    assert h.tagger.tag_counters.over_cap == 2
    assert len(reg) == 5


def test_block_takes_class_of_last_request_that_used_it(clock):
    m = make_manager(20)
    h = install_wa_queue(m.block_pool, clock=clock)
    r1 = make_request("r1", tokens(0, 2, 3), tag="text_1")
    run_prefill(m, r1)
    shared = block_ids_of(m, "r1")[:2]
    finish(m, r1)
    r2 = make_request("r2", tokens(0, 2, 9), tag="agent_1")
    assert run_prefill(m, r2) == 2 * BS
    finish(m, r2)
    cls = h.registry.id_of("agent_1")
    assert [h.queue.block_class[i] for i in shared] == [cls, cls]
    assert h.tagger.reuse_count[shared[0]] == 1


def test_class_key_sees_position_and_reuse_count(clock):
    class DepthKey:
        uses_block_features = True

        def __call__(self, req, position, reuse_count):
            return f"{req.tag}.d{min(position, 2)}.r{min(reuse_count, 1)}"

    m = make_manager(20)
    h = install_wa_queue(m.block_pool, clock=clock, class_key=DepthKey())
    r1 = make_request("r1", tokens(0, 3, 0) + [5], tag="text")
    run_prefill(m, r1)
    finish(m, r1)
    # r2 shares r1's first two blocks, then diverges.
    r2 = make_request("r2", tokens(0, 2, 0) + list(range(7000, 7000 + BS)) + [6], tag="text")
    assert run_prefill(m, r2) == 2 * BS
    finish(m, r2)
    classes = h.queue.free_blocks_by_class()
    assert classes == {"text.d0.r1": 1, "text.d1.r1": 1, "text.d2.r0": 2}


def test_reclassify_moves_a_finished_requests_free_blocks(clock):
    m = make_manager(20)
    h = install_wa_queue(m.block_pool, clock=clock, class_key=OutcomeKey())
    r1 = make_request("r1", tokens(0, 3, 2), tag="chat")
    run_prefill(m, r1)
    clock.advance(1)
    finish(m, r1)
    clock.advance(1)
    r2 = make_request("r2", tokens(500, 2, 2), tag="chat")
    run_prefill(m, r2)
    finish(m, r2)
    assert h.queue.free_blocks_by_class() == {"chat.stop": 5}
    moved = h.tagger.reclassify("r1", "tool")
    assert moved == 3
    assert h.queue.free_blocks_by_class() == {"chat.stop": 2, "chat.tool": 3}
    h.queue.check_invariants()
    # A fact that arrives before the free is applied at the free.
    r3 = make_request("r3", tokens(900, 1, 2), tag="chat")
    run_prefill(m, r3)
    assert h.tagger.reclassify("r3", "tool") == 0
    finish(m, r3)
    assert h.queue.free_blocks_by_class()["chat.tool"] == 4
    assert h.tagger.reclassify("unknown-request", "tool") == 0


def test_a_hybrid_models_further_kv_group_is_filed_and_refiled_but_reports_no_events(clock):
    """Lookups report the first KV-cache group's hashes only: a FREED event
    for another group's block could never be matched by a reuse (a censored
    observation only, pulling every reuse model down). Its blocks take the
    request's class, and a late outcome moves them with the first group's."""

    m = make_hybrid_manager(60, BS)
    # Hash-sampled events (with every block sampled, every eviction is reported).
    sink = EventSink(capacity=1000, sample_rate=0.5)
    h = install_wa_queue(m.block_pool, clock=clock, sink=sink, class_key=OutcomeKey())
    r1 = make_request("r1", tokens(0, 4, 1), tag="chat")
    run_prefill(m, r1)
    groups = m.coordinator.get_blocks("r1")
    assert len(groups) == 2 and all(groups)
    clock.advance(1)
    finish(m, r1)
    events = sink.drain()
    freed = [e.block_hash for e in events if e.kind == EventKind.FREED]
    assert 0 < len(freed) <= 4  # the first group's 4 full blocks, sampled
    assert [e.kind for e in events][-1] == EventKind.FINISHED
    both = h.queue.free_blocks_by_class()["chat.stop"]
    assert both > 4  # the sliding-window group's blocks are filed too
    # A late outcome moves every group's blocks.
    assert h.tagger.reclassify("r1", "tool") == both
    assert h.queue.free_blocks_by_class() == {"chat.tool": both}
    h.queue.check_invariants()
    # The same prompt again: every FREED hash is among the lookup's (each one a seen reuse).
    r2 = make_request("r2", tokens(0, 4, 1), tag="chat")
    assert run_prefill(m, r2) == 4 * BS
    looked = [e for e in sink.drain() if e.kind == EventKind.LOOKUP]
    assert set(freed) <= set(looked[-1].hashes)
    # Evictions: an EVICTED event only for a block whose free was reported.
    finish(m, r2)
    for i in range(40):  # every block id serves both groups in turn
        r = make_request(f"fill{i}", tokens(10_000 * (i + 1), 5, 1), tag="chat")
        run_prefill(m, r)
        clock.advance(1)
        finish(m, r)
    events = sink.drain()
    reported = set(freed) | {e.block_hash for e in events if e.kind == EventKind.FREED}
    evicted = [e.block_hash for e in events if e.kind == EventKind.EVICTED]
    assert len(evicted) >= 4
    assert set(evicted) <= reported
    uninstall_wa_queue(m.block_pool)


@pytest.mark.parametrize("window_first", [False, True])
def test_the_controller_learns_from_the_full_attention_group_in_either_order(clock, window_first):
    """The reported group is the full-attention one, wherever vLLM numbers it: a
    sliding-window group's blocks outside the window are null at the release."""
    m = make_hybrid_manager(80, BS, window_first=window_first)
    sink = EventSink(capacity=1000)  # every block sampled
    h = install_wa_queue(m.block_pool, clock=clock, sink=sink)
    assert h.reported_group(m) == (1 if window_first else 0)
    r2 = release_then_hit(m, clock)
    sink.drain()
    clock.advance(1)
    finish(m, r2)
    freed = [e.block_hash for e in sink.drain() if e.kind == EventKind.FREED]
    assert len(freed) == 6  # every full block of the prompt, none of the window's nulls
    r3 = make_request("r3", tokens(0, 6, 1), tag="chat")
    assert run_prefill(m, r3) == 6 * BS
    looked = [e for e in sink.drain() if e.kind == EventKind.LOOKUP]
    assert set(freed) == set(looked[-1].hashes)  # each one seen reused
    uninstall_wa_queue(m.block_pool)


def test_a_late_outcome_moves_only_blocks_that_still_hold_what_the_request_freed(clock):
    """A block the request freed, evicted since and freed again by a release no
    late outcome can reach (here a preemption) belongs to someone else now."""

    m = make_manager(6)  # 5 usable blocks
    h = install_wa_queue(m.block_pool, clock=clock, class_key=OutcomeKey())
    r1 = make_request("r1", tokens(0, 3, 1), tag="chat")
    run_prefill(m, r1)
    mine = set(block_ids_of(m, "r1"))
    clock.advance(1)
    finish(m, r1)
    r2 = make_request("r2", tokens(5000, 4, 0), tag="batch")  # evicts most of r1's blocks
    run_prefill(m, r2)
    taken = mine & set(block_ids_of(m, "r2"))
    assert taken and mine - taken
    clock.advance(1)
    finish(m, r2, RequestStatus.PREEMPTED)  # freed, and not a finished release
    batch = h.queue.free_blocks_by_class()["batch.unknown"]
    # Only r1's blocks that still hold what it freed move; r2's stay in its class.
    assert h.tagger.reclassify("r1", "tool") == len(mine - taken)
    assert h.queue.free_blocks_by_class()["batch.unknown"] == batch


def test_a_late_outcome_keeps_each_blocks_position_in_a_sliding_window_group(clock):
    """A sliding-window group's block list starts with null blocks (prefix hits
    outside the window): the refile must see each block at the position it was freed at."""

    class DepthOutcomeKey:
        uses_block_features = True

        def __call__(self, req, position, reuse_count):
            return f"{req.outcome or 'unknown'}.d{position}"

    m = make_hybrid_manager(60, BS)
    h = install_wa_queue(m.block_pool, clock=clock, class_key=DepthOutcomeKey())
    r2 = release_then_hit(m, clock)
    assert any(b.is_null for b in m.coordinator.get_blocks("r2")[1])
    clock.advance(1)
    finish(m, r2)
    before = h.queue.free_blocks_by_class()
    assert h.tagger.reclassify("r2", "tool") > 0
    after = h.queue.free_blocks_by_class()
    # Only the outcome changed: every block kept its depth.
    moved = {c.split(".", 1)[1]: n for c, n in after.items() if c.startswith("tool.")}
    left = {c.split(".", 1)[1]: n for c, n in after.items() if c.startswith("stop.")}
    was = {c.split(".", 1)[1]: n for c, n in before.items() if c.startswith("stop.")}
    assert {d: moved.get(d, 0) + left.get(d, 0) for d in was} == was
    h.queue.check_invariants()


def test_late_outcomes_keep_a_bounded_number_of_reported_blocks(clock, monkeypatch):
    """What the OUTCOME event carries is kept for the newest releases only, in all
    at most MAX_REPORTED_BLOCKS: a late report on an older one still moves the
    live queue's blocks, and tells the controller nothing to move."""
    monkeypatch.setattr(block_tagger, "MAX_REPORTED_BLOCKS", 5)
    m = make_manager(40)
    sink = EventSink(capacity=1000)
    h = install_wa_queue(m.block_pool, clock=clock, sink=sink, class_key=OutcomeKey())
    for i in range(3):
        r = make_request(f"r{i}", tokens(1000 * i, 3, 1), tag="chat")
        run_prefill(m, r)
        clock.advance(1)
        finish(m, r)
    sink.drain()
    assert h.tagger._reported_blocks == 3
    for rid in ("r0", "r1", "r2"):
        assert h.tagger.reclassify(rid, "tool") == 3
    outcomes = {e.request.request_id: e.blocks for e in sink.drain() if e.kind == EventKind.OUTCOME}
    assert outcomes["r0"] == outcomes["r1"] == ()
    assert [pos for pos, _, _ in outcomes["r2"]] == [0, 1, 2]
    uninstall_wa_queue(m.block_pool)


def test_the_tagger_keeps_the_blocks_of_the_releases_it_remembers_only():
    """A release that leaves the late-fact memory (``remember_finished``) gives
    its blocks back, reported ones included: under a 1/64 sample a release
    reports a block or two, so the reported-blocks cap alone kept 16 times
    the releases remembered (each with all its block ids and hashes)."""
    clock = SettableClock()
    blocks = [KVCacheBlock(i) for i in range(4000)]
    sink = EventSink(capacity=1 << 20, sample_rate=1 / 64)
    queue = WorkloadAwareFreeQueue(blocks, clock=clock, sink=sink)
    tagger = block_tagger.BlockTagger(queue, blocks, sink=sink, remember_finished=16)
    digest = 0
    for r in range(2000):
        clock.advance(1.0)
        held = queue.popleft_n(40)
        for b in held:
            digest += 1
            set_hash(b, digest.to_bytes(8, "little") * 4)  # bytes, as vLLM's hashes
            b.ref_cnt = 1
        tagger.on_free(block_tagger.RequestTags(f"req-{r}"), held)
        for b in held:
            b.ref_cnt = 0
        queue.append_n(held[::-1])
        sink.drain()
    remembered = [rec for recs in tagger._finished.values() for rec in recs]
    assert len(remembered) == 16
    held_ids = sum(len(g) for rec in {id(r): r for r in [*remembered, *tagger._reporting]}.values() for g in rec.block_ids)
    assert held_ids == 16 * 40
    assert tagger._reported_blocks == sum(len(rec.reported) for rec in remembered) > 0
    assert len(tagger._reporting) <= 16


def test_the_late_fact_memory_is_bounded_by_releases_and_blocks_not_by_request_ids():
    """A client that cycles a few request ids keeps no more releases than one
    with fresh ids (each id holds up to MAX_RELEASES_PER_ID releases: a cap on
    ids alone kept 16 times ``remember_finished``), and long prompts keep at
    most REMEMBERED_BLOCKS_PER_POOL_BLOCK pools of block ids however many
    releases are remembered; the latest release still takes its late fact."""
    clock = SettableClock()
    blocks = [KVCacheBlock(i) for i in range(400)]
    queue = WorkloadAwareFreeQueue(blocks, clock=clock)
    tagger = block_tagger.BlockTagger(queue, blocks, class_key=OutcomeKey(), remember_finished=16)
    digest = 0

    def release(rid: str, n: int) -> None:
        nonlocal digest
        clock.advance(1.0)
        held = queue.popleft_n(n)
        for b in held:
            digest += 1
            set_hash(b, digest.to_bytes(8, "little") * 4)
            b.ref_cnt = 1
        tagger.on_free(block_tagger.RequestTags(rid, outcome="stop"), held)
        for b in held:
            b.ref_cnt = 0
        queue.append_n(held[::-1])

    for r in range(400):
        release(f"client-{r % 4}", 10)
    remembered = [rec for recs in tagger._finished.values() for rec in recs]
    assert len(remembered) == tagger._remembered_releases == 16
    assert tagger._remembered_blocks == sum(len(g) for rec in remembered for g in rec.block_ids) == 160
    for r in range(40):
        release(f"long-{r}", 150)
    remembered = [rec for recs in tagger._finished.values() for rec in recs]
    kept = sum(len(g) for rec in remembered for g in rec.block_ids)
    assert kept == tagger._remembered_blocks <= block_tagger.REMEMBERED_BLOCKS_PER_POOL_BLOCK * len(blocks)
    assert len(remembered) == 5 and tagger._remembered_releases == 5
    assert tagger.reclassify("long-39", "tool") == 150


def test_wa_params_change_eviction_order_in_the_pool(clock):
    m = make_manager(13)
    params = WAParams(
        models={"tool": ReuseModel.exponential(0.9, 1 / 10), "human": ReuseModel.exponential(0.5, 1 / 600)},
        horizon=5.0,
    )
    h = install_wa_queue(m.block_pool, params, clock=clock)
    tool = make_request("tool", tokens(0, 3, 0) + [1], tag="tool")
    run_prefill(m, tool)
    finish(m, tool)
    clock.advance(2)
    human = make_request("human", tokens(1000, 3, 0) + [1], tag="human")
    run_prefill(m, human)
    finish(m, human)
    clock.advance(1)
    # 6 blocks hold no hash; a 9-block prompt must evict 3 cached blocks.
    # LRU would take the tool result's (older) blocks; WA takes the human
    # turn's: a 3-second-idle tool result is far likelier to return in 5 s.
    new = make_request("new", tokens(5000, 8, 0) + [1])
    run_prefill(m, new)
    finish(m, new)
    assert h.queue.counters.evicted[h.registry.id_of("human")] == 3
    assert h.queue.counters.evicted[h.registry.id_of("tool")] == 0
    assert run_prefill(m, make_request("tool2", tokens(0, 3, 0) + [2], tag="tool")) == 3 * BS


@pytest.mark.parametrize("stamp, kept", [("free", "long"), ("lookup", "short")])
def test_lookup_stamp_ranks_a_release_by_when_its_request_started(clock, stamp, kept):
    m = make_manager(13)
    h = install_wa_queue(m.block_pool, WAParams(stamp=stamp), clock=clock)
    prompts = {"long": tokens(0, 3, 0) + [1], "short": tokens(1000, 3, 0) + [1]}
    long_req = make_request("long", prompts["long"])
    run_prefill(m, long_req)  # starts at 0
    clock.advance(5)
    short_req = make_request("short", prompts["short"])
    run_prefill(m, short_req)  # starts at 5
    clock.advance(1)
    finish(m, short_req)  # released at 6
    clock.advance(4)
    finish(m, long_req)  # released at 10
    h.queue.check_invariants()
    clock.advance(1)
    # A 9-block prompt takes the 6 blocks without a hash and evicts 3 cached
    # ones: LRU the short request's (released first), the lookup stamp the
    # long request's (started first).
    new = make_request("new", tokens(5000, 8, 0) + [1])
    run_prefill(m, new)
    finish(m, new)
    assert run_prefill(m, make_request("again", prompts[kept])) == 3 * BS


def test_a_deferred_release_takes_its_lookup_stamp_after_a_swap_turned_them_on(clock):
    """vLLM can take a finished request's blocks now (``pop_blocks_for_free``:
    the tagger files them) and free them later.  A swap in between that turns
    lookup stamps on must still stamp them by their request's lookup, not by
    a start never written (0, evicted first)."""
    m = make_manager(12)
    h = install_wa_queue(m.block_pool, WAParams(stamp="lookup"), clock=clock)
    early = make_request("early", tokens(1000, 2))
    clock.t = 10.0
    run_prefill(m, early)
    h.set_params(WAParams(stamp="free"))
    later = make_request("later", tokens(5000, 2))
    clock.t = 50.0
    run_prefill(m, later)
    clock.t = 60.0
    later.status = RequestStatus.FINISHED_STOPPED
    deferred = m.pop_blocks_for_free(later)
    h.set_params(WAParams(stamp="lookup"))
    finish(m, early)
    m.block_pool.free_blocks(reversed(deferred))
    h.queue.check_invariants()
    stamps = {b.block_id: h.queue.stamp[b.block_id] for b in h.queue.iter_eviction_order() if b.block_hash is not None}
    assert sorted(stamps.values()) == [10.0, 10.0, 50.0, 50.0]
    assert [stamps[b] for b in list(stamps)[:2]] == [10.0, 10.0]  # the earlier start goes first


@pytest.mark.parametrize("stamp", ["free", "lookup"])
def test_a_block_vllm_unpinned_before_the_release_is_not_filed_again(clock, stamp):
    """vLLM's ``BlockPool.unpin_blocks`` (sparse attention's page release)
    frees a block that its request still lists; the release hook must not
    file it again: re-classed, it sat in one class's list under another's
    name, and a prefix hit on it (``touch``) raised KeyError in the queue."""
    m = make_manager(10)
    pool = m.block_pool
    if not hasattr(pool, "unpin_blocks"):
        pytest.skip("this vLLM has no BlockPool.unpin_blocks")
    h = install_wa_queue(pool, WAParams(stamp=stamp), clock=clock)
    r = make_request("r", tokens(0, 3, 1), tag="chat")
    run_prefill(m, r)
    held = list(m.coordinator.get_blocks("r")[0])
    page = held[0]
    clock.advance(1)
    pool.unpin_blocks([page], lambda b: None)  # free now, still in the request's list
    filed_as = h.queue.block_class[page.block_id]
    clock.advance(1)
    r.status = RequestStatus.FINISHED_STOPPED
    h.on_free(m, r)  # the release hook, as KVCacheManager.free calls it
    pool.free_blocks(reversed(held[1:]))  # what vLLM frees: the blocks still held
    assert h.queue.block_class[page.block_id] == filed_as
    h.queue.check_invariants()
    pool.touch([page])  # a prefix hit on the page's content
    h.queue.check_invariants()
    assert page.ref_cnt == 1 and pool.get_num_free_blocks() == 10 - 2  # the null block and the page


def test_a_block_given_new_content_forgets_the_lookup_of_its_old_content(clock):
    """A long-running request that takes an evicted block mid-decode releases
    it stamped by its own start, not by the later lookup of the content the
    block held before (which would file it as more recent than it is)."""
    m = make_manager(6)  # five usable blocks
    h = install_wa_queue(m.block_pool, WAParams(stamp="lookup"), clock=clock)
    long_running = make_request("long", tokens(100, 1))
    clock.t = 20.0
    run_prefill(m, long_running)  # holds two blocks
    old = make_request("old", tokens(5000, 2))
    clock.t = 100.0
    run_prefill(m, old)
    clock.t = 110.0
    finish(m, old)  # three free blocks, last looked up at 100
    old_ids = {b.block_id for b in h.queue.iter_eviction_order()}
    clock.t = 120.0
    for tok in range(2 * BS):
        long_running.append_output_token_ids(9000 + tok)
    assert m.allocate_slots(long_running, 2 * BS) is not None  # evicts two of them
    long_running.num_computed_tokens = long_running.num_tokens
    taken = set(block_ids_of(m, "long")) & old_ids
    assert len(taken) == 2
    clock.t = 130.0
    finish(m, long_running)
    h.queue.check_invariants()
    # (A block without a hash, the partial tail, has no content to date.)
    cached = [b.block_id for b in h.queue.iter_eviction_order() if b.block_hash is not None and b.block_id in taken]
    assert cached and {h.queue.stamp[bid] for bid in cached} == {20.0}


def hybrid_after_a_chat_release(clock, num_blocks: int, first_token: int):
    """A two-group manager (32-token window) with the lookup-stamped queue, after a
    ``chat`` request of 6 full blocks was looked up at 10 and released at 20."""
    m = make_hybrid_manager(num_blocks, BS, sliding_window=32)
    h = install_wa_queue(m.block_pool, WAParams(stamp="lookup"), clock=clock)
    old = make_request("old", tokens(first_token, 6), tag="chat")
    clock.t = 10.0
    run_prefill(m, old)
    clock.t = 20.0
    finish(m, old)
    return m, h


def decode(m, request, n_blocks: int) -> None:
    """Decode ``n_blocks`` blocks' worth of tokens, one block per step (the window moves on)."""
    for _ in range(n_blocks):
        for tok in range(BS):
            request.append_output_token_ids(9000 + tok)
        assert m.allocate_slots(request, BS) is not None
        request.num_computed_tokens = request.num_tokens


def test_a_block_freed_without_the_tagger_is_filed_as_untagged_not_by_its_old_content(clock):
    """vLLM frees a sliding-window group's blocks that left the window while
    the request still runs (``remove_skipped_blocks``), straight into the
    pool: no release hook sees them.  Such a block goes to the default class,
    stamped at that release, not to the class of the content it held before
    it was evicted (which says nothing about it)."""
    m, h = hybrid_after_a_chat_release(clock, 15, 5000)  # 14 usable: two requests of 7 + 7 blocks
    assert set(h.queue.free_blocks_by_class()) == {"chat"}
    chat_ids = {b.block_id for b in h.queue.iter_eviction_order()}
    long_running = make_request("long", tokens(0, 6), tag="tool")
    clock.t = 30.0
    run_prefill(m, long_running)  # takes (and evicts) the old request's blocks
    assert not h.queue.free_blocks_by_class().get("chat")
    clock.t = 40.0
    # The window moves on: its blocks before the window are freed, and one
    # block of each group taken.
    decode(m, long_running, 1)
    left_window = list(h.queue.iter_eviction_order())
    assert left_window and {b.block_id for b in left_window} <= chat_ids
    assert all(b.block_hash is not None for b in left_window)
    assert h.queue.free_blocks_by_class() == {"default": len(left_window)}
    assert {h.queue.stamp[b.block_id] for b in left_window} == {40.0}
    h.queue.check_invariants()
    clock.t = 50.0
    finish(m, long_running)  # the release files the rest as the request's
    by_class = h.queue.free_blocks_by_class()
    assert by_class["default"] == len(left_window) and by_class["tool"] > 0
    h.queue.check_invariants()


@pytest.mark.parametrize("sample_rate", [0.999999, 1.0])  # hash-sampled (nearly every block in), or every block
def test_an_eviction_is_reported_only_for_content_whose_release_was(clock, sample_rate):
    """A sampled block's EVICTED event pairs with the FREED event of the same
    content (the ghost table and the real cache's turnover count read it).  A
    block taken for new content and freed without the tagger (a window's,
    mid-request) made no FREED event, so its eviction makes no EVICTED one,
    whatever the flag of the content it held before said."""
    m = make_hybrid_manager(15, BS, sliding_window=32)
    sink = EventSink(capacity=10_000, sample_rate=sample_rate)
    h = install_wa_queue(m.block_pool, WAParams(stamp="lookup"), clock=clock, sink=sink)
    old = make_request("old", tokens(5000, 6), tag="chat")
    clock.t = 10.0
    run_prefill(m, old)
    clock.t = 20.0
    finish(m, old)
    long_running = make_request("long", tokens(0, 6), tag="tool")
    clock.t = 30.0
    run_prefill(m, long_running)  # evicts the old request's blocks
    clock.t = 40.0
    decode(m, long_running, 1)  # window blocks freed without the tagger
    left_window = [b.block_hash for b in h.queue.iter_eviction_order()]
    assert left_window
    clock.t = 50.0
    finish(m, long_running)
    clock.t = 60.0
    run_prefill(m, make_request("next", tokens(9000, 6), tag="tool"))  # evicts every free block
    events = sink.drain()
    freed = {ev.block_hash for ev in events if ev.kind == EventKind.FREED}
    evicted = [ev.block_hash for ev in events if ev.kind == EventKind.EVICTED]
    assert evicted and set(evicted) <= freed
    assert not set(left_window) & set(evicted)
    h.queue.check_invariants()


class _AnotherPool:
    """The same blocks under another pool object (as a group that allocates
    from a pool of its own, such as vLLM's HiSparse host pool, is seen)."""

    def __init__(self, pool) -> None:
        self._pool = pool

    def __getattr__(self, name):
        return getattr(self._pool, name)


@pytest.mark.parametrize("window_first", [False, True])
def test_a_group_of_another_pool_is_not_filed_by_this_pools_tagger(clock, window_first):
    """Block ids of another pool's group would index this queue's arrays and
    file this pool's blocks of those ids; only the pool's own groups are
    filed, and the reported group is its own full-attention one."""
    m = make_hybrid_manager(40, BS, sliding_window=32, window_first=window_first)
    h = install_wa_queue(m.block_pool, WAParams(stamp="lookup"), clock=clock)
    window = 0 if window_first else 1
    m.coordinator.single_type_managers[window].block_pool = _AnotherPool(m.block_pool)
    req = make_request("r", tokens(0, 6), tag="chat")
    clock.t = 10.0
    run_prefill(m, req)
    held = [len([b for b in g if not b.is_null and b.block_hash is not None]) for g in m.coordinator.get_blocks("r")]
    clock.t = 20.0
    finish(m, req)
    by_class = h.queue.free_blocks_by_class()
    assert by_class.get("chat") == held[1 - window]  # the full-attention group's blocks only
    assert by_class.get("default") == held[window]  # the other pool's: freed as no release filed them
    assert h.hook_errors == 0
    h.queue.check_invariants()


def test_a_block_that_takes_back_the_same_hash_object_is_sampled_afresh():
    """A block taken for new content loses its sampling flag; if the content
    it takes is the same hash object (a repeated prompt's recomputed last
    block, in the simulator), the flag is still computed again, so its
    release is reported and its eviction too."""
    clock = SettableClock()
    sink = EventSink(capacity=1 << 16, sample_rate=0.5)
    digests = [hashlib.sha256(str(i).encode()).digest() for i in range(200)]  # bytes, as vLLM's
    prompt = [next(h for h in digests if not sink.is_sampled(h)), next(h for h in digests if sink.is_sampled(h))]
    made = {}

    def make_queue(blocks):
        q = WorkloadAwareFreeQueue(blocks, clock=clock, sink=sink)
        made["tagger"] = block_tagger.BlockTagger(q, blocks, sink=sink)
        return q

    cache = SimPrefixCache(3, make_queue)  # the null block and two
    cache.hooks = made["tagger"]
    tags = block_tagger.RequestTags
    for rid in ("r1", "r2"):  # r2's last block is recomputed into the block that held it
        clock.advance(1.0)
        cache.admit(rid, prompt, clock(), tags(rid))
        clock.advance(1.0)
        cache.release(rid, clock(), tags(rid))
    assert cache.pool.queue.num_free_blocks == 2
    events = sink.drain()
    assert [e.block_hash for e in events if e.kind == EventKind.FREED] == [prompt[1], prompt[1]]
    assert [e.block_hash for e in events if e.kind == EventKind.EVICTED] == [prompt[1]]


def test_a_hit_block_that_leaves_the_window_is_dated_by_the_hit_not_its_previous_user(clock):
    """A sliding-window block that a request found in the prefix cache and that
    leaves the window before the release (no hook sees it) keeps its class, the
    class of the same content's last release, and is stamped by this request's
    lookup, not by the lookup of the request that freed it before."""
    m, h = hybrid_after_a_chat_release(clock, 40, 0)
    new = make_request("new", tokens(0, 6), tag="tool")
    clock.t = 30.0
    assert run_prefill(m, new) > 0
    window_hits = {b.block_id for b in m.coordinator.get_blocks("new")[1] if not b.is_null}
    free_before = {b.block_id for b in h.queue.iter_eviction_order()}
    clock.t = 40.0
    decode(m, new, 3)
    left = [b for b in h.queue.iter_eviction_order() if b.block_id not in free_before]
    hit_left = [b for b in left if b.block_id in window_hits]
    assert hit_left
    assert {h.queue.registry.name_of(h.queue.block_class[b.block_id]) for b in hit_left} == {"chat"}
    assert {h.queue.stamp[b.block_id] for b in hit_left} == {30.0}
    h.queue.check_invariants()


def test_set_params_rejects_bad_values_and_keeps_old(clock):
    m = make_manager(8)
    h = install_wa_queue(m.block_pool, clock=clock)
    good = h.queue.params
    for bad in [
        lambda: WAParams(models={"x": ReuseModel.exponential(float("nan"), 1.0)}),
        lambda: WAParams(models={"x": ReuseModel.exponential(1.5, 1.0)}),
        lambda: WAParams(models={"x": ReuseModel.exponential(0.5, -1.0)}),
        lambda: WAParams(horizon=float("inf")),
        lambda: WAParams.from_pr_json({"a": {"x": 1.0}, "p": {"x": float("inf")}}),
    ]:
        with pytest.raises(ParamsError):
            h.set_params(bad())
    with pytest.raises(ParamsError):
        h.queue.set_params({"a": {}, "p": {}})
    assert h.queue.params is good


# ---- events ------------------------------------------------------------------------------------


def test_a_lookup_through_the_kv_connector_path_is_reported_once(clock, monkeypatch):
    """With a KV connector that takes divergent hybrid hits the scheduler looks
    up through ``get_computed_blocks_for_connector``: on its plain path (it
    calls ``get_computed_blocks``) and on its hybrid path (it does not), each
    lookup makes one LOOKUP event."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    m = make_manager(10)
    sink = EventSink(capacity=100)
    install_wa_queue(m.block_pool, clock=clock, sink=sink)
    r1 = make_request("r1", tokens(0, 3, 1))
    m.get_computed_blocks_for_connector(r1)
    looked_up = [e.request_id for e in sink.drain() if e.kind == EventKind.LOOKUP]
    assert looked_up == ["r1"]
    plain = KVCacheManager.get_computed_blocks.__vllm_wa_wrapped__
    # The hybrid path: vLLM finds the hits itself, without get_computed_blocks.
    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", lambda self, req, *args: plain(self, req, *args))
    m.get_computed_blocks_for_connector(make_request("r2", tokens(100, 2, 1)))
    assert [e.request_id for e in sink.drain() if e.kind == EventKind.LOOKUP] == ["r2"]
    # A hit deeper than a lagging group: the scheduler settles it with
    # get_computed_blocks (reported then), so it is not reported here.
    from vllm_wa.engine_patch import install

    diverged = install._wrap_connector_lookup(lambda self, req, *args: (*plain(self, req, *args), True))
    r3 = make_request("r3", tokens(200, 2, 1))
    diverged(m, r3)
    assert [e for e in sink.drain() if e.kind == EventKind.LOOKUP] == []
    monkeypatch.undo()  # the wrapped get_computed_blocks again
    m.get_computed_blocks(r3)
    assert [e.request_id for e in sink.drain() if e.kind == EventKind.LOOKUP] == ["r3"]


def test_events_for_hit_eviction_and_finish(clock):
    m = make_manager(10)
    sink = EventSink(capacity=1000)
    h = install_wa_queue(m.block_pool, clock=clock, sink=sink, conversations=ConversationTracker())
    r1 = make_request("r1", tokens(0, 3, 1), tag="text_1")
    run_prefill(m, r1)
    clock.advance(1.0)
    finish(m, r1)
    clock.advance(2.5)
    r2 = make_request("r2", tokens(0, 2, 0) + [7, 8], tag="text_2")
    assert run_prefill(m, r2) == 2 * BS
    finish(m, r2)
    clock.advance(1.0)
    big = make_request("big", tokens(4000, 8, 0) + [1], tag="file_1")
    run_prefill(m, big)
    events = sink.drain()
    kinds = [e.kind for e in events]
    assert kinds[0] == EventKind.LOOKUP and events[0].request_id == "r1" and len(events[0].hashes) == 3
    # What the real cache had of the sampled blocks (every block sampled here):
    # none for r1, both of r2's full blocks (its prefix), none of a new prompt's.
    lookups = {e.request_id: e for e in events if e.kind == EventKind.LOOKUP}
    assert [(lookups[r].real_hits, len(lookups[r].hashes)) for r in ("r1", "r2", "big")] == [(0, 3), (2, 2), (0, 8)]
    fin = [e for e in events if e.kind == EventKind.FINISHED]
    assert [(e.request_id, e.request.outcome) for e in fin] == [("r1", "stop"), ("r2", "stop")]
    # r2's prefix hit took two free blocks of r1's class off the free list.
    assert h.queue.counters.reused[h.registry.id_of("text_1")] == 2
    # r2 continues r1 (its prompt holds r1's last full block): turn 2, after 2.5 s.
    r2_timing = fin[1].request.timing
    assert r2_timing.turn == 2 and r2_timing.think_s == pytest.approx(2.5)
    assert r2_timing.conversation == fin[0].request.timing.conversation
    assert h.tagger.conversations.counters.continuations == 1
    evicted = [e for e in events if e.kind == EventKind.EVICTED]
    assert len(evicted) == 3  # the cached blocks of r1/r2 (partial ones carry no hash)
    assert all(e.block_hash is not None for e in evicted)
    lookup_big = [e for e in events if e.kind == EventKind.LOOKUP and e.request_id == "big"][0]
    assert len(lookup_big.hashes) == 8 and lookup_big.chain == ()
    assert sink.dropped == 0


def test_full_sink_drops_and_counts_without_blocking(clock):
    m = make_manager(30)
    sink = EventSink(capacity=2)
    h = install_wa_queue(m.block_pool, clock=clock, sink=sink)
    for i in range(5):
        r = make_request(f"r{i}", tokens(100 * i * BS, 3, 1))
        run_prefill(m, r)
        finish(m, r)
    assert len(sink) == 2
    assert sink.dropped > 5
    assert h.hook_errors == 0
    # Requests were all served and freed normally.
    assert m.block_pool.get_num_free_blocks() == 29


def test_sink_bounds_the_hashes_its_queued_events_carry_not_only_their_number(clock):
    """A stalled consumer holds at most ``hash_capacity`` hashes of long
    prompts' lookups, however few the events; draining frees the room."""
    m = make_manager(200)
    sink = EventSink(capacity=1000, hash_capacity=20)  # every block sampled
    h = install_wa_queue(m.block_pool, clock=clock, sink=sink)
    for i in range(4):  # 8 full blocks each: lookups of 8 hashes
        r = make_request(f"r{i}", tokens(1000 * i, 8, 1))
        run_prefill(m, r)
        finish(m, r)
    lookups = [e for e in list(sink._queue) if e.kind == EventKind.LOOKUP]
    assert [len(e.hashes) for e in lookups] == [8, 8]  # the third and fourth would pass 20
    assert sink.queued_hashes == 16 and sink.dropped == 2
    assert h.hook_errors == 0 and m.block_pool.get_num_free_blocks() == 199
    sink.drain(max_events=1)  # the first lookup
    assert sink.queued_hashes == 8
    sink.drain()
    assert sink.queued_hashes == 0
    # One event larger than the bound is taken when nothing else is held.
    big = LookupEvent(EventKind.LOOKUP, 0.0, "big", "t", tuple(range(30)), ())
    assert sink.emit(big) and sink.queued_hashes == 30
    assert not sink.emit(big._replace(request_id="big2")) and sink.dropped == 3
    assert sink.emit(FreedEvent(EventKind.FREED, 0.0, 1, None, 0, 0))  # carries no sequence
    with pytest.raises(ValueError, match="hash_capacity"):
        EventSink(hash_capacity=0)
    assert EventSink(capacity=4).hash_capacity == 32


def test_sampled_events_follow_the_hash_sample(clock):
    m = make_manager(200)
    sink = EventSink(capacity=100000, sample_rate=0.25)
    install_wa_queue(m.block_pool, clock=clock, sink=sink)
    for i in range(20):
        r = make_request(f"r{i}", tokens(1000 * i, 8, 1))
        run_prefill(m, r)
        finish(m, r)
    freed = [e for e in sink.drain() if e.kind == EventKind.FREED]
    assert 0 < len(freed) < 160
    assert all(sink.is_sampled(e.block_hash) for e in freed)


def test_hook_errors_are_counted_not_raised(clock, monkeypatch):
    m = make_manager(10)
    h = install_wa_queue(m.block_pool, clock=clock)

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(h.tagger, "on_lookup", boom)
    r = make_request("r", tokens(0, 2, 1))
    run_prefill(m, r)
    finish(m, r, RequestStatus.FINISHED_ABORTED)
    assert h.hook_errors == 1
    assert m.block_pool.get_num_free_blocks() == 9


def test_unpatched_manager_unaffected_by_installed_hooks(clock):
    patched = make_manager(10)
    install_wa_queue(patched.block_pool, clock=clock)
    plain = make_manager(10)
    r = make_request("r", tokens(0, 2, 1), tag="text_1")
    run_prefill(plain, r)
    finish(plain, r)
    assert type(plain.block_pool.free_block_queue) is FreeKVCacheBlockQueue
    assert get_wa_handle(plain.block_pool) is None


def test_request_that_does_not_fit_is_reported_finished(clock):
    m = make_manager(6)
    sink = EventSink(capacity=1000)
    install_wa_queue(m.block_pool, clock=clock, sink=sink)
    big = make_request("big", tokens(0, 8, 1))
    blocks, n_hit, _ = m.get_computed_blocks(big)
    assert m.allocate_slots(big, big.num_tokens - n_hit, n_hit, blocks) is None
    m.free(big)  # what the scheduler does when a waiting request is aborted
    kinds = [(e.kind, getattr(e, "request_id", None)) for e in sink.drain()]
    assert kinds == [(EventKind.LOOKUP, "big"), (EventKind.FINISHED, "big")]


def _resume_tried(m, r) -> None:
    """The scheduler tries to resume a preempted request: a lookup, then no room."""
    r.num_computed_tokens = 0
    m.get_computed_blocks(r)


@pytest.mark.parametrize("relooked", [False, True])
def test_a_request_preempted_then_aborted_while_waiting_finishes_as_one_that_held_blocks(clock, relooked):
    """Preemption released the request's blocks, filed under its tag; an abort
    while it waits to resume frees nothing more, and vLLM's ``free`` finds no
    blocks. It still held blocks in the real cache, so its finish names what
    it was filed under (a finish naming nothing says it never fitted, and the
    controller would take back its real-cache check). With a resume tried
    first (looked up again, no room), it finished naming nothing."""
    m = make_manager(40)
    sink = EventSink(capacity=1000)
    install_wa_queue(m.block_pool, clock=clock, sink=sink)
    r = make_request("r", tokens(0, 4), tag="chat")
    run_prefill(m, r)
    assert block_ids_of(m, "r")
    clock.advance(1)
    finish(m, r, RequestStatus.PREEMPTED)
    if relooked:
        _resume_tried(m, r)
    clock.advance(1)
    finish(m, r, RequestStatus.FINISHED_ABORTED)
    finished = [e for e in sink.drain() if e.kind == EventKind.FINISHED]
    assert len(finished) == 1 and finished[0].request_id == "r"
    assert finished[0].request is not None and finished[0].request.tag == "chat"


@pytest.mark.parametrize("preempted", [False, True, "relooked"])
def test_an_aborted_turn_is_a_turn_of_its_conversation_whether_or_not_it_was_preempted_first(clock, preempted):
    """Turn 2 is aborted (while running, or while waiting after a preemption,
    a resume tried or not): its prompt was in the cache all the same, so turn
    3 follows it (turn 3, think time from the abort), not turn 1."""
    m = make_manager(60)
    h = install_wa_queue(m.block_pool, clock=clock, conversations=ConversationTracker())
    p1 = tokens(0, 3)
    r1 = make_request("r1", p1)
    run_prefill(m, r1)
    clock.advance(1)
    finish(m, r1)
    clock.advance(1)
    p2 = p1[: 3 * BS] + tokens(1000, 3)
    r2 = make_request("r2", p2)
    run_prefill(m, r2)
    clock.advance(1)
    if preempted:
        finish(m, r2, RequestStatus.PREEMPTED)
    if preempted == "relooked":
        _resume_tried(m, r2)
    clock.advance(1)
    finish(m, r2, RequestStatus.FINISHED_ABORTED)
    clock.advance(6)
    r3 = make_request("r3", p2[: 6 * BS] + tokens(2000, 3))
    run_prefill(m, r3)
    timing = h.tagger._looked_up["r3"].timing
    assert (timing.turn, timing.think_s) == (3, 6.0)
    assert h.hook_errors == 0


def _cached_system_prompt(clock, blocks: int = 3, **manager_kwargs) -> tuple[Any, Any, list[int]]:
    """A real manager with the WA queue and a tracker, a system prompt of
    ``blocks`` whole blocks cached by another user's finished request, and
    the clock 1 s on."""
    m = make_manager(80, **manager_kwargs)
    h = install_wa_queue(m.block_pool, clock=clock, conversations=ConversationTracker())
    system = tokens(0, blocks, 0)
    first = make_request("u0", system + tokens(500, 3))
    run_prefill(m, first)
    finish(m, first)
    clock.advance(1)
    return m, h, system


def test_a_shared_system_prompts_last_block_is_no_tip_of_a_request_that_found_it_cached(clock):
    """A first request adding one full block after a cached system prompt
    left the prompt's last block as its second tip: every later user's first
    request holds it, and read as turn 2 of that conversation, with its think
    time.  Only blocks a request computed itself are second tips, so a client
    that rewrote the end of its last block (turn 3 here) still continues."""
    m, h, system = _cached_system_prompt(clock)
    a = make_request("a", system + tokens(1000, 1))  # one full block of its own
    run_prefill(m, a)
    finish(m, a)
    clock.advance(5)
    other = make_request("c", system + tokens(2000, 3))
    run_prefill(m, other)
    look = h.tagger._looked_up["c"].timing
    assert (look.turn, look.think_s) == (1, None)
    finish(m, other)
    # a's own continuation holds its last full block: turn 2.
    b_prompt = system + tokens(1000, 1, 0) + tokens(3000, 2)
    b = make_request("b", b_prompt)
    run_prefill(m, b)
    assert h.tagger._looked_up["b"].timing.turn == 2
    finish(m, b)
    # b computed both of its last full blocks; turn 3 rewrote the end of the last one.
    clock.advance(2)
    c3 = make_request("b3", b_prompt[: 5 * BS] + tokens(4000, 2))
    run_prefill(m, c3)
    timing = h.tagger._looked_up["b3"].timing
    assert (timing.turn, timing.think_s) == (3, 2.0)
    assert h.hook_errors == 0


@pytest.mark.parametrize("eagle", [False, True])
def test_a_first_request_that_found_all_its_full_blocks_cached_leaves_no_tip(clock, eagle):
    """A first message shorter than the rest of the system prompt's last
    block: the prompt's full blocks are all the system prompt's, cached.  Its
    last full block was a tip, so every later user's first request read as
    turn 2 (then 3, 4, ...) of one conversation, with think times between
    strangers.  Now it leaves no tip: its own turn 2 reads as new, and its
    turn 3 continues turn 2.  With EAGLE vLLM drops the last matched block
    from the hit, which the tracker must not read as the request's own."""
    m, h, system = _cached_system_prompt(clock, use_eagle=eagle)
    a = make_request("a", system + tokens(1000, 0, 5))  # 5 tokens of its own: no full block
    run_prefill(m, a)
    a_start = h.tagger._looked_up["a"].timing.start
    finish(m, a)
    turns = []
    for i, user in enumerate(("b", "c")):
        clock.advance(5)
        other = make_request(user, system + tokens(2000 + 100 * i, 0, 7))
        run_prefill(m, other)
        turns.append(h.tagger._looked_up[user].timing.turn)
        finish(m, other)
    assert turns == [1, 1]
    assert a_start == 3  # nothing of its own
    a2_prompt = system + tokens(1000, 0, 5) + tokens(3000, 2)
    a2 = make_request("a2", a2_prompt)
    run_prefill(m, a2)
    assert h.tagger._looked_up["a2"].timing.turn == 1  # the link it cannot see
    finish(m, a2)
    clock.advance(3)
    a3 = make_request("a3", a2_prompt + tokens(4000, 1))
    run_prefill(m, a3)
    timing = h.tagger._looked_up["a3"].timing
    assert (timing.turn, timing.think_s) == (2, 3.0)
    assert h.hook_errors == 0


def test_a_first_prompt_of_whole_cached_blocks_leaves_no_tip(clock):
    """A prompt of whole blocks, all cached (a templated first message many
    users send): vLLM recomputes its last token, so its last block is no hit,
    though the cache holds it and it is no more this user's than the rest."""
    m, h, shared = _cached_system_prompt(clock, blocks=4)
    a = make_request("a", list(shared))
    run_prefill(m, a)
    finish(m, a)
    clock.advance(5)
    b = make_request("b", shared + tokens(2000, 0, 7))
    run_prefill(m, b)
    assert h.tagger._looked_up["b"].timing.turn == 1
    assert h.tagger.conversations.counters.continuations == 0


def test_a_later_turns_cached_last_block_is_its_conversations_own_and_stays_a_tip():
    """vLLM caches a reply's blocks, so a short follow-up can find all its
    full blocks cached; past the conversation's start they are its own."""
    t = ConversationTracker()
    first = ["s1", "s2", "a1"]
    timing = t.lookup(first, 2, 0.0)
    assert timing.start == 2
    t.finished(timing, t.tips_of(first, 2, own_from=timing.start), 3, 1.0)
    second = [*first, "r1"]  # the reply's block, cached at decode
    timing = t.lookup(second, 4, 2.0)
    assert timing.turn == 2
    t.finished(timing, t.tips_of(second, 4, own_from=timing.start), 4, 3.0)
    assert t.lookup([*second, "x"], 4, 5.0).turn == 3


def test_a_tip_is_censored_once_its_last_hash_leaves_the_index_and_never_when_continued():
    """A tip named by two hashes lost one to the index's capacity: it was
    counted as censored then, and as continued when the other hash was found."""
    t = ConversationTracker(capacity=2)
    t.finished(t.lookup(["a1", "a2"], 0, 0.0), ("a1", "a2"), 2, now=1.0)
    t.finished(t.lookup(["b1"], 0, 2.0), ("b1",), 1, now=3.0)  # pushes a1 out
    assert t.counters.censored == 0
    assert t.lookup(["a1", "a2", "a3"], 0, 4.0).turn == 2
    t.finished(t.lookup(["c1"], 0, 5.0), ("c1",), 1, now=6.0)  # pushes a2 out
    t.finished(t.lookup(["d1"], 0, 7.0), ("d1",), 1, now=8.0)  # pushes b1 out
    assert (t.counters.continuations, t.counters.censored) == (1, 1)  # b's tip only


def test_tips_are_full_blocks_and_a_second_tip_only_one_the_request_computed():
    tips_of = ConversationTracker.tips_of
    assert tips_of(["s1", "s2", "a1"], n_hit=2) == ("a1",)  # s2 was cached
    assert tips_of(["s1", "s2", "a1"], n_hit=1) == ("s2", "a1")
    # A trace lists a partial last block too: no continuation holds it.
    assert tips_of(["s1", "s2", "a1", "p"], n_hit=2, full_blocks=3) == ("a1",)
    assert tips_of(["a1", "p"], n_hit=0, full_blocks=1) == ("a1",)
    assert tips_of(["p"], n_hit=0, full_blocks=0) == ()
    assert tips_of([], n_hit=0) == ()
    # The last full block before the conversation's own part: shared, no tip.
    assert tips_of(["s1", "s2", "p"], n_hit=2, full_blocks=2, own_from=2) == ()
    assert tips_of(["s1", "s2", "a1"], n_hit=3, own_from=2) == ("a1",)


def test_the_earlier_tip_serves_one_continuation_so_a_system_prompt_computed_cold_misleads_once():
    """On a cold cache (or after an eviction) a first request computes the
    system prompt itself; with one full block of its own, its earlier tip is
    the system prompt's last block.  It read every later user's first request
    as its turn 2 for the tips' lifetime; now the first of them only (a
    client that rewrote its last block continues the same way, once)."""
    t = ConversationTracker()
    system = ["s1", "s2", "s3"]
    timing = t.lookup([*system, "u0"], 0, 0.0)
    t.finished(timing, t.tips_of([*system, "u0"], 0), 4, 1.0)
    turns = []
    for i in range(1, 4):
        hashes = [*system, f"u{i}"]
        timing = t.lookup(hashes, 3, 10.0 * i)
        turns.append(timing.turn)
        t.finished(timing, t.tips_of(hashes, 3), 4, 10.0 * i + 1)
    assert turns == [2, 1, 1]
    # The last block stays a tip for every continuation (branches, retries).
    assert [t.lookup([*system, "u0", f"v{k}"], 4, 50.0).turn for k in range(3)] == [2, 2, 2]


def test_a_tip_whose_hashes_a_later_tip_took_over_is_censored_unless_continued():
    """Two identical prompts in flight at once: the second finish takes the
    first one's hashes, and the first, never continued, is censored then."""
    t = ConversationTracker()
    a = t.lookup(["x1", "x2"], 0, 0.0)
    b = t.lookup(["x1", "x2"], 0, 0.5)
    t.finished(a, ("x2",), 2, 1.0)
    t.finished(b, ("x2",), 2, 2.0)
    assert t.counters.censored == 1
    assert t.lookup(["x1", "x2", "x3"], 2, 3.0).turn == 2
    t.expire(1e9)
    assert (t.counters.continuations, t.counters.censored) == (1, 1)


def test_a_conversation_tip_past_its_age_is_censored_at_a_lookup_after_a_quiet_stretch():
    """Tips expire after ``max_age_s``; with no finish in between (where they
    were expired before), a lookup 999 s later still linked to one."""
    t = ConversationTracker(max_age_s=100.0)
    t.finished(t.lookup(["a1", "a2", "a3"], 0, 0.0), ("a2", "a3"), 3, now=1.0)
    late = t.lookup(["a1", "a2", "a3", "a4"], 0, 1000.0)
    assert (late.turn, late.think_s) == (1, None)
    assert t.counters.censored == 1 and t.counters.continuations == 0
    soon = ConversationTracker(max_age_s=100.0)
    soon.finished(soon.lookup(["a1", "a2", "a3"], 0, 0.0), ("a2", "a3"), 3, now=1.0)
    assert soon.lookup(["a1", "a2", "a3", "a4"], 0, 50.0).turn == 2


@pytest.mark.parametrize("rate", [0.05, 0.5, 1.0])
def test_sink_samples_a_prompts_tail_as_it_samples_each_hash(rate: float) -> None:
    """The lookup's one-pass sampling and a release's sampling mask pick
    exactly the hashes ``is_sampled`` picks: trace ids (the numpy path),
    integers that do not hash to themselves, vLLM digests (bytes), mixed
    lists, from any start."""
    sink = EventSink(sample_rate=rate)
    rng = random.Random(7)
    ids = [rng.randrange(1 << 40) for _ in range(400)]
    big = ids[:200] + [(1 << 61) - 1 + rng.getrandbits(40) for _ in range(200)]
    negative = [-x for x in ids]
    digests = [rng.getrandbits(256).to_bytes(32, "little") + b"\x00" for _ in range(400)]
    mixed = [*ids[:100], True, None, "x", *digests[:100], *ids[100:200]]
    for hashes in (ids, big, negative, digests, mixed):
        for start in (0, 1, 250, 400):
            expected = [h for i, h in enumerate(hashes) if i >= start and sink.is_sampled(h)]
            assert sink.sampled_from(hashes, start) == expected
    # A release's mask comes in one pass for trace ids only (the rest: None,
    # and is_sampled one by one).
    mask = sink.sampled_ids(ids)
    assert (None if mask is None else mask.tolist()) == (None if rate == 1.0 else [sink.is_sampled(h) for h in ids])
    for hashes in (big, negative, digests, mixed, [*ids, None], []):
        assert sink.sampled_ids(hashes) is None
    picked = len(sink.sampled_from(ids, 0))
    assert picked == 400 if rate == 1.0 else 0 < picked < 400


@pytest.mark.parametrize("rate", [0.05, 0.5])
def test_sink_samples_renumbered_trace_ids_by_their_file_ids(rate: float) -> None:
    """A replay renumbers a trace's ids 0 .. n-1; a sink told the file's ids
    picks the blocks (one by one, in one pass, in a release's mask, in a
    nested sample) and keys the conversations that a sink on the file's ids
    picks, whatever the renumbering."""
    rng = random.Random(11)
    file_ids = sorted(rng.sample(range(1 << 50), 600))
    source = np.array(file_ids, dtype=np.int64)
    plain, renumbered = EventSink(sample_rate=rate), EventSink(sample_rate=rate, source_ids=source)
    dense = list(range(600))
    assert [renumbered.sample_value(i) for i in dense] == [plain.sample_value(h) for h in file_ids]
    assert [renumbered.is_sampled(i) for i in dense] == [plain.is_sampled(h) for h in file_ids]
    for start in (0, 7, 599):
        assert [file_ids[i] for i in renumbered.sampled_from(dense, start)] == plain.sampled_from(file_ids, start)
    assert renumbered.sampled_ids(dense).tolist() == plain.sampled_ids(file_ids).tolist()
    thr = int(rate / 2 * (1 << 64))
    assert [file_ids[i] for i in renumbered.subsample(dense, thr)] == plain.subsample(file_ids, thr)
    assert 0 < len(plain.subsample(file_ids, thr)) < len(plain.sampled_from(file_ids, 0)) < 600
    # Digests and other hashables are sampled as without the table.
    digests = [rng.getrandbits(256).to_bytes(32, "little") for _ in range(50)]
    assert renumbered.sampled_from(digests, 0) == plain.sampled_from(digests, 0)
    assert ConversationTracker(key_of=renumbered.sample_value).lookup(dense[3:9], 0, 0.0).conversation == (
        ConversationTracker(key_of=plain.sample_value).lookup(file_ids[3:9], 0, 0.0).conversation
    )
    with pytest.raises(ValueError, match="source_ids"):
        EventSink(source_ids=np.array([3, -1]))


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_a_salt_draws_another_sample_of_the_same_size_on_every_path(rate: float) -> None:
    """Salt 0 is the unsalted sample; another salt picks other hashes (trace
    ids, renumbered ids, digests), as many, the same way on the one-by-one,
    one-pass, mask and nested paths, and keys conversations by it."""
    rng = random.Random(5)
    ids = rng.sample(range(1 << 40), 4000)
    digests = [rng.getrandbits(256).to_bytes(32, "little") for _ in range(4000)]
    assert EventSink(sample_rate=rate, salt=0).sampled_from(ids, 0) == EventSink(sample_rate=rate).sampled_from(ids, 0)
    plain = EventSink(sample_rate=rate)
    picks = {}
    for salt in (1, 2, 12345):
        sink = EventSink(sample_rate=rate, salt=salt)
        for hashes in (ids, digests):
            picked = sink.sampled_from(hashes, 0)
            assert picked == [h for h in hashes if sink.is_sampled(h)]
            n = len(hashes)
            assert abs(len(picked) - rate * n) <= 4.5 * math.sqrt(n * rate * (1 - rate))  # binomial
            overlap = len(set(picked) & set(plain.sampled_from(hashes, 0))) / len(picked)
            assert overlap == pytest.approx(rate, abs=0.1)  # independent of the unsalted sample
            picks[salt, isinstance(hashes[0], bytes)] = set(picked)
        assert sink.sampled_ids(ids).tolist() == [sink.is_sampled(h) for h in ids]
        thr = int(rate / 2 * (1 << 64))
        assert set(sink.subsample(ids, thr)) < set(sink.sampled_from(ids, 0))  # still nested
        source = np.array(sorted(ids), dtype=np.int64)
        renumbered = EventSink(sample_rate=rate, source_ids=source, salt=salt)
        dense = list(range(len(source)))
        assert [int(source[i]) for i in renumbered.sampled_from(dense, 0)] == sink.sampled_from(source.tolist(), 0)
        assert ConversationTracker(key_of=renumbered.sample_value).lookup(dense[3:9], 0, 0.0).conversation == (
            ConversationTracker(key_of=sink.sample_value).lookup(source.tolist()[3:9], 0, 0.0).conversation
        )
    assert picks[1, False] != picks[2, False] and picks[1, True] != picks[12345, True]
    for bad in (-1, 1 << 64, 1.5, True):
        with pytest.raises(ValueError, match="salt"):
            EventSink(salt=bad)


def test_the_readme_snippet_runs():
    """The README's "Using the queue directly" block, run as written."""
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Using the queue directly", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    ns: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - the README's own snippet
    pool, handle = ns["pool"], ns["handle"]
    assert isinstance(pool.free_block_queue, WorkloadAwareFreeQueue) and handle.queue is pool.free_block_queue
    assert handle.queue.params is ns["new_params"]
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 63  # the null block is never free

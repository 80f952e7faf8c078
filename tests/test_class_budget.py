"""The class budget: tag counters count requests once; tags and eviction classes have
separate bounded registries that retire unused names; reserved names stay reserved."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from vllm_wa.controller.config import ControllerConfig
from vllm_wa.controller.controller import start_online
from vllm_wa.controller.features import FeatureKey
from vllm_wa.engine_patch import block_tagger
from vllm_wa.engine_patch.events import EventKind, EventSink
from vllm_wa.engine_patch.install import install_wa_queue
from vllm_wa.serving.engine_side import match_api_reports
from vllm_wa.workload_classes import ClassRegistry

from conftest import finish, make_hybrid_manager, make_manager, make_request, run_prefill

BS = 16


def tokens(start: int, n_blocks: int, tail: int = 1) -> list[int]:
    return list(range(start, start + n_blocks * BS + tail))


def serve(m, rid, start, tag, n_blocks=2, status=RequestStatus.FINISHED_STOPPED, lookups=1):
    r = make_request(rid, tokens(start, n_blocks), tag=tag)
    for _ in range(lookups - 1):
        m.get_computed_blocks(r)  # the scheduler looks a waiting request up again
    run_prefill(m, r)
    finish(m, r, status)
    return r


# ---- defect 4: each counter counts requests, once ------------------------------------------------


@pytest.mark.parametrize(
    "tag, counter",
    [(None, "missing"), ("bad tag", "invalid"), (17, "invalid"), ("other", "invalid"), ("default", "invalid")],
)
def test_tag_counters_count_each_request_once(tag, counter, clock):
    m = make_manager(40)
    h = install_wa_queue(m.block_pool, clock=clock)
    serve(m, "r1", 0, tag, lookups=3)
    serve(m, "r2", 1000, tag)
    assert getattr(h.tagger.tag_counters, counter) == 2


def test_over_cap_counts_each_request_once(clock):
    m = make_manager(60)
    reg = ClassRegistry(max_classes=5)  # default, invalid, other + 2
    h = install_wa_queue(m.block_pool, clock=clock, registry=reg)
    for i in range(4):
        serve(m, f"r{i}", 1000 * i, f"t{i}", lookups=2)
    assert h.tagger.tag_counters.over_cap == 2
    serve(m, "again", 9000, "t3")
    assert h.tagger.tag_counters.over_cap == 3


def test_a_release_over_the_class_cap_counts_once_whatever_its_kv_cache_groups(clock):
    """A hybrid model (full attention and a sliding window) files each release
    once per KV-cache group; ``releases_over_class_cap`` counts releases."""
    m = make_hybrid_manager(64)
    reg = ClassRegistry(max_classes=4)  # default, invalid, other + 1
    h = install_wa_queue(m.block_pool, clock=clock, registry=reg, class_key=FeatureKey(("tag", "outcome")))
    assert len(m.kv_cache_config.kv_cache_groups) == 2
    serve(m, "fits", 0, "t0", n_blocks=3)
    assert h.tagger.releases_over_class_cap == 0
    serve(m, "over", 5000, "t1", n_blocks=3)
    serve(m, "over again", 9000, "t2", n_blocks=3)
    assert h.tagger.releases_over_class_cap == 2
    assert h.hook_errors == 0
    h.queue.check_invariants()


def test_preempted_request_is_counted_once(clock):
    """A preempted request resumes as itself: its tag, hit accounting, reuse
    counts and lookup event are counted once, though it hits its own blocks."""
    m = make_manager(40)
    sink = EventSink()
    h = install_wa_queue(m.block_pool, clock=clock, sink=sink)
    r = make_request("p", tokens(0, 2), tag="bad tag")
    run_prefill(m, r)
    m.free(r)  # preempted: released without finishing
    r.num_computed_tokens = 0
    clock.advance(1.0)
    assert run_prefill(m, r) == 2 * BS  # its own two full blocks, still cached
    finish(m, r)
    tagger = h.tagger
    assert tagger.tag_counters.invalid == 1
    events = sink.drain()
    lookups = [e for e in events if e.kind == EventKind.LOOKUP]
    assert [(e.request_id, e.time) for e in lookups] == [("p", 0.0)]
    # One FINISHED, at the real release, with the real outcome (the miniature caches
    # hold the request until then).
    assert [(e.request_id, e.time, e.request.outcome) for e in events if e.kind == EventKind.FINISHED] == [
        ("p", 1.0, "stop")
    ]
    # A late outcome reaches the request once, not its preempted release as another.
    tagger.reclassify("p", "tool")
    assert tagger.reclassified_requests == 1
    tid = tagger.tags.find("invalid")
    assert (tagger.hit_blocks_by_tag[tid], tagger.queried_tokens_by_tag[tid]) == (0, r.num_tokens)
    assert max(tagger.reuse_count) == 0 and sum(h.queue.counters.reused) == 0


# ---- defect 5: the budget ----------------------------------------------------------------------


def test_lookup_interns_nothing_and_tags_do_not_take_class_slots(clock):
    m = make_manager(40)
    h = install_wa_queue(m.block_pool, clock=clock, class_key=FeatureKey(("tag", "outcome")))
    r = make_request("r", tokens(0, 2), tag="text_1")
    m.get_computed_blocks(r)
    assert h.registry.used_names() == []  # a lookup alone claims no eviction class
    run_prefill(m, r)
    finish(m, r)
    assert h.registry.used_names() == ["text_1.o:stop"]
    assert h.tagger.tags.used_names() == ["text_1"]


def test_reserved_names_cannot_be_claimed_by_clients(clock):
    m = make_manager(40)
    h = install_wa_queue(m.block_pool, clock=clock)
    for i, tag in enumerate(["default", "other", "invalid", "default.o:stop"]):
        serve(m, f"r{i}", 1000 * i, tag)
    assert set(h.queue.free_blocks_by_class()) == {"invalid"}
    assert h.tagger.tag_counters.invalid == 4


def bailian_mix(m, controller_tagger):
    """types text/search/image/file x turns 1-4, each with replies of both outcomes."""
    i = 0
    for typ in ("text", "search", "image", "file"):
        for turn in range(1, 5):
            for outcome in ("stop", "tool"):
                rid = f"chatcmpl-{i}"
                r = make_request(rid, tokens(10_000 * i, 1), tag=f"{typ}_{turn}")
                run_prefill(m, r)
                if outcome == "tool":
                    controller_tagger.reclassify(rid, "tool")  # reported before the engine frees it
                finish(m, r)
                i += 1


def test_bailian_mix_fits_under_the_default_cap_with_the_default_key():
    m = make_manager(200)
    handles = []

    def install(sink, registry, key, conversations):
        h = install_wa_queue(m.block_pool, None, sink=sink, registry=registry, class_key=key, conversations=conversations)
        handles.append(h)
        return h.queue, h.tagger

    cfg = ControllerConfig(initial="tag+outcome/hyper/posterior/L10")  # the default candidates' key
    start_online(cfg, 200, install)
    h = handles[0]
    bailian_mix(m, h.tagger)
    classes = h.queue.free_blocks_by_class()
    assert len(classes) == 32, classes
    assert all(name.split(".")[0] not in ("other", "invalid") for name in classes)
    assert h.tagger.tag_counters.over_cap == 0 and h.tagger.releases_over_class_cap == 0
    assert len(h.tagger.tags.used_names()) == 16


def test_unused_classes_and_tags_are_retired_and_their_blocks_refiled(clock):
    m = make_manager(80)
    reg = ClassRegistry(max_classes=8, retire_after_s=100.0)  # 5 slots past the reserved names
    h = install_wa_queue(m.block_pool, clock=clock, registry=reg)
    for i in range(8):  # a burst of junk tags fills both registries
        serve(m, f"junk{i}", 1000 * i, f"junk_{i}")
        clock.advance(1.0)
    assert h.tagger.tag_counters.over_cap == 3
    assert "other" in h.queue.free_blocks_by_class()
    free_before = h.queue.num_free_blocks
    clock.advance(150.0)
    serve(m, "real", 50_000, "real_1")  # retires the idle names first, then gets a slot
    assert h.tagger.tags.find("real_1") is not None
    by_class = h.queue.free_blocks_by_class()
    # The retired classes' blocks are now scored by the default; the overflow class stays.
    assert by_class == {"default": 5 * 2, "other": 3 * 2, "real_1": 2}
    assert h.queue.num_free_blocks == free_before
    h.queue.check_invariants()
    assert sorted(h.registry.used_names()) == ["default", "other", "real_1"]
    assert sorted(h.tagger.tags.used_names()) == ["other", "real_1"]
    # The eviction order still works over the merged lists.
    big = make_request("big", tokens(90_000, 60), tag="real_1")
    run_prefill(m, big)
    h.queue.check_invariants()


def test_lookups_without_a_release_are_bounded(clock, monkeypatch):
    """A request whose release never reaches the tagger (a failed hook) cannot pile up:
    past the live-request cap the oldest lookup goes."""
    monkeypatch.setattr(block_tagger, "MAX_LIVE_REQUESTS", 3)
    m = make_manager(40)
    h = install_wa_queue(m.block_pool, clock=clock)
    for i in range(5):
        clock.advance(1.0)
        m.get_computed_blocks(make_request(f"w{i}", tokens(100 * i, 1), tag="t"))
    assert [h.tagger.started_at(f"w{i}") for i in range(5)] == [None, None, 3.0, 4.0, 5.0]


def test_a_preempted_request_aborted_while_waiting_is_finished_for_consumers(clock):
    m = make_manager(40)
    sink = EventSink()
    h = install_wa_queue(m.block_pool, clock=clock, sink=sink)
    r = make_request("p", tokens(0, 2), tag="t")
    run_prefill(m, r)
    m.free(r)  # preempted
    r.status = RequestStatus.FINISHED_ABORTED
    m.free(r)  # aborted while waiting: holds nothing
    requests = (EventKind.LOOKUP, EventKind.FINISHED)
    assert [(e.kind, e.request_id) for e in sink.drain() if e.kind in requests] == [
        (EventKind.LOOKUP, "p"), (EventKind.FINISHED, "p")
    ]
    m.get_computed_blocks(make_request("p", tokens(0, 2), tag="t"))  # the id comes back: a new request
    assert [e.kind for e in sink.drain() if e.kind in requests] == [EventKind.LOOKUP]
    assert h.tagger.started_at("p") == 0.0


def test_after_a_key_change_a_full_registry_gives_the_earlier_keys_classes_back(clock):
    """A switch to another class key: the earlier key's classes hold every slot
    (for the retire time, here for ever), so the new key's releases would all
    go to ``other`` and the queue would run as LRU. The first release that
    finds the registry full retires the classes unused since the change."""
    m = make_manager(80)
    reg = ClassRegistry(max_classes=6)  # 3 slots past the reserved names; nothing retires by time
    h = install_wa_queue(m.block_pool, clock=clock, registry=reg)
    for i, tag in enumerate(("a_1", "b_1", "c_1")):
        serve(m, f"r{i}", 1000 * i, tag)
        clock.advance(1.0)
    assert sorted(h.registry.used_names()) == ["a_1", "b_1", "c_1"]
    h.tagger.set_class_key(FeatureKey(("tag", "outcome")))
    h.tagger.set_class_key(FeatureKey(("tag", "outcome")))  # the same key again is no change
    clock.advance(1.0)
    serve(m, "after", 5000, "a_1")
    by_class = h.queue.free_blocks_by_class()
    assert by_class == {"default": 3 * 2, "a_1.o:stop": 2}
    assert h.tagger.releases_over_class_cap == 0
    h.queue.check_invariants()
    # Without a key change, a full registry still sends new classes to ``other``.
    for i, tag in enumerate(("b_1", "c_1", "a_2")):
        serve(m, f"s{i}", 10_000 + 1000 * i, tag)
    assert h.tagger.releases_over_class_cap == 1
    assert h.queue.free_blocks_by_class()["other"] == 2


def test_a_late_outcome_after_a_key_change_refiles_into_its_class_not_other(clock):
    """A reported outcome refiles a released request's blocks under the
    current key; when the earlier key's classes hold every slot, the refile
    gives them back as a release does. A registry full without a key change
    sends the refile to ``other`` and counts that request once."""
    m = make_manager(80)
    reg = ClassRegistry(max_classes=6)  # 3 slots past the reserved names; nothing retires by time
    h = install_wa_queue(m.block_pool, clock=clock, registry=reg)
    h.tagger.set_class_key(FeatureKey(("tag", "outcome")))
    serve(m, "late", 0, "a_1")  # its class a_1.o:stop, before the switch
    clock.advance(1.0)
    h.tagger.set_class_key(FeatureKey(("tag",)))
    clock.advance(1.0)
    for i, tag in enumerate(("b_1", "c_1")):
        serve(m, f"r{i}", 1000 * (i + 1), tag)
    # Registry: a_1.o:stop (the earlier key's), b_1, c_1: full.
    assert sorted(h.registry.used_names()) == ["a_1.o:stop", "b_1", "c_1"]
    clock.advance(1.0)
    h.tagger.set_class_key(FeatureKey(("tag", "outcome")))
    clock.advance(1.0)
    assert h.tagger.reclassify("late", "tool") == 2
    by_class = h.queue.free_blocks_by_class()
    assert by_class.get("a_1.o:tool") == 2 and "other" not in by_class
    assert h.tagger.refiles_over_class_cap == 0 and h.tagger.releases_over_class_cap == 0
    h.queue.check_invariants()
    # No key change since: the refile's new class finds the registry full and goes to other, counted once.
    serve(m, "late2", 10_000, "b_1")
    serve(m, "s0", 11_000, "c_1")
    assert sorted(h.registry.used_names()) == ["a_1.o:tool", "b_1.o:stop", "c_1.o:stop", "default"]
    assert h.tagger.reclassify("late2", "tool") == 2
    assert h.tagger.refiles_over_class_cap == 1 and h.tagger.releases_over_class_cap == 0
    assert h.queue.free_blocks_by_class()["other"] == 2
    h.queue.check_invariants()


def test_one_late_outcome_over_the_class_cap_counts_once_for_all_children_of_an_n_request(clock):
    """The children of an ``n > 1`` request (engine ids ``0_x``, ``1_x``) move
    together on one report; ``refiles_over_class_cap`` counts that report once."""
    m = make_manager(80)
    reg = ClassRegistry(max_classes=5)  # default, invalid, other + 2
    h = install_wa_queue(m.block_pool, clock=clock, registry=reg, class_key=FeatureKey(("tag", "outcome")))
    match_api_reports(h.tagger)
    serve(m, "0_call-1a2b3c4d", 0, "a_1")
    serve(m, "1_call-1a2b3c4d", 1000, "a_1")  # the same class: a_1.o:stop
    serve(m, "filler", 2000, "b_1")  # the registry is full now
    assert h.tagger.releases_over_class_cap == 0
    assert h.tagger.reclassify("call", "tool") == 4  # both children's two blocks, to other
    assert h.queue.free_blocks_by_class()["other"] == 4
    assert h.tagger.refiles_over_class_cap == 1
    h.queue.check_invariants()

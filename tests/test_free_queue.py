"""The workload-aware queue against vLLM's queue and against a brute-force model."""

from __future__ import annotations

import bisect
import math
import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from vllm_wa.engine_patch import WorkloadAwareFreeQueue
from vllm_wa.kv_block import hash_of, set_hash
from vllm_wa.params import ReuseModel, WAParams, time_to_live
from vllm_wa.sim.clock import SettableClock
from vllm_wa.workload_classes import ClassRegistry


def ids(blocks):
    return [b.block_id for b in blocks]


def _registry(n_classes: int) -> tuple[ClassRegistry, list[int]]:
    reg = ClassRegistry()
    return reg, [reg.id_of(f"c{i}") for i in range(n_classes)]


class TwinQueues:
    """vLLM's queue and the WA queue over twin block lists, driven identically."""

    def __init__(self, n: int, params: WAParams | None, n_classes: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.clock = SettableClock()
        self.reg, self.cids = _registry(n_classes)
        self.vb = [KVCacheBlock(i) for i in range(n)]
        self.wb = [KVCacheBlock(i) for i in range(n)]
        self.vq = FreeKVCacheBlockQueue(self.vb)
        self.wq = WorkloadAwareFreeQueue(self.wb, params, clock=self.clock, registry=self.reg)
        self.held: list[int] = []
        self.next_hash = 0

    def step(self) -> None:
        rng, vq, wq = self.rng, self.vq, self.wq
        self.clock.advance(rng.choice([0.0, 0.5, 3.0]))
        op = rng.random()
        if op < 0.35 and vq.num_free_blocks:
            k = rng.randint(1, min(6, vq.num_free_blocks))
            got_v, got_w = vq.popleft_n(k), wq.popleft_n(k)
            assert ids(got_v) == ids(got_w)
            for b in got_v:
                self.held.append(b.block_id)
                # Evicted: the pool drops the old hash; most refill as cached blocks.
                for blocks in (self.vb, self.wb):
                    set_hash(blocks[b.block_id], None)
                if rng.random() < 0.8:
                    self.next_hash += 1
                    for blocks in (self.vb, self.wb):
                        set_hash(blocks[b.block_id], self.next_hash.to_bytes(8, "little"))
        elif op < 0.7 and self.held:
            k = rng.randint(1, len(self.held))
            chosen = rng.sample(self.held, k)
            for bid in chosen:
                self.held.remove(bid)
                self.wq.block_class[bid] = rng.choice(self.cids)
            hashed = [bid for bid in chosen if hash_of(self.vb[bid]) is not None]
            unhashed = [bid for bid in chosen if hash_of(self.vb[bid]) is None]
            # What BlockPool.free_blocks does: unhashed to the front, hashed to the back.
            vq.prepend_n([self.vb[i] for i in unhashed])
            wq.prepend_n([self.wb[i] for i in unhashed])
            vq.append_n([self.vb[i] for i in hashed])
            wq.append_n([self.wb[i] for i in hashed])
        elif op < 0.9:
            free_hashed = [b.block_id for b in vq.get_all_free_blocks() if hash_of(b) is not None]
            if free_hashed:
                bid = rng.choice(free_hashed)
                vq.remove(self.vb[bid])
                wq.remove(self.wb[bid])
                self.held.append(bid)
        else:
            assert ids(vq.get_all_free_blocks()) == ids(wq.get_all_free_blocks())
        assert vq.num_free_blocks == wq.num_free_blocks


@pytest.mark.parametrize("n_classes", [1, 3, 8])
@pytest.mark.parametrize("seed", range(6))
def test_uniform_params_order_exactly_like_lru(n_classes, seed):
    """With one class, or every class on the same model, WA is vLLM's LRU."""
    params = None if seed % 2 else WAParams(
        models={f"c{i}": ReuseModel.exponential(0.4, 0.2) for i in range(n_classes)},
        default=ReuseModel.exponential(0.4, 0.2),
        mode="posterior" if seed % 3 else "pr",
    )
    twins = TwinQueues(64, params, n_classes, seed)
    for _ in range(400):
        twins.step()
    twins.wq.check_invariants()
    assert ids(twins.vq.get_all_free_blocks()) == ids(twins.wq.get_all_free_blocks())


def test_single_class_with_wa_params_is_lru():
    """A single class: scores only depend on idle time, so order is FIFO."""
    params = WAParams(models={"c0": ReuseModel((0.3, 0.5), (1.0, 0.01))}, mode="posterior")
    twins = TwinQueues(48, params, 1, seed=11)
    for _ in range(300):
        twins.step()
    assert ids(twins.vq.get_all_free_blocks()) == ids(twins.wq.get_all_free_blocks())


# ---- brute-force reference model ------------------------------------------------------------

MODELS = [
    ReuseModel.exponential(0.9, 0.05),
    ReuseModel.exponential(0.2, 1.3),
    ReuseModel.exponential(0.55, 0.37),
    ReuseModel((0.3, 0.4), (2.0, 0.02)),
    ReuseModel.exponential(0.0, 0.5),
]


class ReferenceQueue:
    """Evicts the free block with the lowest (score, insertion seq), by brute force."""

    def __init__(self, n: int, params: WAParams, reg: ClassRegistry) -> None:
        self.params, self.reg = params, reg
        self.nohash: list[int] = list(range(n))
        self.hashed: dict[int, tuple[int, float, int]] = {}  # bid -> (cls, free time, seq)
        self.seq = 0

    def append(self, bids: list[int], classes: list[int], now: float) -> None:
        for bid, c in zip(bids, classes):
            self.seq += 1
            self.hashed[bid] = (c, now, self.seq)

    def prepend(self, bids: list[int]) -> None:
        self.nohash[:0] = bids

    def remove(self, bid: int) -> None:
        self.hashed.pop(bid)

    def pop(self, k: int, now: float) -> list[int]:
        out = []
        for _ in range(k):
            if self.nohash:
                out.append(self.nohash.pop(0))
                continue

            def key(bid):
                c, t, seq = self.hashed[bid]
                return (self.params.scorer_for(self.reg.name_of(c)).log_score(now - t), seq)

            best = min(self.hashed, key=key)
            del self.hashed[best]
            out.append(best)
        return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    n_classes=st.integers(1, 5),
    mode=st.sampled_from(["pr", "posterior", "ttl"]),
    horizon=st.sampled_from([1.0, 5.0, 60.0]),
)
def test_matches_brute_force_model(data, n_classes, mode, horizon):
    reg, cids = _registry(n_classes)
    models = {f"c{i}": data.draw(st.sampled_from(MODELS)) for i in range(n_classes)}
    params = WAParams(models=models, horizon=horizon, mode=mode)
    n = 24
    clock = SettableClock()
    blocks = [KVCacheBlock(i) for i in range(n)]
    # Exact scoring at every eviction: no stale selection.
    q = WorkloadAwareFreeQueue(blocks, params, clock=clock, registry=reg, score_staleness=0.0)
    ref = ReferenceQueue(n, params, reg)
    held: list[int] = []
    h = 0
    for _ in range(data.draw(st.integers(5, 60))):
        clock.advance(data.draw(st.sampled_from([0.0, 1.0, 2.0, 7.0, 30.0])))
        op = data.draw(st.sampled_from(["pop", "free", "free", "hit"]))
        if op == "pop" and q.num_free_blocks:
            k = data.draw(st.integers(1, min(5, q.num_free_blocks)))
            got = ids(q.popleft_n(k))
            assert got == ref.pop(k, clock.t)
            for bid in got:
                h += 1
                set_hash(blocks[bid], h)
            held.extend(got)
        elif op == "free" and held:
            chosen = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=6, unique=True))
            classes = [data.draw(st.sampled_from(cids)) for _ in chosen]
            for bid, c in zip(chosen, classes):
                held.remove(bid)
                q.block_class[bid] = c
            q.append_n([blocks[b] for b in chosen])
            ref.append(chosen, classes, clock.t)
        elif op == "hit" and ref.hashed:
            bid = data.draw(st.sampled_from(sorted(ref.hashed)))
            q.remove(blocks[bid])
            ref.remove(bid)
            held.append(bid)
        q.check_invariants()
    # The full remaining order agrees too.
    expect = ref.pop(len(ref.nohash) + len(ref.hashed), clock.t)
    assert ids(q.get_all_free_blocks()) == expect


def test_older_block_of_a_class_never_outranks_newer():
    reg, (a, b) = _registry(2)
    params = WAParams(
        models={"c0": ReuseModel((0.5, 0.3), (1.0, 0.001)), "c1": ReuseModel.exponential(0.9, 0.1)},
        mode="posterior",
    )
    clock = SettableClock()
    blocks = [KVCacheBlock(i) for i in range(40)]
    q = WorkloadAwareFreeQueue(blocks, params, clock=clock, registry=reg)
    got = q.popleft_n(40)
    for i, blk in enumerate(got):
        set_hash(blk, i)
        q.block_class[blk.block_id] = a if i % 2 else b
        clock.advance(1.0)
        q.append_n([blk])
    clock.advance(10.0)
    order = q.get_all_free_blocks()
    for cls in (a, b):
        stamps = [q.stamp[x.block_id] for x in order if q.block_class[x.block_id] == cls]
        assert stamps == sorted(stamps)


def test_class_with_faster_reuse_is_kept_when_idle_is_short():
    """The PR's score: what matters is the chance of reuse within the horizon."""
    reg, (fast, slow) = _registry(2)
    params = WAParams(
        models={"c0": ReuseModel.exponential(0.9, 1.0 / 5), "c1": ReuseModel.exponential(0.9, 1.0 / 600)},
        horizon=5.0,
    )
    clock = SettableClock(100.0)
    blocks = [KVCacheBlock(i) for i in range(8)]
    q = WorkloadAwareFreeQueue(blocks, params, clock=clock, registry=reg)
    got = q.popleft_n(8)
    for i, blk in enumerate(got):
        set_hash(blk, i)
        q.block_class[blk.block_id] = fast if i < 4 else slow
    q.append_n(got[4:])  # slow class freed first (older)
    clock.advance(1.0)
    q.append_n(got[:4])
    clock.advance(1.0)
    # Within the next 5 s a 1-second-idle fast block is reused with
    # probability ~0.47, a slow block with ~0.007: the slow class goes first.
    filed = {b.block_id: q.block_class[b.block_id] for b in got}
    assert [filed[b.block_id] for b in q.popleft_n(2)] == [slow] * 2
    clock.advance(60.0)
    # After a minute idle, the fast class's blocks are stale: their score has
    # decayed below the slow class's, so they go before the slow class's last two.
    assert [q.block_class[b.block_id] for b in q.get_all_free_blocks()] == [fast] * 4 + [slow] * 2
    assert [filed[b.block_id] for b in q.popleft_n(6)] == [fast] * 4 + [slow] * 2


def test_set_params_from_another_thread_keeps_queue_consistent():
    reg, cids = _registry(4)
    variants = [
        WAParams(models={f"c{i}": MODELS[(i + k) % 4] for i in range(4)}, mode=m, version=k)
        for k, m in enumerate(["pr", "posterior", "pr", "posterior"])
    ] + [WAParams.lru()]
    clock = SettableClock()
    blocks = [KVCacheBlock(i) for i in range(256)]
    q = WorkloadAwareFreeQueue(blocks, variants[0], clock=clock, registry=reg)
    stop = threading.Event()
    swaps = [0]

    def swapper():
        i = 0
        while not stop.is_set():
            q.set_params(variants[i % len(variants)])
            swaps[0] += 1
            i += 1

    t = threading.Thread(target=swapper)
    t.start()
    rng = random.Random(3)
    held: list[KVCacheBlock] = []
    try:
        for step in range(4000):
            clock.advance(0.1)
            if held and (rng.random() < 0.5 or not q.num_free_blocks):
                k = rng.randint(1, len(held))
                batch, held = held[:k], held[k:]
                for b in batch:
                    q.block_class[b.block_id] = rng.choice(cids)
                q.append_n(batch)
            else:
                got = q.popleft_n(min(q.num_free_blocks, rng.randint(1, 8)))
                for b in got:
                    set_hash(b, step * 1000 + b.block_id)
                held.extend(got)
    finally:
        stop.set()
        t.join()
    assert swaps[0] > 10
    q.check_invariants()
    assert q.num_free_blocks + len(held) == 256


def _hashed_two_class_queue(n, params=None, block=KVCacheBlock):
    """A queue over ``n`` blocks, all taken and given hashes 0..n-1; two classes."""
    reg, (a, b) = _registry(2)
    clock = SettableClock()
    q = WorkloadAwareFreeQueue([block(i) for i in range(n)], params, clock=clock, registry=reg)
    got = q.popleft_n(n)
    for i, blk in enumerate(got):
        set_hash(blk, i)
    return q, clock, got, a, b


def test_refile_moves_blocks_and_keeps_stamp_order():
    q, clock, got, a, b = _hashed_two_class_queue(10)
    for i, blk in enumerate(got):
        q.block_class[blk.block_id] = a if i < 5 else b
        clock.advance(1.0)
        q.append_n([blk])
    # blocks 0,1 (class a, oldest) move into class b, between nothing older.
    moved = q.refile([got[0], got[2]], b)
    assert moved == 2
    q.check_invariants()
    order_b = [x.block_id for x in q.get_all_free_blocks() if q.block_class[x.block_id] == b]
    assert order_b == [got[0].block_id, got[2].block_id] + [x.block_id for x in got[5:]]
    # Uniform params: global order is still by free time.
    assert ids(q.get_all_free_blocks()) == ids(got)
    assert q.counters.reclassified == 2


_PREV = KVCacheBlock.prev_free_block  # the slot's own descriptor


class _StepCountingBlock(KVCacheBlock):
    """A block that counts reads of its ``prev_free_block`` link."""

    __slots__ = ()
    reads = 0

    @property
    def prev_free_block(self):
        _StepCountingBlock.reads += 1
        return _PREV.__get__(self)

    @prev_free_block.setter
    def prev_free_block(self, v):
        _PREV.__set__(self, v)


class _StampReads(list):
    """The queue's stamp array, counting reads."""

    reads = 0

    def __getitem__(self, i):
        _StampReads.reads += 1
        return list.__getitem__(self, i)


def _late_report_steps(n_before: int, stamp_mode: str) -> tuple[int, list[int]]:
    """Refile a 50-block request's blocks from a class with ``n_before`` older
    free blocks into one holding 60 blocks freed after it; the list steps the
    refile takes, and the target class's order after it."""
    q, clock, got, a, b = _hashed_two_class_queue(n_before + 150, WAParams(stamp=stamp_mode), _StepCountingBlock)

    def release(run, cls):
        clock.advance(1.0)
        for blk in run:
            q.block_class[blk.block_id] = cls
            q.lookup_time[blk.block_id] = clock.t
        q.append_n(run)

    old, mine, later, older_b = got[:n_before], got[n_before : n_before + 50], got[n_before + 50 : -40], got[-40:]
    release(older_b, b)
    for i in range(0, len(old), 100):
        release(old[i : i + 100], a)
    release(mine[::-1], a)  # vLLM frees a request tail first
    for i in range(0, len(later), 10):
        release(later[i : i + 10], b)
    q.stamp = _StampReads(q.stamp)
    _StepCountingBlock.reads = _StampReads.reads = 0
    assert q.refile(mine[::-1], b) == 50  # in release order, as the tagger gives them
    steps = _StepCountingBlock.reads + _StampReads.reads
    q.check_invariants()
    order_b = [x.block_id for x in q.get_all_free_blocks() if q.block_class[x.block_id] == b]
    return steps, order_b


@pytest.mark.parametrize("stamp_mode", ["free", "lookup"])
def test_a_late_report_refiles_in_steps_of_the_blocks_moved_and_freed_since_not_of_the_list(stamp_mode):
    # A tool-call report reaches the engine after the request freed its
    # blocks; the refile ran on the engine thread, and walked each block back
    # to its list's head and scanned the target list from its tail for each
    # block: 138 ms for 100 blocks behind 100,000 free ones.
    small, order_small = _late_report_steps(500, stamp_mode)
    large, order_large = _late_report_steps(5000, stamp_mode)
    assert small == large  # nothing walks the 500 or 5,000 older blocks
    assert large <= 4 * (50 + 60)  # blocks moved plus blocks freed into the target since
    # The request's blocks sit after the target's older blocks and before its later ones, in their free order.
    for n_before, order in ((500, order_small), (5000, order_large)):
        assert order == (
            list(range(n_before + 110, n_before + 150))
            + list(range(n_before + 49, n_before - 1, -1))
            + list(range(n_before + 50, n_before + 110))
        )


def test_a_cached_block_in_the_evict_first_list_is_never_refiled_and_refiled_once_it_leaves():
    q, clock, got, a, b = _hashed_two_class_queue(6)
    for blk in got:
        q.block_class[blk.block_id] = a
    q.prepend_n(got[:2])  # vLLM prepends cached blocks only with caching off
    clock.advance(1.0)
    q.append_n(got[2:])
    assert q.refile(got[:2], b) == 0  # they stay first to go
    assert ids(q.get_all_free_blocks()[:2]) == ids(got[:2])
    q.check_invariants()
    q.remove(got[0])
    assert q.popleft_n(1) == [got[1]]
    for blk in got[:2]:  # back, freed into class a like any cached block
        q.block_class[blk.block_id] = a
    clock.advance(1.0)
    q.append_n(got[:2])
    assert q.refile(got[:2], b) == 2
    q.check_invariants()


def _lookup_stamped_queue(n: int) -> tuple[WorkloadAwareFreeQueue, SettableClock, list[KVCacheBlock]]:
    clock = SettableClock()
    blocks = [KVCacheBlock(i) for i in range(n)]
    q = WorkloadAwareFreeQueue(blocks, WAParams(stamp="lookup"), clock=clock)
    got = q.popleft_n(n)
    for i, blk in enumerate(got):
        set_hash(blk, i)
    return q, clock, got


def test_lookup_stamps_order_releases_by_when_their_requests_started():
    q, clock, got = _lookup_stamped_queue(6)
    clock.t = 100.0
    # Released in this order, by requests that started at 5, 1, 3 (two blocks each).
    for start, pair in zip((5.0, 1.0, 3.0), (got[0:2], got[2:4], got[4:6])):
        for b in pair:
            q.lookup_time[b.block_id] = start
        q.append_n(pair)
        clock.advance(1.0)
    q.check_invariants()
    assert ids(q.get_all_free_blocks()) == ids(got[2:4] + got[4:6] + got[0:2])
    assert [q.stamp[b.block_id] for b in q.get_all_free_blocks()] == [1.0, 1.0, 3.0, 3.0, 5.0, 5.0]
    # Back to release stamps: the next release goes last, stamped now.
    q.set_params(WAParams())
    late = q.popleft_n(2)
    q.append_n(late)
    q.check_invariants()
    assert ids(q.get_all_free_blocks())[-2:] == ids(late)


def test_lookup_stamped_release_goes_where_its_stamp_sorts_past_any_number_of_later_ones():
    # 5,000 blocks released by requests that started later than the last one:
    # it goes before all of them, with its own stamp (no scan limit).
    q, clock, got = _lookup_stamped_queue(5001)
    clock.t = 10_000.0
    for i, b in enumerate(got[:5000]):
        q.lookup_time[b.block_id] = float(i + 1)
        q.append_n([b])
    q.lookup_time[got[5000].block_id] = 0.5
    q.append_n([got[5000]])
    q.check_invariants()
    order = q.get_all_free_blocks()
    assert order[0] is got[5000] and ids(order[1:]) == ids(got[:5000])
    assert q.stamp[got[5000].block_id] == 0.5


def _class_lists(q: WorkloadAwareFreeQueue, cids: list[int]) -> dict[int, list[int]]:
    out = {}
    for c in cids:
        b, tail, got = q._heads[c].next_free_block, q._tails[c], []
        while b is not tail:
            got.append(b.block_id)
            b = b.next_free_block
        out[c] = got
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lookup_stamped_lists_match_a_sorted_model_through_hits_evictions_refiles_and_swaps(seed):
    """Every class list is its blocks sorted by (stamp, arrival), whatever happened in between."""
    rng = random.Random(seed)
    reg, cids = _registry(3)
    clock = SettableClock()
    n = 120
    blocks = [KVCacheBlock(i) for i in range(n)]
    lookup, free = WAParams(stamp="lookup"), WAParams()
    q = WorkloadAwareFreeQueue(blocks, lookup, clock=clock, registry=reg)
    held = q.popleft_n(n)
    for b in held:
        set_hash(b, b.block_id)
    model: dict[int, list[tuple[float, int, int]]] = {c: [] for c in cids}
    seq = 0

    def add(bs):
        nonlocal seq
        for b in bs:
            seq += 1
            model[q.block_class[b.block_id]].append((q.stamp[b.block_id], seq, b.block_id))

    def drop(bids):
        gone = set(bids)
        for c in cids:
            model[c] = [e for e in model[c] if e[2] not in gone]

    for _ in range(600):
        clock.advance(rng.uniform(0.0, 2.0))
        op = rng.random()
        if op < 0.45 and held:  # a release: one request's blocks, tail first, one start time
            k = rng.randint(1, min(12, len(held)))
            run = [held.pop(rng.randrange(len(held))) for _ in range(k)]
            start = clock.t - rng.choice([0.0, rng.uniform(0.0, 40.0)])
            for b in run:
                q.block_class[b.block_id] = rng.choice(cids)
                q.lookup_time[b.block_id] = max(q.lookup_time[b.block_id], start)
            q.append_n(run)
            add(run)
        elif op < 0.65 and q.num_free_blocks:  # prefix hits on free blocks
            free_now = [b for b in blocks if b.next_free_block is not None]
            for b in rng.sample(free_now, rng.randint(1, min(5, len(free_now)))):
                q.remove(b)
                drop([b.block_id])
                held.append(b)
        elif op < 0.85 and q.num_free_blocks:  # evictions
            taken = q.popleft_n(rng.randint(1, min(8, q.num_free_blocks)))
            drop(ids(taken))
            held.extend(taken)
        elif op < 0.95 and q.num_free_blocks:  # a late outcome moves free blocks
            free_now = [b for b in blocks if b.next_free_block is not None]
            moving = rng.sample(free_now, rng.randint(1, min(4, len(free_now))))
            target = rng.choice(cids)
            for b in moving:  # refile keeps the stamp; the block goes after its equals
                if q.block_class[b.block_id] != target:
                    drop([b.block_id])
                    seq += 1
                    model[target].append((q.stamp[b.block_id], seq, b.block_id))
            q.refile(moving, target)
        else:  # the tuner swaps stamping
            q.set_params(free if q.stamp_at_lookup else lookup)
        q.check_invariants()
        expect = {c: [e[2] for e in sorted(model[c])] for c in cids}
        assert _class_lists(q, cids) == expect


def _offload_step(q: WorkloadAwareFreeQueue, cursor: KVCacheBlock | None, copied: set[int], target: int):
    """One step of vLLM's lazy CPU offload (``simple_kv_offload``'s
    ``_prepare_lazy_store_specs``): walk ``target`` free blocks from the cursor
    in eviction order, copy those not copied yet, keep the last one visited."""
    last = cursor
    for covered, b in enumerate(q.iter_blocks_after(cursor)):
        if covered >= target:
            break
        last = b
        copied.add(b.block_id)
    return last


def test_the_lazy_offload_walk_copies_every_block_before_it_is_evicted():
    """vLLM's lazy offload keeps a cursor between steps; in vLLM's queue a
    block freed later lands after it.  Here a block freed into a colder class
    after a walk goes first: the next walk must still copy it before it is
    evicted (a walk from the cursor never visited it)."""
    clock = SettableClock(100.0)
    reg = ClassRegistry()
    hot, cold = reg.claim("hot", 0.0), reg.claim("cold", 0.0)
    params = WAParams(models={"hot": ReuseModel.exponential(0.9, 0.5), "cold": ReuseModel.exponential(0.01, 0.5)})
    blocks = [KVCacheBlock(i) for i in range(8)]
    for b in blocks:
        set_hash(b, ("h", b.block_id))
    q = WorkloadAwareFreeQueue([], params, clock=clock, registry=reg, num_block_ids=8)
    for b in blocks[:4]:
        q.block_class[b.block_id] = hot
    q.append_n(blocks[:4])
    assert ids(q.iter_blocks_after(None)) == ids(q.iter_eviction_order())
    copied: set[int] = set()
    cursor = _offload_step(q, None, copied, target=2)
    assert copied == {0, 1}
    clock.advance(1.0)
    q.block_class[4] = cold
    q.append_n([blocks[4]])
    assert ids(q.iter_eviction_order())[0] == 4
    _offload_step(q, cursor, copied, target=2)
    evicted = q.popleft_n(2)
    assert {b.block_id for b in evicted} <= copied


def test_popleft_on_empty_raises():
    q = WorkloadAwareFreeQueue([KVCacheBlock(0)], None, clock=SettableClock())
    q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


def test_remove_of_non_free_block_raises():
    q = WorkloadAwareFreeQueue([KVCacheBlock(0), KVCacheBlock(1)], None, clock=SettableClock())
    b = q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(b)


def test_counters_track_free_and_evicted_per_class():
    reg, (a, b) = _registry(2)
    clock = SettableClock()
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = WorkloadAwareFreeQueue(blocks, None, clock=clock, registry=reg)
    got = q.popleft_n(6)
    for i, blk in enumerate(got):
        set_hash(blk, i)
        q.block_class[blk.block_id] = a if i < 4 else b
    q.append_n(got)
    assert q.counters.freed[a] == 4 and q.counters.freed[b] == 2
    q.popleft_n(5)
    assert q.counters.evicted[a] == 4 and q.counters.evicted[b] == 1
    assert math.isclose(sum(q.counters.evicted), 5)


def test_sorted_stamps_match_a_sorted_list_across_bucket_splits():
    from vllm_wa.engine_patch.free_queue import _SortedStamps

    rng = random.Random(3)
    ref: list[float] = []
    st = _SortedStamps()
    for step in range(20_000):
        op = rng.random()
        if op < 0.7:
            s = float(rng.randrange(100_000))
            if s not in ref:
                st.add(s)
                ref.insert(bisect.bisect_left(ref, s), s)
        elif op < 0.95 and ref:
            s = rng.choice(ref)
            st.remove(s)
            ref.remove(s)
        else:  # evictions take the oldest stamps, usually a few
            s = ref[min(len(ref) - 1, rng.randrange(8))] if ref else 0.0
            cut = bisect.bisect_left(ref, s)
            assert st.pop_below(s) == ref[:cut]
            del ref[:cut]
        probe = float(rng.randrange(-1, 100_001))
        i = bisect.bisect_right(ref, probe)
        assert st.next_above(probe) == (ref[i] if i < len(ref) else None)
        if step % 500 == 0:
            assert list(st) == ref
    assert list(st) == ref and len(ref) > 2_500  # buckets split many times
    assert list(_SortedStamps(ref)) == ref


def test_ttl_mode_evicts_by_stamp_plus_each_classes_time_to_live():
    """Score mode "ttl" is Continuum's rule per class: blocks leave in order of
    their stamp plus their class's TTL, ``argmax F(tau) - tau / L``."""
    reg, (fast, slow) = _registry(2)
    fast_m, slow_m = ReuseModel.exponential(0.9, 0.1), ReuseModel.exponential(0.05, 0.01)
    params = WAParams(models={"c0": fast_m, "c1": slow_m}, default=slow_m, horizon=240.0, mode="ttl")
    clock = SettableClock()
    q = WorkloadAwareFreeQueue([KVCacheBlock(i) for i in range(30)], params, clock=clock, registry=reg)
    got = q.popleft_n(30)
    for i, blk in enumerate(got):
        set_hash(blk, i)
    # Break-even 240 s: the fast class keeps its blocks ln(0.9 * 0.1 * 240) / 0.1
    # = 30.7 s longer, the slow one (0.05 * 0.01 * 240 < 1) not at all.
    assert time_to_live(fast_m, 240.0) == pytest.approx(30.7, abs=0.05)
    assert time_to_live(slow_m, 240.0) == 0.0
    for cls, run in ((slow, got[:10]), (fast, got[10:20]), (slow, got[20:])):  # t = 0 .. 29
        for blk in run:
            q.block_class[blk.block_id] = cls
            q.append_n([blk])
            clock.advance(1.0)
    # LRU would take the fast blocks (freed at 10 .. 19) before the slow ones
    # freed at 20 .. 29; stamp + TTL puts them after (40.7 .. 49.7).
    expect = ids(got[:10]) + ids(got[20:]) + ids(got[10:20])
    assert ids(q.get_all_free_blocks()) == expect
    assert ids(q.popleft_n(15)) == expect[:15]
    clock.advance(60.0)  # the order does not depend on when it is read
    assert ids(q.get_all_free_blocks()) == expect[15:]
    q.check_invariants()


def _evictions_with(params: WAParams, seed: int, n: int = 200, steps: int = 4000) -> list[int]:
    """Block ids a random run of releases (into five classes), prefix hits and
    evictions takes from the queue, in order."""
    rng = random.Random(seed)
    clock = SettableClock(0.0)
    blocks = [KVCacheBlock(i) for i in range(n)]
    reg, cids = _registry(5)
    q = WorkloadAwareFreeQueue(blocks, None, clock=clock, registry=reg)
    q.set_params(params)
    held = q.popleft_n(n)
    for b in held:
        set_hash(b, ("h", b.block_id))
    popped: list[int] = []
    t = 0.0
    for _ in range(steps):
        t += rng.expovariate(1.0)
        clock.t = t
        r = rng.random()
        if r < 0.5 and held:
            released = [held.pop(rng.randrange(len(held))) for _ in range(rng.randint(1, min(8, len(held))))]
            c = rng.choice(cids)
            for b in released:
                q.block_class[b.block_id] = c
            q.append_n(released)
        elif r < 0.7 and q.num_free_blocks:
            b = rng.choice(q.get_all_free_blocks())
            q.remove(b)
            held.append(b)
        elif q.num_free_blocks:
            out = q.popleft_n(rng.randint(1, min(8, q.num_free_blocks)))
            popped.extend(b.block_id for b in out)
            held.extend(out)
    return popped


@pytest.mark.parametrize("seed", range(3))
def test_classes_that_score_alike_evict_in_stamp_order_whatever_the_last_bits_of_their_logs(seed):
    """A memoryless model (the prior: exponential, p = 1) scores every idle time
    alike.  Classes left to it must then evict oldest first, exactly as LRU
    does, also when one unused class has a model of its own (the live queue
    carries the other candidates' classes), which makes the parameters
    non-uniform.  Compared to the last bit, the logs' rounding chose newer
    blocks first: 0.2 to 1.3 points of hit rate on the Mooncake trace."""
    prior = ReuseModel.exponential(1.0, 1 / 60)
    uniform = WAParams(default=prior, mode="posterior", horizon=10.0)
    one_unused_class = WAParams(models={"unused": ReuseModel.exponential(0.5, 0.1)}, default=prior,
                                mode="posterior", horizon=10.0)
    assert uniform.is_uniform and not one_unused_class.is_uniform
    lru = _evictions_with(uniform, seed)
    assert len(lru) > 1000
    assert _evictions_with(one_unused_class, seed) == lru


def test_a_run_from_tied_heads_stops_where_its_blocks_score_above_them():
    """Two class heads tie; stamp order settles the tie.  The run taken from the
    chosen class must stop where its next block scores above the other head
    (a falling score: the younger block scores higher), not go on to the other
    head's stamp: eviction is still in (score, stamp) order."""
    clock = SettableClock(0.0)
    reg = ClassRegistry()
    params = WAParams(models={"A": ReuseModel.exponential(1.0, 1.0), "B": ReuseModel.exponential(0.5, 1.0)}, mode="pr")
    blocks = [KVCacheBlock(i) for i in range(4)]
    for b in blocks:
        set_hash(b, ("h", b.block_id))
    q = WorkloadAwareFreeQueue([], params, clock=clock, registry=reg, num_block_ids=4)
    a, b_ = reg.claim("A", 0.0), reg.claim("B", 0.0)
    # B's scores are A's shifted by log 0.5: B's head, freed ln 2 s after A's, ties A's head.
    for blk, cls, t in ((blocks[0], a, 0.0), (blocks[1], a, 0.1), (blocks[2], b_, math.log(2)),
                        (blocks[3], b_, math.log(2) + 0.05)):
        clock.t = t
        q.block_class[blk.block_id] = cls
        q.append_n([blk])
    clock.t = 5.0
    expected = ids(q.iter_eviction_order())
    assert expected == [0, 2, 3, 1]
    assert ids(q.popleft_n(4)) == expected


@pytest.mark.parametrize("seed", range(6))
def test_the_walk_over_long_runs_is_the_eviction_order(seed):
    """Requests free runs of 10 to 64 blocks into a few classes with falling
    scores: the walk (``iter_eviction_order``, which takes a long run's blocks
    below its crossing unscored) must give the order ``popleft_n`` evicts in."""
    rng = random.Random(seed)
    reg, cids = _registry(rng.randint(2, 4))
    mode = ("pr", "posterior", "density", "ttl")[seed % 4]
    params = WAParams(models={f"c{i}": rng.choice(MODELS) for i in range(len(cids))}, mode=mode, horizon=10.0,
                      stamp=rng.choice(["free", "lookup"]))
    clock = SettableClock(100.0)
    blocks = [KVCacheBlock(i) for i in range(400)]
    q = WorkloadAwareFreeQueue(blocks, params, clock=clock, registry=reg, score_staleness=0.0)
    held = q.popleft_n(400)
    for i, b in enumerate(held):
        set_hash(b, ("h", i))
    while held:
        clock.advance(rng.choice([0.01, 0.5, 3.0, 20.0]))
        k = rng.randint(10, 64)
        run, held = held[:k], held[k:]
        start = clock.t - rng.choice([0.0, 2.0, 30.0])
        c = rng.choice(cids)
        for b in run:
            q.block_class[b.block_id] = c
            q.lookup_time[b.block_id] = max(q.lookup_time[b.block_id], start)
        q.append_n(run)
    clock.advance(5.0)
    walked = ids(q.iter_eviction_order())
    assert walked == ids(q.popleft_n(len(walked)))


def test_a_block_within_the_tie_of_the_runner_up_waits_for_the_older_head():
    """A run's crossing with the runner-up head is solved in idle time; for a
    slowly falling score its margin was smaller than the tie, so a block that
    scores within 1e-9 of the runner-up head, but is newer, went first."""
    rate, shift = 1.0 / 60.0, 5.0
    reg = ClassRegistry()
    # B's law is A's shifted by 5 s of idle time: B's block freed at 985 ties A's freed at 980.
    params = WAParams(models={"A": ReuseModel.exponential(0.9, rate),
                              "B": ReuseModel.exponential(0.9 * math.exp(-rate * shift), rate)}, mode="pr", horizon=1.0)
    plan = sorted([("B", 885.0 + k) for k in range(11)] + [("A", 980.0), ("B", 985.0 - 3e-8), ("B", 986.0)],
                  key=lambda e: e[1])
    blocks = [KVCacheBlock(i) for i in range(len(plan))]
    clock = SettableClock(0.0)
    q = WorkloadAwareFreeQueue([], params, clock=clock, registry=reg, num_block_ids=len(plan), score_staleness=0.0)
    cls = {"A": reg.claim("A", 0.0), "B": reg.claim("B", 0.0)}
    for b, (name, t) in zip(blocks, plan):
        set_hash(b, ("h", b.block_id))
        clock.t = t
        q.block_class[b.block_id] = cls[name]
        q.append_n([b])
    clock.t = 1000.0
    got = ids(q.popleft_n(len(plan)))
    assert got.index(11) < got.index(12)  # A's head (980 s) before B's tied, newer block (985 s)

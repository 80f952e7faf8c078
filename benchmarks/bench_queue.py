"""Per-operation cost of the workload-aware queue against vLLM's own queue.

Both queues hold the same blocks and see the same operation stream: requests
free a run of blocks (``append_n``, 8 workload classes with different reuse
models for WA), prefix hits take blocks off the free list (``remove``) and
allocations evict (``popleft_n``), late outcome reports move a request's
blocks to another class (``refile``; vLLM's row takes them off and frees them
again).  Reported: nanoseconds per block for each
operation and the WA/vLLM ratio, measured in one run, at 10k, 100k and 1M
blocks.

    make bench-queue                # all sizes
    python benchmarks/bench_queue.py --sizes 10000 --rounds 3
    python benchmarks/bench_queue.py --classes 35   # the Bailian mix under the default class key
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.request import Request, RequestStatus

from vllm_wa.controller.features import FeatureKey
from vllm_wa.engine_patch import WorkloadAwareFreeQueue
from vllm_wa.engine_patch.conversations import ConversationTracker
from vllm_wa.engine_patch.install import install_wa_queue, uninstall_wa_queue
from vllm_wa.kv_block import set_hash
from vllm_wa.params import ReuseModel, WAParams
from vllm_wa.sim.clock import SettableClock
from vllm_wa.sim.kv_manager import model_free_kv_cache_manager
from vllm_wa.workload_classes import ClassRegistry

NUM_CLASSES = 8
RUN = 32  # blocks per request
OFFLOAD_WALK = 512  # blocks vLLM's lazy CPU offload looks ahead at a step (offload_walk)
REQUEST_KINDS = ("vllm", "wa", "wa+timing", "wa+timing+lookup")
TIMING = ("think", "reply", "growth", "turn")  # request features the engine derives from the prefix chain


def wa_params(registry: ClassRegistry) -> WAParams:
    rng = random.Random(7)
    models = {}
    for i in range(NUM_CLASSES):
        name = f"class_{i}"
        registry.id_of(name)
        models[name] = ReuseModel.exponential(rng.uniform(0.1, 0.9), 1.0 / rng.uniform(2.0, 300.0))
    return WAParams(models=models, horizon=5.0, mode="pr")


def build(kind: str, n: int):
    blocks = [KVCacheBlock(i) for i in range(n)]
    clock = SettableClock()
    if kind == "vllm":
        q = FreeKVCacheBlockQueue(blocks)
    else:
        reg = ClassRegistry()
        q = WorkloadAwareFreeQueue(blocks, wa_params(reg), clock=clock, registry=reg)
        cids = [reg.id_of(f"class_{i}") for i in range(NUM_CLASSES)]
        for b in blocks:
            q.block_class[b.block_id] = cids[(b.block_id // RUN) % NUM_CLASSES]
    return q, blocks, clock


def run(kind: str, n: int, seed: int) -> dict[str, float]:
    """Fill the queue with hashed blocks of 8 classes, then time each operation."""
    q, blocks, clock = build(kind, n)
    rng = random.Random(seed)
    filed = list(q.block_class) if kind != "vllm" else None

    def file(run_blocks: list[KVCacheBlock]) -> None:
        # What the block tagger does before a release: a block taken for new
        # content has no class until it is filed (untimed).
        if filed is not None:
            for b in run_blocks:
                q.block_class[b.block_id] = filed[b.block_id]

    # Give every block a hash and put it back, request by request, so WA has
    # eight populated class lists with interleaved free times.
    taken = q.popleft_n(n)
    file(taken)
    for b in taken:
        set_hash(b, b"h" + b.block_id.to_bytes(8, "little"))
    order = list(range(0, n, RUN))
    rng.shuffle(order)
    for start in order:
        clock.t += 0.001
        q.append_n(taken[start : start + RUN])
    gc.collect()
    gc.disable()
    try:
        # popleft_n: allocations of one request's worth of blocks at a time.
        pops = []
        clock.t += 1.0
        t0 = time.perf_counter_ns()
        for _ in range(n // (2 * RUN)):
            pops.append(q.popleft_n(RUN))
        t_pop = (time.perf_counter_ns() - t0) / (len(pops) * RUN)
        # popleft: single-block allocations (decode steps).
        singles = []
        t0 = time.perf_counter_ns()
        for _ in range(min(20000, n // 8)):
            singles.append(q.popleft())
        t_pop1 = (time.perf_counter_ns() - t0) / len(singles)
        for run_blocks in pops:
            file(run_blocks)
        file(singles)
        # append_n: requests freeing their blocks.
        t0 = time.perf_counter_ns()
        for run_blocks in pops:
            clock.t += 0.001
            q.append_n(run_blocks)
        q.append_n(singles)
        t_append = (time.perf_counter_ns() - t0) / (len(pops) * RUN + len(singles))
        # refile: late outcome reports (a tool call) move recently freed
        # requests' blocks to another class, in place; vLLM has no classes,
        # so its row takes the same blocks off the list and frees them again.
        recent = [r for r in pops[-200:] if all(b.next_free_block is not None for b in r)]
        cids = [q.registry.id_of(f"class_{i}") for i in range(NUM_CLASSES)] if kind != "vllm" else []
        targets = [cids[(cids.index(q.block_class[r[0].block_id]) + 1) % NUM_CLASSES] for r in recent] if cids else []
        t0 = time.perf_counter_ns()
        if kind == "vllm":
            for run_blocks in recent:
                for b in run_blocks:
                    q.remove(b)
                q.append_n(run_blocks)
        else:
            for run_blocks, c in zip(recent, targets):
                q.refile(run_blocks, c)
        t_refile = (time.perf_counter_ns() - t0) / max(1, len(recent) * RUN)
        # offload_walk: vLLM's lazy CPU offload walks the next blocks to go
        # at every step (``iter_blocks_after``; 512 blocks is 8,192 batched
        # tokens of 16); the WA queue walks them from its first block.
        walks = 20
        t0 = time.perf_counter_ns()
        for _ in range(walks):
            for _ in zip(range(OFFLOAD_WALK), q.iter_blocks_after(None)):
                pass
        t_walk = (time.perf_counter_ns() - t0) / (walks * OFFLOAD_WALK)
        # remove: prefix hits on free blocks, in a random order.
        victims = [b for b in rng.sample(blocks, n // 4) if b.next_free_block is not None]
        t0 = time.perf_counter_ns()
        for b in victims:
            q.remove(b)
        t_remove = (time.perf_counter_ns() - t0) / len(victims)
    finally:
        gc.enable()
    return {
        "popleft_n": t_pop, "popleft": t_pop1, "append_n": t_append, "refile": t_refile, "remove": t_remove,
        "offload_walk": t_walk,
    }


def run_pool(kind: str, n: int, seed: int) -> dict[str, float]:
    """The same operations through vLLM's BlockPool (what the engine pays per block)."""
    pool = BlockPool(num_gpu_blocks=n, enable_caching=True, hash_block_size=16)
    rng = random.Random(seed)
    if kind == "wa":
        reg = ClassRegistry()
        h = install_wa_queue(pool, wa_params(reg), registry=reg)
        cids = [reg.id_of(f"class_{i}") for i in range(NUM_CLASSES)]
        for b in pool.blocks:
            h.queue.block_class[b.block_id] = cids[(b.block_id // RUN) % NUM_CLASSES]
    counter = [0]

    def cache(blocks):
        for b in blocks:
            if kind == "wa":
                # The class the block tagger writes before the release.
                h.queue.block_class[b.block_id] = cids[(b.block_id // RUN) % NUM_CLASSES]
            counter[0] += 1
            key = make_block_hash_with_group_id(counter[0].to_bytes(32, "little"), 0)
            set_hash(b, key)
            pool.cached_block_hash_to_block.insert(key, b)

    # Warm: fill the pool with cached, freed requests.
    held = []
    while pool.get_num_free_blocks() >= RUN:
        blocks = pool.get_new_blocks(RUN)
        cache(blocks)
        held.append(blocks)
    rng.shuffle(held)
    for blocks in held:
        pool.free_blocks(reversed(blocks))
    gc.collect()
    gc.disable()
    try:
        reqs = []
        t0 = time.perf_counter_ns()
        for _ in range(n // (2 * RUN)):
            blocks = pool.get_new_blocks(RUN)  # evicts cached blocks
            reqs.append(blocks)
        t_get = (time.perf_counter_ns() - t0) / (len(reqs) * RUN)
        for blocks in reqs:
            cache(blocks)
        t0 = time.perf_counter_ns()
        for blocks in reqs:
            pool.free_blocks(reversed(blocks))
        t_free = (time.perf_counter_ns() - t0) / (len(reqs) * RUN)
        t0 = time.perf_counter_ns()
        for blocks in reqs:
            pool.touch(blocks)  # prefix hits on free blocks
        t_touch = (time.perf_counter_ns() - t0) / (len(reqs) * RUN)
    finally:
        gc.enable()
    return {"get_new_blocks": t_get, "free_blocks": t_free, "touch": t_touch}


def run_requests(kind: str, n: int, seed: int, requests: int = 3000) -> dict[str, float]:
    """Whole requests through vLLM's ``KVCacheManager`` (lookup, allocate, free), in ns per request.

    ``vllm``: vLLM's queue; ``wa``: the WA queue and tagger with the
    ``tag+outcome`` class key; ``wa+timing``: the same with the conversation
    tracker and every timing feature in the key (think, reply, growth,
    turn), what a timing candidate costs the engine thread;
    ``wa+timing+lookup``: that candidate stamped at the lookup (each release
    inserted where its request's start sorts).  (The block features, depth
    and reuse, are not timing features: they classify each block on its
    own, a cost per block.)
    """
    init_none_hash(sha256)
    manager = model_free_kv_cache_manager(n, 16, 16 * 1024)
    clock = SettableClock()
    if kind != "vllm":
        reg = ClassRegistry()
        features = ("tag", "outcome") if kind == "wa" else ("tag", "outcome", *TIMING)
        params = wa_params(reg)
        if kind == "wa+timing+lookup":
            params = params.evolve(stamp="lookup")
        install_wa_queue(
            manager.block_pool, params, clock=clock, registry=reg, class_key=FeatureKey(features),
            conversations=ConversationTracker() if kind != "wa" else None,
        )
    rng = random.Random(seed)
    hasher = get_request_block_hasher(16, sha256)
    convs = [[rng.randrange(1 << 30)] * 16 for _ in range(64)]
    reqs = []
    for i in range(requests):
        c = rng.randrange(len(convs))
        if len(convs[c]) > 16 * 48:
            convs[c] = [rng.randrange(1 << 30)] * 16
        convs[c] = convs[c] + [rng.randrange(1 << 30) for _ in range(16 * rng.randint(1, 6))]
        sp = SamplingParams(max_tokens=1, extra_args={"type_info": f"tag_{c % 4}"})
        sp.update_from_generation_config({}, eos_token_id=None)
        reqs.append(Request(f"r{i}", list(convs[c]), sp, None, block_hasher=hasher))
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for r in reqs:
            clock.t += 0.05
            blocks, hit, _ = manager.get_computed_blocks(r)
            if manager.allocate_slots(r, r.num_tokens - hit, hit, blocks) is None:
                raise RuntimeError("the benchmark cache is too small for its requests")
            r.num_computed_tokens = r.num_tokens
            r.status = RequestStatus.FINISHED_STOPPED
            manager.free(r)
        t = (time.perf_counter_ns() - t0) / len(reqs)
    finally:
        gc.enable()
        if kind != "vllm":
            uninstall_wa_queue(manager.block_pool)
    return {"request": t}


def best_of(bench, n: int, rounds: int) -> dict[str, dict[str, float]]:
    """Per queue kind, the fastest ns-per-block of each operation over ``rounds``."""
    best: dict[str, dict[str, float]] = {}
    for r in range(rounds):
        # Interleave the two queues so drift in machine load hits both.
        for kind in ("vllm", "wa"):
            res = bench(kind, n, seed=r)
            cur = best.setdefault(kind, res)
            for op, v in res.items():
                cur[op] = min(cur[op], v)
    return best


def main() -> None:
    global NUM_CLASSES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--rounds", type=int, default=3, help="best of N rounds per cell")
    ap.add_argument("--classes", type=int, default=NUM_CLASSES,
                    help="workload classes in use (the Bailian mix under the default key: 35)")
    ap.add_argument("--json", help="write the table as JSON here")
    args = ap.parse_args()
    NUM_CLASSES = args.classes
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        for bench, ops, prefix in (
            (run, ("popleft_n", "popleft", "append_n", "refile", "remove", "offload_walk"), ""),
            (run_pool, ("get_new_blocks", "free_blocks", "touch"), "pool."),
        ):
            best = best_of(bench, n, args.rounds)
            for op in ops:
                v, w = best["vllm"][op], best["wa"][op]
                rows.append({"blocks": n, "op": prefix + op, "vllm_ns": v, "wa_ns": w, "ratio": w / v})
        per_request = {kind: float("inf") for kind in REQUEST_KINDS}
        for r in range(args.rounds):
            for kind in REQUEST_KINDS:
                per_request[kind] = min(per_request[kind], run_requests(kind, n, seed=r)["request"])
        base, wa, timed, stamped = (per_request[k] for k in REQUEST_KINDS)
        rows.append({"blocks": n, "op": "request (wa)", "vllm_ns": base, "wa_ns": wa, "ratio": wa / base})
        rows.append({"blocks": n, "op": "request (wa+timing)", "vllm_ns": base, "wa_ns": timed, "ratio": timed / base})
        rows.append({"blocks": n, "op": "request timing/wa", "vllm_ns": wa, "wa_ns": timed, "ratio": timed / wa})
        rows.append({"blocks": n, "op": "request lookup/timing", "vllm_ns": timed, "wa_ns": stamped, "ratio": stamped / timed})
    print(f"WA queue ({NUM_CLASSES} classes, PR scores) vs vLLM FreeKVCacheBlockQueue, ns per block, best of {args.rounds}")
    print("(queue operations alone, then the same work through vLLM's BlockPool: pool.*; then ns per whole")
    print(" request through vLLM's KVCacheManager with the engine hooks; 'timing/wa': the timing features' cost;")
    print(" 'lookup/timing': the lookup stamp's)")
    print(f"{'blocks':>9} {'operation':<20} {'vLLM':>8} {'WA':>8} {'WA/vLLM':>8}")
    for row in rows:
        print(f"{row['blocks']:>9} {row['op']:<20} {row['vllm_ns']:>8.0f} {row['wa_ns']:>8.0f} {row['ratio']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

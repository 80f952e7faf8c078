"""Cost of the online controller, and of a parameter swap.

1. CPU share: a synthetic engine event stream of ``--rate`` events per second
   (block frees, evictions, prompt lookups and finishes, in the proportions of
   a prefix-caching engine) is fed to ``WAController`` over ``--seconds`` of
   simulated time, with a refit every ``refit_interval_s``.  Twice: with every
   event reaching the controller (worst case), and with the default hash
   sampling for a ``--cache-blocks`` cache, where the engine emits block events
   only for sampled hashes.  Reported: controller CPU seconds per second of
   traffic, as a share of one core.
2. Swap latency: ``queue.set_params`` of a freshly fitted parameter object.
3. The queue is never locked: engine-thread queue operations are timed with
   and without the controller refitting on a background thread.
4. A checkpoint write at the finest-class cap: the longest time another
   thread (the engine's) waits for the GIL meanwhile.

    make bench-controller
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time

import numpy as np
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.controller import controller as ctrl
from vllm_wa.controller.config import ControllerConfig
from vllm_wa.controller.controller import WAController, sample_rate_for
from vllm_wa.controller.features import FOLDED
from vllm_wa.engine_patch.block_tagger import RequestTags
from vllm_wa.engine_patch.conversations import TurnTiming
from vllm_wa.engine_patch.events import EventKind, EventSink, EvictedEvent, FinishedEvent, FreedEvent, LookupEvent
from vllm_wa.engine_patch.free_queue import WorkloadAwareFreeQueue
from vllm_wa.kv_block import set_hash
from vllm_wa.params import ReuseModel, WAParams
from vllm_wa.workload_classes import ClassRegistry


def event_stream(rate: float, seconds: float, seed: int = 0):
    """Yields (time, event) at ``rate`` events/s: per request, one lookup with
    ~8 sampled hashes, ~8 frees, ~8 evictions and one finish (18 events)."""
    rng = random.Random(seed)
    per_req = 18
    req_rate = rate / per_req
    t = 0.0
    conv_next: dict[int, int] = {}
    n = 0
    while t < seconds:
        t += rng.expovariate(req_rate)
        conv = rng.randrange(200)
        tag = "tool" if conv % 3 else "human"
        turn = conv_next.get(conv, 0)
        conv_next[conv] = turn + 1
        hashes = tuple((j, (conv, turn - 1 if j < 6 else turn, j)) for j in range(8))
        rid = f"r{n}"
        n += 1
        yield t, LookupEvent(EventKind.LOOKUP, t, rid, tag, tuple(h for _, h in hashes), ())
        req = RequestTags(rid, tag, "tool" if tag == "tool" else "stop", 100,
                          TurnTiming(conv, 0, turn + 1, 10.0 if turn else None, 0.1 if turn else None))
        for j, h in hashes:
            yield t, FreedEvent(EventKind.FREED, t, h, req, j, turn)
        for j in range(8):
            yield t, EvictedEvent(EventKind.EVICTED, t, (rng.randrange(200), rng.randrange(max(1, turn)), j))
        yield t, FinishedEvent(EventKind.FINISHED, t, rid, req)


def bench_cpu(rate: float, seconds: float, cache_blocks: int | None = None) -> dict[str, float]:
    """Controller CPU per second of engine traffic at ``rate`` engine events/s.

    ``cache_blocks=None``: every event reaches the controller (the worst case,
    as if the whole cache were sampled).  Otherwise the sink samples block
    hashes as in production (so the miniature caches hold about
    ``shadow_blocks``), and the engine emits block events only for sampled
    hashes; ``rate`` still counts every event the engine would produce.
    """
    cfg = ControllerConfig()
    rate_s = 1.0 if cache_blocks is None else sample_rate_for(cache_blocks, cfg.shadow_blocks)
    sink = EventSink(capacity=1 << 22, sample_rate=rate_s)
    clock = [0.0]
    c = WAController(cfg, cache_blocks or 4096, lambda p, k: None, sink, clock=lambda: clock[0])

    def engine_side(stream):
        # What the engine hooks do before emitting: keep sampled hashes only.
        if sink.samples_all:
            yield from stream
            return
        keep = sink.is_sampled
        for t, ev in stream:
            if isinstance(ev, LookupEvent):
                yield t, ev._replace(hashes=tuple(h for h in ev.hashes if keep(h)))
            elif isinstance(ev, FinishedEvent) or keep(ev.block_hash):
                yield t, ev

    # The stream is made (and filtered) before the clock starts: what is
    # timed is the engine's emits and the controller's refits, each on its
    # own clock, interleaved as in an engine. The refits (drain, the
    # miniature caches, fits, the tuner) are the controller's whole cost.
    stream = list(engine_side(event_stream(rate, seconds)))
    next_refit = cfg.refit_interval_s
    ctl = 0.0
    emit = sink.emit
    e0 = time.process_time()
    for t, ev in stream:
        if t >= next_refit:
            clock[0] = next_refit
            r0 = time.process_time()
            c.refit()
            ctl += time.process_time() - r0
            next_refit += cfg.refit_interval_s
        emit(ev)
    clock[0] = seconds
    r0 = time.process_time()
    c.refit()
    ctl += time.process_time() - r0
    engine = time.process_time() - e0 - ctl
    return {"events": int(rate * seconds), "seconds": seconds, "controller_cpu_s": ctl,
            "core_share": ctl / seconds, "emit_cpu_s": engine, "errors": c.errors, "refits": c.refits,
            "sample_rate": rate_s, "events_processed": c.events_processed}


def bench_swap(repeats: int = 2000) -> dict[str, float]:
    reg = ClassRegistry()
    blocks = [KVCacheBlock(i) for i in range(100_000)]
    q = WorkloadAwareFreeQueue(blocks, None, registry=reg)
    rng = random.Random(0)
    variants = [
        WAParams(models={f"c{i}": ReuseModel((rng.uniform(0.1, 0.4), rng.uniform(0.1, 0.4)),
                                               (rng.uniform(0.01, 1), rng.uniform(1e-4, 0.01)))
                         for i in range(16)}, mode="posterior", version=k)
        for k in range(8)
    ]
    times = []
    for i in range(repeats):
        p = variants[i % len(variants)]
        t0 = time.perf_counter_ns()
        q.set_params(p)
        times.append(time.perf_counter_ns() - t0)
    times.sort()
    return {"median_us": times[len(times) // 2] / 1000, "p99_us": times[int(len(times) * 0.99)] / 1000,
            "max_us": times[-1] / 1000}


def bench_unlocked(seconds: float = 3.0) -> dict[str, float]:
    """Queue operation latency on the 'engine' thread, alone and while refits run."""
    reg = ClassRegistry()
    n = 50_000
    blocks = [KVCacheBlock(i) for i in range(n)]
    q = WorkloadAwareFreeQueue(blocks, None, registry=reg, clock=time.monotonic)
    cids = [reg.id_of(f"c{i}") for i in range(4)]
    got = q.popleft_n(n)
    for b in got:
        set_hash(b, b.block_id)
        q.block_class[b.block_id] = cids[b.block_id % 4]
    q.append_n(got)

    def engine_ops(duration: float) -> float:
        worst = 0.0
        end = time.perf_counter() + duration
        ops = 0
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            taken = q.popleft_n(32)
            for b in taken:
                set_hash(b, b.block_id)
                q.block_class[b.block_id] = cids[b.block_id % 4]  # as the block tagger files it
            q.append_n(taken)
            worst = max(worst, time.perf_counter() - t0)
            ops += 1
        return ops / duration

    alone = engine_ops(seconds)
    stop = threading.Event()
    cfg = ControllerConfig(refit_interval_s=0.05)
    sink = EventSink(capacity=1 << 20, sample_rate=1.0)
    c = WAController(cfg, n, lambda p, k: q.set_params(p), sink)
    stream = list(event_stream(5000, 60))

    def controller_loop():
        i = 0
        while not stop.is_set():
            for _, ev in stream[i : i + 2000]:
                sink.emit(ev)
            i = (i + 2000) % len(stream)
            c.refit()

    th = threading.Thread(target=controller_loop, daemon=True)
    th.start()
    busy = engine_ops(seconds)
    stop.set()
    th.join()
    return {"engine_ops_per_s_alone": alone, "engine_ops_per_s_with_refits": busy, "refits": c.refits,
            "note": "no lock: the ratio is the GIL share the refit thread takes"}


def _longest_stall(work) -> tuple[float, float]:
    """(seconds ``work()`` took, the longest another thread waited past a
    1-ms sleep meanwhile): how long an engine thread is held off the GIL."""
    gaps: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last - 0.001)
            last = now

    th = threading.Thread(target=ticker, daemon=True)
    th.start()
    time.sleep(0.1)
    gaps.clear()
    t0 = time.perf_counter()
    work()
    took = time.perf_counter() - t0
    time.sleep(0.05)
    stop.set()
    th.join()
    return took, max(gaps)


def bench_checkpoint_stall(folder: str) -> dict[str, float]:
    """A checkpoint at the finest-class cap (4,096 rows and the folded room,
    every row's bins filled): the longest GIL hold of its write, against one
    ``json.dumps`` of the same content (how it was written until 2026-12-07)."""
    rng = np.random.default_rng(0)
    c = WAController(ControllerConfig(), 100_000, lambda p, k: None, EventSink(), clock=lambda: 0.0)
    n = ctrl.MAX_FINE_CLASSES + ctrl.FOLDED_ROOM
    for i in range(n):  # the table a long-running server with many tags and timings fills
        c._fine_id(c._folded((f"t{i % 64}", "tool", FOLDED, 0, i % 5, 0, (i // 5) % 5, (i // 25) % 5)))
    for row in c._bank.rows:
        row.events[:76] = rng.random(76) * 3.0
        row.censored[:76] = rng.random(76) * 3.0
    path = os.path.join(folder, "checkpoint.json")
    took, stall = _longest_stall(lambda: c.save_checkpoint(path))
    with open(path) as f:
        content = json.load(f)
    dumps_took, dumps_stall = _longest_stall(lambda: json.dumps(content))
    return {"classes": len(c._fine), "mib": os.path.getsize(path) / 2**20, "write_s": took, "write_stall_s": stall,
            "dumps_s": dumps_took, "dumps_stall_s": dumps_stall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=5000.0)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--cache-blocks", type=int, default=65536,
                    help="cache size for the production-sampling line")
    args = ap.parse_args()
    for cache in (None, args.cache_blocks):
        cpu = bench_cpu(args.rate, args.seconds, cache)
        how = ("every event sampled (worst case)" if cache is None else
               f"default sampling for a {cache}-block cache (rate {cpu['sample_rate']:.4f})")
        print(f"controller at {args.rate:.0f} engine events/s over {args.seconds:.0f}s, {how}: "
              f"{cpu['events_processed']} events reached it; "
              f"{cpu['controller_cpu_s']:.2f} CPU s = {100 * cpu['core_share']:.2f}% of one core "
              f"({cpu['refits']} refits, {cpu['errors']} errors)")
    sw = bench_swap()
    print(f"parameter swap (queue.set_params): median {sw['median_us']:.1f} us, p99 {sw['p99_us']:.1f} us, "
          f"max {sw['max_us']:.1f} us")
    un = bench_unlocked()
    print(f"engine-thread queue ops/s: alone {un['engine_ops_per_s_alone']:.0f}, while the controller refits "
          f"on another thread {un['engine_ops_per_s_with_refits']:.0f} ({un['refits']} refits); "
          f"{un['note']}")
    with tempfile.TemporaryDirectory() as folder:
        ck = bench_checkpoint_stall(folder)
    print(f"checkpoint write at the finest-class cap ({ck['classes']} classes, {ck['mib']:.1f} MiB): "
          f"{ck['write_s']:.2f} s, another thread held off at most {1000 * ck['write_stall_s']:.0f} ms; "
          f"one json.dumps of it {ck['dumps_s']:.2f} s, held off {1000 * ck['dumps_stall_s']:.0f} ms "
          f"(ratio {ck['dumps_stall_s'] / max(ck['write_stall_s'], 1e-9):.1f})")


if __name__ == "__main__":
    main()

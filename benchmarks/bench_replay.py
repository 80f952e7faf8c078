"""Replay cost per policy, as CPU time per prompt block and as a ratio to LRU.

Every policy replays the same trace at one cache size in this process (one
core, no parallel runs), so the numbers compare policies, not machines. The
target on the development split (10 policies x 5 sizes plus the knob tuning in
30 minutes on 2 cores) is checked by ratios: with LRU's cost per block as the
unit, the sweep's projected cost is the sum of the ratios below times LRU's
time on the split.

    python benchmarks/bench_replay.py                          # bundled agentic sample, 10 %
    python benchmarks/bench_replay.py --trace agentic-coding-dev.tar.xz --conversations 120 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from vllm_wa.cli import sample_path
from vllm_wa.replay.knobs import profile_setup
from vllm_wa.replay.loaders import AgenticOptions
from vllm_wa.replay.peers import PEERS
from vllm_wa.replay.runner import ReplayConfig, Task, prepare, resolve_sizes, run_tasks
from vllm_wa.replay.trace_cache import load_trace_cached

DEFAULT_POLICIES = "lru,opt,wa-offline,wa-online,arc,slru,lfu,fifo,tlru,session,ttl-tool"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=sample_path("agentic-coding-sample.tar.xz"))
    ap.add_argument("--conversations", type=int, help="agentic traces: a seeded sample of conversations")
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--size", default="10%", help="cache size (blocks or %% of the evaluation window's unique blocks)")
    ap.add_argument("--sizes-in-sweep", type=int, default=5, help="sizes a sweep runs, for the projection")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()

    trace = load_trace_cached(args.trace, agentic=AgenticOptions(max_conversations=args.conversations))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    setup = prepare(trace, policies, ReplayConfig())
    (size,) = resolve_sizes(args.size, setup.trace, setup.eval_start)
    blocks = sum(len(r.hash_ids) for r in trace.requests)
    print(f"{trace.name}: {len(trace.requests)} requests, {blocks} prompt blocks, cache {size} blocks")

    rows = {}
    for p in policies:
        gc.collect()
        (r,) = run_tasks(setup, [Task(p, size)], jobs=1)
        rows[p] = {"cpu_s": r.cpu_s, "ns_per_block": 1e9 * r.cpu_s / blocks, "token_hit_rate": r.token_hit_rate}
    # Tuning: every candidate of every tunable peer replays the profile half once.
    part = profile_setup(setup)
    part_blocks = sum(len(r.hash_ids) for r in part.trace.requests)
    tuning = 0.0
    for p in policies:
        knob = PEERS[p].knob if p in PEERS else None
        if knob is not None:
            t = time.process_time()
            run_tasks(part, [Task(p, size, knob.default)], jobs=1)
            tuning += (time.process_time() - t) * len(knob.values)
    lru = rows.get("lru", {}).get("cpu_s")
    print(f"{'policy':<12}{'CPU s':>9}{'ns/block':>10}{'x LRU':>8}{'hit %':>8}")
    for p, row in rows.items():
        ratio = row["cpu_s"] / lru if lru else float("nan")
        row["ratio_to_lru"] = ratio
        print(f"{p:<12}{row['cpu_s']:>9.1f}{row['ns_per_block']:>10.0f}{ratio:>8.2f}{100 * row['token_hit_rate']:>8.2f}")
    sweep = args.sizes_in_sweep * sum(row["cpu_s"] for row in rows.values()) + tuning
    print(
        f"sweep of these policies at {args.sizes_in_sweep} sizes plus tuning ({tuning:.0f} s CPU, "
        f"{part_blocks} blocks in the profile half): {sweep:.0f} s CPU"
        + (f" = {sweep / lru:.0f} x LRU's run" if lru else "")
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"trace": trace.name, "cache_blocks": size, "runs": rows, "tuning_cpu_s": tuning,
                       "sweep_cpu_s": sweep}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

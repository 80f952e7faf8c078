"""What each class-key feature adds: one fixed candidate per feature set, full size.

Each row is ``wa-online`` running one candidate (hyperexponential, posterior,
L = 10 s) with the tuner off, so the table measures the class key, not the
tuner's choice; ``lru`` and ``opt`` give the share of the LRU-to-Belady gap.
Rows: each feature alone, ``tag+outcome`` (the PR's key refined by the
reply's outcome) and that key plus one more feature, then every request
feature together.  The timing features (think, reply, growth, turn) are
derived by the engine from the prefix chain; depth and reuse are per block.

    python benchmarks/feature_ablation.py TRACE --size 11% [--jobs 2] [--json out.json]
    python benchmarks/feature_ablation.py --sets tag+outcome,tag+outcome+think   # a subset
    python benchmarks/feature_ablation.py TRACE --sets tag+outcome+think+reply+growth+turn --classes 0,4,8,16

``--classes K`` runs each set as a learned key of up to K classes
(``controller/learned_key.py``); 0 is the set's own key, one class per cell.
``--family``, ``--mode`` and ``--horizon`` replace the candidates' model and
score, for example a time to live per class:

    python benchmarks/feature_ablation.py TRACE --size 15% --sets tag+outcome --family exponential --mode ttl --horizon 100
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from typing import Any

from vllm_wa.cli import sample_path
from vllm_wa.controller.config import ALL_REQUEST_FEATURES, CandidateSpec, ControllerConfig
from vllm_wa.controller.features import FEATURES
from vllm_wa.replay.loaders import AgenticOptions
from vllm_wa.replay.online_policy import OnlineWAPolicy
from vllm_wa.replay.parallel import map_jobs
from vllm_wa.replay.runner import ReplayConfig, SweepSetup, make_policy, prepare, resolve_sizes, run_one
from vllm_wa.replay.trace_cache import load_trace_cached

BASE = ("tag", "outcome")
ALL_REQUEST = ALL_REQUEST_FEATURES


def default_sets() -> list[tuple[str, ...]]:
    sets: list[tuple[str, ...]] = [(f,) for f in FEATURES]
    sets.append(BASE)
    sets += [(*BASE, f) for f in FEATURES if f not in BASE]
    sets.append(ALL_REQUEST)
    return sets


# The candidates' reuse-model family, score mode and horizon (--family, --mode, --horizon).
Score = tuple[str, str, float]
DEFAULT_SCORE: Score = ("hyperexponential", "posterior", 10.0)


def candidate(
    features: tuple[str, ...], stamp: str = "free", classes: int = 0, score: Score = DEFAULT_SCORE
) -> CandidateSpec:
    family, mode, horizon = score
    return CandidateSpec(features, family, mode, horizon, stamp=stamp, classes=classes)


_SETUP: tuple[SweepSetup, ControllerConfig, int, Score] | None = None
Task = tuple[str, tuple[str, ...] | None, str, int]  # policy, feature set, stamp, learned classes


def _run(task: Task) -> tuple[Task, dict[str, Any]]:
    assert _SETUP is not None
    setup, base, size, score = _SETUP
    kind, features, stamp, classes = task
    if features is None:
        policy = make_policy(kind, setup)
    else:
        cand = candidate(features, stamp, classes, score)
        policy = OnlineWAPolicy.create(
            replace(base, tuner_enabled=False, initial=cand.name, candidates=(cand,)), setup.trace
        )
    r = run_one(setup.trace, policy, size, setup.cfg, setup.eval_start)
    return task, {"token_hit_rate": r.token_hit_rate, "block_hit_rate": r.block_hit_rate, "wall_s": r.wall_s}


def ablation(
    setup: SweepSetup,
    size: int,
    sets: list[tuple[str, ...]],
    base: ControllerConfig,
    jobs: int = 1,
    stamps: tuple[str, ...] = ("free",),
    classes: tuple[int, ...] = (0,),
    score: Score = DEFAULT_SCORE,
) -> list[dict[str, Any]]:
    """Hit rate of ``lru``, ``opt`` and one fixed candidate per feature set, stamp and class count."""
    global _SETUP
    tasks: list[Task] = [("opt", None, "free", 0), ("lru", None, "free", 0)]
    tasks += [("wa-online", s, st, k) for s in sets for st in stamps for k in classes]
    _SETUP = (setup, base, size, score)
    done: dict[Task, dict[str, Any]] = {}
    try:
        for task, out in map_jobs(_run, tasks, jobs, ordered=False):
            done[task] = out
    finally:
        _SETUP = None
    lru, opt = done[("lru", None, "free", 0)]["token_hit_rate"], done[("opt", None, "free", 0)]["token_hit_rate"]
    rows = []
    for task in tasks:
        kind, features, stamp, k = task
        hit = done[task]["token_hit_rate"]
        label = kind if features is None else "+".join(features) or "none"
        rows.append(
            {
                "policy": label + (f"/K{k}" if k else "") + ("@lookup" if stamp == "lookup" else ""),
                "features": list(features) if features is not None else None,
                "stamp": stamp,
                "classes": k,
                "token_hit_rate": hit,
                "gap_closed": (hit - lru) / (opt - lru) if opt > lru else None,
                "wall_s": done[task]["wall_s"],
            }
        )
    return rows


def format_table(name: str, size: int, rows: list[dict[str, Any]]) -> str:
    base = next((r["token_hit_rate"] for r in rows if r["policy"] == "+".join(BASE)), None)
    lines = [f"{name} at {size} blocks: token hit rate %, share of the LRU->OPT gap, vs tag+outcome (points)"]
    lines.append(f"{'class key':<40} {'hit %':>7} {'gap %':>7} {'vs t+o':>7}")
    for r in rows:
        gap = "" if r["gap_closed"] is None else f"{100 * r['gap_closed']:+.1f}"
        vs = "" if base is None or r["features"] is None else f"{100 * (r['token_hit_rate'] - base):+.2f}"
        lines.append(f"{r['policy']:<40} {100 * r['token_hit_rate']:>7.2f} {gap:>7} {vs:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=sample_path("agentic-coding-sample.tar.xz"))
    ap.add_argument("--size", default="11%", help="cache size (blocks or %% of the evaluation window's unique blocks)")
    ap.add_argument("--conversations", type=int, help="agentic traces: a seeded sample of conversations")
    ap.add_argument(
        "--sets", help="comma-separated feature sets joined by '+', 'none' for one class (default: the ablation rows)"
    )
    ap.add_argument(
        "--stamps", default="free",
        help="comma-separated idle-time origins to run each set with: free (the release), lookup (the request's start)",
    )
    ap.add_argument(
        "--classes", default="0",
        help="comma-separated learned class counts to run each set with (0: the set's own key)",
    )
    ap.add_argument("--family", default=DEFAULT_SCORE[0], help="reuse-model family of every candidate")
    ap.add_argument("--mode", default=DEFAULT_SCORE[1], help="score mode of every candidate (pr, posterior, density, ttl)")
    ap.add_argument(
        "--horizon", type=float, default=DEFAULT_SCORE[2],
        help="every candidate's L in seconds (for ttl: the break-even hold time)",
    )
    ap.add_argument("--controller-config", help="controller knobs (the candidate list is replaced)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    sets = default_sets() if not args.sets else [() if s == "none" else tuple(s.split("+")) for s in args.sets.split(",")]
    stamps = tuple(args.stamps.split(","))
    try:
        classes = tuple(int(k) for k in args.classes.split(","))
    except ValueError:
        ap.error(f"--classes takes comma-separated integers, got {args.classes!r}")
    score: Score = (args.family, args.mode, args.horizon)
    base = ControllerConfig.load(args.controller_config) if args.controller_config else ControllerConfig()
    for s in sets:
        for st in stamps:  # unknown features, stamps or class counts fail here, before the trace loads
            for k in classes:
                ControllerConfig(candidates=(candidate(s, st, k, score),))
    t0 = time.perf_counter()
    trace = load_trace_cached(args.trace, agentic=AgenticOptions(max_conversations=args.conversations))
    setup = prepare(trace, ["lru", "opt", "wa-online"], ReplayConfig())
    (size,) = resolve_sizes(args.size, setup.trace, setup.eval_start)
    rows = ablation(setup, size, sets, base, jobs=args.jobs, stamps=stamps, classes=classes, score=score)
    print(format_table(trace.name, size, rows))
    print(f"took {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": trace.name, "cache_blocks": size, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

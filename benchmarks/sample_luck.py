"""How much a ``wa-online`` hit rate owes to the sample its miniature caches saw.

The tuner decides on hash-sampled blocks, so which blocks happen to be
sampled moves its switches, and with them the real cache's hit rate. A
served engine draws its sample from vLLM's block hashes, which change with
the hash seed: the sample drawn is luck, not a setting. This replays
``wa-online`` at several sampling salts (``sample_salt``; 0 is the default
sample) at each size and reports the spread beside ``lru``:

    python benchmarks/sample_luck.py TRACE --sizes 15%,20% --salts 0-4 [--controller-config C] \
        [--cut S] [--seed N] [--jobs 2] [--json out.json]

A difference between two settings smaller than the spread of one is not
measured by a single run of each; a target a run misses by less than it is
reported with the runs beside it, not as met.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

from vllm_wa.controller.config import ControllerConfig
from vllm_wa.replay.loaders import AgenticOptions
from vllm_wa.replay.online_policy import OnlineWAPolicy
from vllm_wa.replay.parallel import map_jobs
from vllm_wa.replay.runner import ReplayConfig, SweepSetup, make_policy, prepare, resolve_sizes, run_one
from vllm_wa.replay.trace_cache import load_trace_cached
from vllm_wa.validation import parse_int_range

_SETUP: tuple[SweepSetup, ControllerConfig] | None = None  # set in the parent, shared by the forked workers


@dataclass(frozen=True)
class Job:
    """One run: ``lru`` (salt None) or ``wa-online`` at one salt, at one size."""

    size: str  # as asked (the table's label)
    blocks: int
    salt: int | None


def run(job: Job) -> tuple[Job, float, int]:
    """The job's token hit rate and its number of switches (0 for ``lru``)."""
    assert _SETUP is not None
    setup, base = _SETUP
    if job.salt is None:
        res = run_one(setup.trace, make_policy("lru", setup), job.blocks, setup.cfg, setup.eval_start)
        return job, res.token_hit_rate, 0
    policy = OnlineWAPolicy.create(replace(base, sample_salt=job.salt), setup.trace)
    res = run_one(setup.trace, policy, job.blocks, setup.cfg, setup.eval_start)
    return job, res.token_hit_rate, len(res.extra["switches"])


def summarize(size: str, lru: float, runs: list[tuple[int, float, int]]) -> dict[str, Any]:
    """One size's row: every salt's hit rate (%) and their spread, with ``lru``'s."""
    rates = [100 * r for _, r, _ in runs]
    return {
        "size": size,
        "lru": 100 * lru,
        "runs": [{"salt": s, "token_hit_rate": 100 * r, "switches": n} for s, r, n in runs],
        "mean": statistics.fmean(rates),
        "sd": statistics.stdev(rates) if len(rates) > 1 else math.nan,
        "min": min(rates),
        "max": max(rates),
    }


def format_table(trace: str, rows: list[dict[str, Any]]) -> str:
    salts = [r["salt"] for r in rows[0]["runs"]]
    head = f"{'size':>6} {'lru':>7} " + " ".join(f"{'s' + str(s):>7}" for s in salts)
    lines = [f"{trace}: token hit rate % of wa-online at each sampling salt", head + "    mean     sd   mean-lru  min-lru"]
    for r in rows:
        cells = " ".join(f"{x['token_hit_rate']:>7.2f}" for x in r["runs"])
        lines.append(
            f"{r['size']:>6} {r['lru']:>7.2f} {cells} {r['mean']:>7.2f} {r['sd']:>6.2f}"
            f" {r['mean'] - r['lru']:>+10.2f} {r['min'] - r['lru']:>+8.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--sizes", required=True, help="cache sizes: blocks, or %% of the evaluation window's unique blocks")
    ap.add_argument("--salts", default="0-4", help="sampling salts, as 0-4 or 0,3,7 (0: the default sample)")
    ap.add_argument("--controller-config", help="TOML controller config (default: the defaults)")
    ap.add_argument("--cut", type=float, help="drop requests arriving this many seconds after the trace's first")
    ap.add_argument("--seed", type=int, default=0, help="agentic: seed of the conversations' offsets")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    try:
        salts = parse_int_range("--salts", args.salts)
        base = ControllerConfig.load(args.controller_config) if args.controller_config else ControllerConfig()
    except ValueError as e:  # ConfigError too: a bad salt or config stops here, before the trace loads
        raise SystemExit(str(e)) from None
    sizes = [s for s in args.sizes.split(",") if s]
    t0 = time.perf_counter()
    trace = load_trace_cached(args.trace, agentic=AgenticOptions(seed=args.seed), cut=args.cut)
    cfg = ReplayConfig(controller_config=base)
    setup = prepare(trace, ["lru", "wa-online"], cfg)
    try:
        blocks = {size: resolve_sizes(size, setup.trace, setup.eval_start)[0] for size in sizes}
    except ValueError as e:
        raise SystemExit(str(e)) from None
    jobs = [Job(size, blocks[size], salt) for size in sizes for salt in (None, *salts)]
    global _SETUP
    _SETUP = (setup, base)
    try:
        done = list(map_jobs(run, jobs, args.jobs))
    finally:
        _SETUP = None
    rows = []
    for size in sizes:
        mine = [(j, r, n) for j, r, n in done if j.size == size]
        lru = next(r for j, r, _ in mine if j.salt is None)
        rows.append(summarize(size, lru, [(j.salt, r, n) for j, r, n in mine if j.salt is not None]))
    name = os.path.basename(args.trace)
    print(format_table(name, rows))
    print(f"took {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            meta = {"trace": name, "cut": args.cut, "seed": args.seed, "controller_config": args.controller_config}
            json.dump({**meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

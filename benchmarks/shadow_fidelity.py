"""Shadow fidelity: the hit rate a candidate's miniature cache predicts vs the candidate at full size.

For every (trace, cache size):

* **Predicted**, per sampling scheme (``shadow_sampling`` = ``block`` and
  ``chain``): one ``wa-online`` replay with the tuner off, the real cache on
  LRU; every candidate's miniature cache sees the sampled lookups.  Its
  prediction is its sampled hit rate over the evaluation window (the
  replay's second half): hit blocks / looked-up blocks of the sampled
  requests that arrive in the window, summed as the tuner sums them
  (``Tuner.record``), so block-weighted.
* **Full**: the candidate alone at full size: ``wa-online`` with the tuner
  off and ``initial`` = the candidate (LRU: the plain ``lru`` policy); its
  block hit rate over the same evaluation window (its token hit rate is in
  the JSON too; the two differ only by partial last blocks).

Per scheme and size: the mean absolute error and the mean signed error
(bias) of predicted vs full over the candidates, the error of the lead over
LRU (what the tuner acts on), and the Spearman rank correlation of
predicted vs full across candidates.

    python benchmarks/shadow_fidelity.py TRACE... --sizes 5%,10%,20% [--conversations N] [--cut S] [--jobs J]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vllm_wa.controller.config import SHADOW_SAMPLING, ControllerConfig
from vllm_wa.controller.tuner import Tuner
from vllm_wa.replay.loaders import AgenticOptions
from vllm_wa.replay.online_policy import OnlineWAPolicy
from vllm_wa.replay.parallel import map_jobs
from vllm_wa.replay.policies import ReplayPolicy
from vllm_wa.replay.runner import ReplayConfig, resolve_sizes, run_one
from vllm_wa.replay.trace import Trace
from vllm_wa.replay.trace_cache import load_trace_cached
from vllm_wa.replay.tuner_probe import TunerProbePolicy

LRU = "lru"


@dataclass
class ProbedOnlinePolicy(TunerProbePolicy):
    """``wa-online`` that also sums every miniature cache's sampled hits from ``eval_start`` on.

    The sums are taken where the tuner takes them (``Tuner.record``: one call
    per sampled request, with its sampled blocks and each cache's hits), so
    they are exactly the paired evidence the tuner compares, over the whole
    evaluation window instead of the tuner's sliding window.
    """

    eval_start: float = -math.inf
    hits: np.ndarray | None = None
    lookups: int = 0
    requests: int = 0

    def on_tap(self, tuner: Tuner) -> None:
        self.hits = np.zeros(len(tuner.names), dtype=np.int64)

    def on_record(self, t: float, lookups: int, hits: list[int], real: int | None) -> None:
        if t >= self.eval_start and self.hits is not None:
            self.hits += hits
            self.lookups += lookups
            self.requests += 1

    def predicted(self) -> dict[str, float]:
        assert self.controller is not None and self.hits is not None
        names = self.controller.tuner.names
        return {n: float(self.hits[i]) / self.lookups if self.lookups else math.nan for i, n in enumerate(names)}


# ---- runs --------------------------------------------------------------------------------------


@dataclass
class Setup:
    trace: Trace
    replay: ReplayConfig
    base: ControllerConfig
    eval_start: float


_SETUP: Setup | None = None


def predict(setup: Setup, size: int, scheme: str) -> dict[str, Any]:
    """One wa-online replay on LRU, tuner off: each candidate's predicted hit rate."""
    cfg = replace(setup.base, tuner_enabled=False, initial=LRU, shadow_sampling=scheme)
    pol = ProbedOnlinePolicy("wa-online", config=cfg, eval_start=setup.eval_start)
    res = run_one(setup.trace, pol, size, setup.replay, setup.eval_start)
    pol.flush()
    c = pol.controller
    assert c is not None
    return {
        "predicted": pol.predicted(),
        "sampled_lookups": pol.lookups,
        "sampled_requests": pol.requests,
        "sample_rate": c.sink.sample_rate,
        "chain_rate": c.sink.chain_rate,
        "shadow_blocks": c.shadow_blocks,
        "live_block_hit_rate": res.block_hit_rate,
        "wall_s": res.wall_s,
    }


def full_size(setup: Setup, size: int, name: str) -> dict[str, Any]:
    """The candidate alone at full size (LRU: the plain ``lru`` policy)."""
    if name == LRU:
        pol: ReplayPolicy = ReplayPolicy(LRU)
    else:
        pol = OnlineWAPolicy.create(replace(setup.base, tuner_enabled=False, initial=name), setup.trace)
    res = run_one(setup.trace, pol, size, setup.replay, setup.eval_start)
    return {
        "block_hit_rate": res.block_hit_rate,
        "token_hit_rate": res.token_hit_rate,
        "requests": res.requests,
        "overflow": res.overflow,
        "wall_s": res.wall_s,
    }


def _run_task(task: tuple[str, int, str]) -> tuple[tuple[str, int, str], dict[str, Any]]:
    assert _SETUP is not None
    kind, size, what = task
    out = predict(_SETUP, size, what) if kind == "predict" else full_size(_SETUP, size, what)
    return task, out


def candidate_names(base: ControllerConfig) -> list[str]:
    return [c.name for c in base.all_candidates]


def fidelity(
    trace: Trace,
    sizes: Sequence[int],
    base: ControllerConfig | None = None,
    replay: ReplayConfig | None = None,
    schemes: Sequence[str] = SHADOW_SAMPLING,
    jobs: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Predicted (per scheme) and full-size hit rates of every candidate at every size, with summaries."""
    global _SETUP
    base = base or ControllerConfig()
    replay = replay or ReplayConfig()
    eval_start = trace.eval_start(replay.profile_fraction)
    names = candidate_names(base)
    tasks: list[tuple[str, int, str]] = []
    for n in sizes:
        tasks += [("predict", n, s) for s in schemes]
        tasks += [("full", n, name) for name in names]
    _SETUP = Setup(trace, replay, base, eval_start)
    done: dict[tuple[str, int, str], dict[str, Any]] = {}
    t0 = time.perf_counter()
    try:
        for task, out in map_jobs(_run_task, tasks, jobs, ordered=False):
            done[task] = out
            if progress:
                progress(f"{trace.name}: {task[0]} {task[2]} @ {task[1]} ({out['wall_s']:.0f} s)")
    finally:
        _SETUP = None
    sizes_out = []
    for n in sizes:
        rows = []
        for name in names:
            full = done[("full", n, name)]
            row = {"candidate": name, "full": full["block_hit_rate"], "full_token": full["token_hit_rate"]}
            for s in schemes:
                row[s] = done[("predict", n, s)]["predicted"][name]
            rows.append(row)
        entry: dict[str, Any] = {"cache_blocks": n, "rows": rows, "schemes": {}}
        for s in schemes:
            p = done[("predict", n, s)]
            entry["schemes"][s] = {
                **summarize(rows, s),
                **{k: v for k, v in p.items() if k != "predicted"},
            }
        sizes_out.append(entry)
    return {
        "trace": trace.name,
        "requests": len(trace.requests),
        "eval_start": eval_start,
        "candidates": names,
        "schemes": list(schemes),
        "sizes": sizes_out,
        "best": best_scheme(sizes_out, schemes),
        "wall_s": time.perf_counter() - t0,
    }


# ---- statistics --------------------------------------------------------------------------------


def _ranks(x: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties averaged."""
    a = np.asarray(x, dtype=np.float64)
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(len(a))
    i = 0
    while i < len(a):
        j = i
        while j + 1 < len(a) and a[order[j + 1]] == a[order[i]]:
            j += 1
        ranks[order[i: j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (nan when either side is constant or has fewer than 2 values)."""
    if len(x) < 2:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    rx -= rx.mean()
    ry -= ry.mean()
    den = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry) / den if den > 0 else math.nan


def summarize(rows: list[dict[str, Any]], scheme: str) -> dict[str, float]:
    full = np.array([r["full"] for r in rows])
    pred = np.array([r[scheme] for r in rows])
    err = pred - full
    lru = next((i for i, r in enumerate(rows) if r["candidate"] == LRU), None)
    out = {
        "mae": float(np.mean(np.abs(err))),
        "bias": float(np.mean(err)),
        "max_abs_error": float(np.max(np.abs(err))),
        "spearman": spearman(pred, full),
    }
    if lru is not None and len(rows) > 1:
        others = [i for i in range(len(rows)) if i != lru]
        lead_err = (pred[others] - pred[lru]) - (full[others] - full[lru])
        out["lead_mae"] = float(np.mean(np.abs(lead_err)))
        out["lead_spearman"] = spearman(pred[others] - pred[lru], full[others] - full[lru])
    return out


def best_scheme(sizes: list[dict[str, Any]], schemes: Sequence[str]) -> dict[str, Any]:
    """The scheme with the lowest MAE averaged over sizes (and its mean Spearman)."""
    score = {}
    for s in schemes:
        maes = [e["schemes"][s]["mae"] for e in sizes]
        rhos = [e["schemes"][s]["spearman"] for e in sizes if not math.isnan(e["schemes"][s]["spearman"])]
        score[s] = {"mean_mae": float(np.mean(maes)), "mean_spearman": float(np.mean(rhos)) if rhos else math.nan}
    by_mae = min(schemes, key=lambda s: score[s]["mean_mae"])
    ranked = [s for s in schemes if not math.isnan(score[s]["mean_spearman"])]
    by_rank = max(ranked, key=lambda s: score[s]["mean_spearman"]) if ranked else None
    return {"by_mae": by_mae, "by_spearman": by_rank, "scores": score}


# ---- report ------------------------------------------------------------------------------------


def _f(x: float, w: int = 6, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-".rjust(w)
    return (f"{x:+.3f}" if signed else f"{x:.3f}").rjust(w)


def format_table(res: dict[str, Any]) -> str:
    schemes = res["schemes"]
    sizes = res["sizes"]
    width = max(len(n) for n in res["candidates"]) + 2
    cols = ["full", *schemes]
    cell = 7 * len(cols)
    lines = [f"== {res['trace']}: {res['requests']} requests, evaluation from t={res['eval_start']:.0f} s"]
    head = "candidate".ljust(width) + "".join(f"| {str(e['cache_blocks']) + ' blocks':<{cell}}" for e in sizes)
    sub = " " * width + "".join("| " + "".join(c[:6].rjust(6) + " " for c in cols)[:-1] + " " for _ in sizes)
    lines += [head, sub, "-" * len(sub)]
    for i, name in enumerate(res["candidates"]):
        line = name.ljust(width)
        for e in sizes:
            r = e["rows"][i]
            line += "| " + " ".join(_f(r[c]) for c in cols) + " "
        lines.append(line)
    lines.append("-" * len(sub))
    for s in schemes:
        for label, key, signed in (
            ("MAE", "mae", False),
            ("bias", "bias", True),
            ("Spearman", "spearman", True),
            ("lead-vs-LRU MAE", "lead_mae", False),
            ("lead Spearman", "lead_spearman", True),
        ):
            line = f"{s} {label}".ljust(width)
            for e in sizes:
                line += "| " + _f(e["schemes"][s].get(key, math.nan), cell - 2, signed) + " "
            lines.append(line)
    for s in schemes:
        line = f"{s} sampled lookups".ljust(width)
        for e in sizes:
            p = e["schemes"][s]
            line += "| " + f"{p['sampled_lookups']} @ {p['shadow_blocks']} blk".rjust(cell - 2) + " "
        lines.append(line)
    b = res["best"]
    sc = ", ".join(
        f"{s}: mean MAE {v['mean_mae']:.4f}, mean Spearman {v['mean_spearman']:+.3f}" for s, v in b["scores"].items()
    )
    lines.append(f"best by MAE: {b['by_mae']}; best by Spearman: {b['by_spearman']}  ({sc})")
    return "\n".join(lines)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def write_json(path: str, args: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """What ``--json`` writes: strict JSON (a NaN, such as an undefined rank correlation, as null)."""
    with open(path, "w") as f:
        json.dump(_jsonable({"args": args, "results": results}), f, indent=1, allow_nan=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", metavar="TRACE")
    p.add_argument("--sizes", default="5%,10%,20%", help="cache sizes: blocks, or %% of the evaluation window's unique blocks")
    p.add_argument("--conversations", type=int, help="agentic traces: use this many conversations (seeded sample)")
    p.add_argument("--seed", type=int, default=0, help="agentic: seed of the conversation sample and offsets")
    p.add_argument("--cut", type=float, help="drop requests arriving this many seconds after the trace's first")
    p.add_argument("--schemes", default=",".join(SHADOW_SAMPLING), help="comma list of shadow_sampling schemes")
    p.add_argument("--controller-config", help="TOML controller config (default: the defaults)")
    p.add_argument("--jobs", type=int, default=1, help="parallel replays (processes)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    base = ControllerConfig.load(args.controller_config) if args.controller_config else ControllerConfig()
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in schemes if s not in SHADOW_SAMPLING]
    if bad:
        p.error(f"unknown schemes {bad}; expected some of {SHADOW_SAMPLING}")
    replay = ReplayConfig()
    results = []
    for path in args.traces:
        trace = load_trace_cached(
            path, agentic=AgenticOptions(max_conversations=args.conversations, seed=args.seed), cut=args.cut
        )
        sizes = resolve_sizes(args.sizes, trace, trace.eval_start(replay.profile_fraction))
        res = fidelity(trace, sizes, base, replay, schemes, jobs=args.jobs,
                       progress=lambda m: print(m, file=sys.stderr, flush=True))
        res["path"] = path
        res["size_spec"] = args.sizes
        results.append(res)
        print(format_table(res), flush=True)
        print(flush=True)
    if args.json:
        write_json(args.json, vars(args), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

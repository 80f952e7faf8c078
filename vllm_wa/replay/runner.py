"""Replay a trace through each (policy, cache size) and measure prefix-cache hits.

Every policy replays the whole trace on the same timeline; hits count only
for requests arriving after the profiling window, so all policies are warmed
identically and measured on the same requests.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import multiprocessing as mp
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from vllm_wa.controller.config import ControllerConfig
from vllm_wa.params import WAParams
from vllm_wa.replay.belady import next_use_table
from vllm_wa.replay.engines import make_engine
from vllm_wa.replay.lifetime import LifetimeModel
from vllm_wa.replay.online_policy import OnlineWAPolicy
from vllm_wa.replay.parallel import worker_count
from vllm_wa.replay.peers import PEERS
from vllm_wa.replay.policies import POLICIES, OptPolicy, PeerPolicy, ReplayPolicy, StaticWAPolicy
from vllm_wa.replay.profile import profile_trace
from vllm_wa.replay.progress import REPORT_EVERY, ProgressBoard, RunReporter
from vllm_wa.replay.trace import Trace, renumber_ids
from vllm_wa.sim.clock import SettableClock
from vllm_wa.validation import check_number


@dataclass
class RunResult:
    """Hit counts of one policy at one cache size, over the evaluation window."""

    trace: str
    policy: str
    cache_blocks: int
    engine: str
    requests: int = 0
    overflow: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    hit_blocks: int = 0
    prompt_blocks: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time for the run (wall_s includes waiting for a core)
    windows: list[dict[str, float]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["token_hit_rate"] = self.token_hit_rate
        d["block_hit_rate"] = self.block_hit_rate
        return d


@dataclass
class ReplayConfig:
    """How to replay; shared by every run of a sweep."""

    engine: str = "fast"
    profile_fraction: float = 0.5
    lifetime: LifetimeModel = field(default_factory=LifetimeModel)
    window_seconds: float | None = None
    tag_swap: tuple[str, str] | None = None
    controller_config: ControllerConfig | None = None  # for wa-online (default config when None)

    def __post_init__(self) -> None:
        if not 0.0 <= self.profile_fraction < 1.0:
            raise ValueError(f"profile fraction must be in [0, 1), got {self.profile_fraction}")
        if self.window_seconds is not None:
            check_number("window seconds", self.window_seconds, gt=0)


def swap_tags(trace: Trace, swap: tuple[str, str], since: float) -> Trace:
    """From ``since`` on, requests tagged A are tagged B and the other way round.

    A tag the evaluated part does not have is an error (a typo would
    otherwise swap nothing and report the unshifted trace as the shift).
    """
    a, b = swap
    present = {r.tag for r in trace.requests if r.arrival >= since}
    missing = [t for t in (a, b) if t not in present]
    if missing:
        raise ValueError(f"--tag-swap: no request from t={since:g}s on is tagged {missing}; tags there: {sorted(present)[:10]}")
    out = []
    for r in trace.requests:
        if r.arrival >= since and r.tag in (a, b):
            r = replace(r, tag=b if r.tag == a else a)
        out.append(r)
    return trace.with_requests(out)


# Replays of a policy that learns which requests do not fit (``opt``): the set
# a pass finds feeds the next, until it stops changing. The first pass is
# told the set an LRU scout found (``scout_unserved``); mostly it is right.
MAX_UNSERVED_PASSES = 3


def unbounded_blocks(trace: Trace) -> int:
    """A pool that never evicts on ``trace``: every unique block plus one per request."""
    return trace.unique_blocks() + len(trace.requests) + 2


def peak_demand(trace: Trace, finish: np.ndarray) -> int:
    """The most prompt blocks the requests running at one time could hold.

    A request needs at most its prompt's blocks, whatever the eviction policy
    (hits on blocks another request holds need none), so no request overflows
    a pool with this many free blocks. At one time, arrivals count before
    finishes: the bound may be high, never low.
    """
    reqs = trace.requests
    n = len(reqs)
    lengths = np.fromiter((len(r.hash_ids) for r in reqs), dtype=np.int64, count=n)
    arrivals = np.fromiter((r.arrival for r in reqs), dtype=np.float64, count=n)
    times = np.concatenate([arrivals, finish])
    deltas = np.concatenate([lengths, -lengths])
    is_finish = np.concatenate([np.zeros(n, dtype=np.int8), np.ones(n, dtype=np.int8)])
    order = np.lexsort((is_finish, times))
    return int(np.cumsum(deltas[order]).max(initial=0))


def scout_unserved(
    trace: Trace, num_blocks: int, cfg: ReplayConfig, finish: np.ndarray, progress: RunReporter | None = None
) -> list[int]:
    """The requests that do not fit a pool of ``num_blocks`` under LRU (trace indices).

    Whether a request fits depends on the blocks running requests hold, and
    they hold every block of their prompts whichever blocks the policy kept
    free: so the set is close to any policy's, and an LRU replay finds it at
    a fifth of a Belady pass's cost (7 against 69 CPU s on the agentic split at
    5 %, the same 4,927 requests). None when no request can overflow (a served
    trace's replies also take blocks, so its bound is not checked).
    """
    if trace.fmt != "served" and peak_demand(trace, finish) < num_blocks:  # the null block takes one
        return []
    if progress is not None:
        progress.new_pass("LRU scout for requests that do not fit")
    _, _, seen = _replay_pass(trace, finish, ReplayPolicy("lru"), num_blocks, cfg, math.inf, progress)
    return seen


def _replay_pass(
    trace: Trace,
    finish: np.ndarray,
    policy: ReplayPolicy,
    num_blocks: int,
    cfg: ReplayConfig,
    eval_start: float,
    progress: RunReporter | None,
) -> tuple[RunResult, dict[int, list[int]], list[int]]:
    """One replay of the whole trace on a fresh pool: its counts, per-window hits, and unserved requests."""
    clock = SettableClock(trace.start)
    engine = make_engine(cfg.engine, trace, policy, num_blocks, clock)
    res = RunResult(trace.name, policy.name, num_blocks, cfg.engine)
    win_hits: dict[int, list[int]] = {}
    seen: list[int] = []
    _replay_loop(trace, finish, engine, policy, res, cfg, eval_start, win_hits, progress, clock, seen)
    return res, win_hits, seen


def run_one(
    trace: Trace,
    policy: ReplayPolicy,
    num_blocks: int,
    cfg: ReplayConfig,
    eval_start: float,
    progress: RunReporter | None = None,
) -> RunResult:
    """Replay ``trace`` through ``policy`` in a pool of ``num_blocks`` blocks."""
    if policy.unbounded:
        num_blocks = unbounded_blocks(trace)
    win = cfg.window_seconds
    t0, c0 = time.perf_counter(), time.process_time()
    # The replay allocates millions of small long-lived objects; the cyclic
    # collector would rescan them all again and again (3x slower runs).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        unserved: list[int] = []
        finish = cfg.lifetime.finish_times(trace)
        if policy.replays_unserved:
            unserved = scout_unserved(trace, num_blocks, cfg, finish, progress)
            if unserved:
                policy.skip_unserved(trace, unserved)
        for run in range(MAX_UNSERVED_PASSES):
            if progress is not None and (run or policy.replays_unserved):
                progress.new_pass(f"pass {run + 1}")
            res, win_hits, seen = _replay_pass(trace, finish, policy, num_blocks, cfg, eval_start, progress)
            if not policy.replays_unserved or seen == unserved:
                break
            # Told which requests will not fit, the policy replays the trace again
            # (Belady's future: a request that does not fit uses nothing).
            unserved = seen
            policy.skip_unserved(trace, unserved)
    finally:
        if gc_was_enabled:
            gc.enable()
    res.wall_s = time.perf_counter() - t0
    res.cpu_s = time.process_time() - c0
    if win is not None:
        res.windows = [
            {"start": trace.start + k * win, "token_hit_rate": h / p if p else 0.0, "prompt_tokens": p}
            for k, (h, p) in sorted(win_hits.items())
        ]
    res.extra = policy.report()
    return res


def _replay_loop(
    trace: Trace,
    finish: np.ndarray,
    engine: Any,
    policy: ReplayPolicy,
    res: RunResult,
    cfg: ReplayConfig,
    eval_start: float,
    win_hits: dict[int, list[int]],
    progress: RunReporter | None,
    clock: SettableClock,
    unserved: list[int],
) -> None:
    """Replay every request; ``finish`` holds their finish times, ``unserved`` collects those that did not fit."""
    bs = trace.block_size
    finishing: list[tuple[float, int]] = []
    reqs = trace.requests
    win = cfg.window_seconds
    for i, req in enumerate(reqs):
        t = req.arrival
        while finishing and finishing[0][0] <= t:
            ft, j = heapq.heappop(finishing)
            clock.t = ft
            policy.advance(ft)
            engine.release(reqs[j])
        clock.t = t
        policy.advance(t)
        n_hit = engine.admit(i, req)
        if n_hit >= 0:
            heapq.heappush(finishing, (float(finish[i]), i))
        else:
            unserved.append(i)
        hit_tokens = min(n_hit * bs, req.input_tokens) if n_hit > 0 else 0
        if t >= eval_start:
            res.requests += 1
            res.prompt_tokens += req.input_tokens
            res.prompt_blocks += len(req.hash_ids)
            if n_hit < 0:
                res.overflow += 1
            else:
                res.hit_blocks += n_hit
                res.hit_tokens += hit_tokens
        if win is not None:
            w = win_hits.setdefault(int((t - trace.start) // win), [0, 0])
            w[0] += hit_tokens
            w[1] += req.input_tokens
        if progress is not None and i % REPORT_EVERY == REPORT_EVERY - 1:
            progress(REPORT_EVERY)
    if progress is not None:
        progress(len(reqs) % REPORT_EVERY)


# ---- sweeps ------------------------------------------------------------------------------


@dataclass
class SweepSetup:
    """What every run of a sweep shares, computed once in the parent process."""

    trace: Trace
    cfg: ReplayConfig
    eval_start: float
    offline_params: WAParams | None = None
    reprofiled_params: WAParams | None = None
    next_req: Any = None
    offsets: Any = None
    # Knob setting of each peer that has one (chosen on the profile half).
    peer_settings: dict[str, float] = field(default_factory=dict)
    # The profile half as a replay of its own (``replay.knobs.profile_setup``),
    # where runs of ``part="profile"`` tasks replay; set before they run.
    profile_half: SweepSetup | None = None


def prepare(trace: Trace, policies: Sequence[str], cfg: ReplayConfig) -> SweepSetup:
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; expected some of {POLICIES}")
    eval_start = trace.eval_start(cfg.profile_fraction)
    if cfg.engine == "fast":
        # vLLM's engine hashes token ids made from the file's ids; keep those.
        trace = renumber_ids(trace)
    if cfg.tag_swap is not None:
        trace = swap_tags(trace, cfg.tag_swap, eval_start)
    setup = SweepSetup(trace, cfg, eval_start)
    if "wa-offline" in policies:
        setup.offline_params = profile_trace(trace, eval_start, cfg.lifetime)
    if "wa-reprofiled" in policies:
        # The PR workflow re-run on the evaluation window itself: what a fresh
        # offline profile of the new traffic would give (a reference for shifts).
        setup.reprofiled_params = profile_trace(trace, trace.end + 1.0, cfg.lifetime, since=eval_start)
    if "opt" in policies:
        setup.next_req, setup.offsets = next_use_table(trace)
    return setup


def make_peer(name: str, setup: SweepSetup, setting: float | None = None) -> PeerPolicy:
    """Peer ``name`` at ``setting`` (default: the setup's chosen one, else the knob's default)."""
    spec = PEERS[name]
    if setting is None and spec.knob is not None:
        setting = setup.peer_settings.get(name, spec.knob.default)
    return PeerPolicy(
        name,
        spec=spec,
        setting=setting,
        block_size=setup.trace.block_size,
        conversations=setup.trace.conversations,
        outcomes=setup.trace.has_outcomes,
        prefill_tokens_per_s=setup.cfg.lifetime.prefill_tokens_per_s,
    )


def make_policy(name: str, setup: SweepSetup) -> ReplayPolicy:
    if name in PEERS:
        return make_peer(name, setup)
    if name == "lru":
        return ReplayPolicy("lru")
    if name == "infinite":
        return ReplayPolicy("infinite", unbounded=True)
    if name == "wa-offline":
        return StaticWAPolicy("wa-offline", params=setup.offline_params)
    if name == "wa-reprofiled":
        return StaticWAPolicy("wa-reprofiled", params=setup.reprofiled_params)
    if name == "opt":
        return OptPolicy("opt", next_req=setup.next_req, offsets=setup.offsets)
    if name == "wa-online":
        return OnlineWAPolicy.create(setup.cfg.controller_config, setup.trace)
    raise ValueError(f"unknown policy {name!r}")


@dataclass(frozen=True)
class Task:
    """One run: a policy at a cache size (a peer at a given knob setting, if set).

    ``part`` is what it replays: ``"full"``, the whole trace, or ``"profile"``,
    the profile half (``SweepSetup.profile_half``), where peers' knobs are tuned.
    """

    policy: str
    blocks: int
    setting: float | None = None
    part: str = "full"

    def label(self) -> str:
        knob = PEERS[self.policy].knob if self.policy in PEERS else None
        setting = f" {knob.label(self.setting)}" if knob is not None and self.setting is not None else ""
        half = " (profile half)" if self.part == "profile" else ""
        return f"{self.policy}{setting} @{self.blocks}{half}"


# CPU time of a run relative to LRU's (the agentic split's sweep, 2026-12-02
# 16:05, with ARC's in-order runs), to start the longest first.
RUN_COST = {
    "wa-online": 5.4,
    "arc": 4.5,
    "opt": 4.4,
    "lfu": 3.5,
    "tlru": 3.4,
    "slru": 3.4,
    "session": 3.2,
    "ttl-tool": 2.6,
    "wa-offline": 1.9,
    "wa-reprofiled": 1.9,
}

# A task that follows a finished run: the runs it releases (e.g. a peer's
# sweep once its knob is chosen on the profile half).
FollowUp = Callable[[Task, RunResult], Sequence[Task]]

# What forked workers run: the setup and where progress goes.
_RUN: tuple[SweepSetup, Any] | None = None


def _run_task(item: tuple[int, Task]) -> RunResult:
    assert _RUN is not None
    setup, sink = _RUN
    run, task = item
    if task.part == "profile":
        assert setup.profile_half is not None, "profile-half runs need SweepSetup.profile_half"
        setup = setup.profile_half
    if task.setting is not None:
        policy = make_peer(task.policy, setup, task.setting)
    else:
        policy = make_policy(task.policy, setup)
    reporter = RunReporter(sink, run, task.label(), len(setup.trace.requests)) if sink is not None else None
    try:
        return run_one(setup.trace, policy, task.blocks, setup.cfg, setup.eval_start, progress=reporter)
    finally:
        if reporter is not None:
            reporter.close()


def _priority(task: Task) -> tuple[bool, float]:
    # Profile-half runs first (a peer's sweep waits for its knob), then the costliest.
    return task.part == "profile", RUN_COST.get(task.policy, 1.0)


def run_tasks(
    setup: SweepSetup,
    tasks: Sequence[Task],
    jobs: int = 0,
    on_result: Callable[[RunResult], None] | None = None,
    board: ProgressBoard | None = None,
    follow: FollowUp | None = None,
) -> list[RunResult]:
    """Run ``tasks`` in ``jobs`` processes, the costliest ready one next; results in completion order.

    ``follow`` is told each finished task and its result, in this process, and
    may release more tasks: they join the ready ones at once, so no run waits
    for a whole phase to end.
    """
    global _RUN
    ready = list(tasks)
    jobs = worker_count(jobs)
    if follow is None:
        jobs = min(jobs, len(ready))
    results: list[RunResult] = []
    live = board is not None and board.enabled
    ids = itertools.count()

    def take() -> tuple[int, Task]:
        # The costliest; among equals the first released (a stable order).
        best = max(range(len(ready)), key=lambda k: (_priority(ready[k]), -k))
        return next(ids), ready.pop(best)

    def done(task: Task, r: RunResult) -> None:
        results.append(r)
        if on_result:
            on_result(r)
        if follow:
            ready.extend(follow(task, r))

    try:
        if jobs <= 1 or (len(ready) <= 1 and follow is None):
            _RUN = (setup, board if live else None)
            while ready:
                item = take()
                done(item[1], _run_task(item))
        else:
            ctx = mp.get_context("fork")
            _RUN = (setup, board.open_queue(ctx) if live else None)
            finished: queue.SimpleQueue[tuple[Task, RunResult | None, BaseException | None]] = queue.SimpleQueue()
            with ctx.Pool(jobs) as pool:
                if live:
                    board.drain_in_background()
                running = 0
                while ready or running:
                    while ready and running < jobs:
                        item = take()
                        pool.apply_async(
                            _run_task,
                            (item,),
                            callback=lambda r, t=item[1]: finished.put((t, r, None)),
                            error_callback=lambda e, t=item[1]: finished.put((t, None, e)),
                        )
                        running += 1
                    task, r, err = finished.get()
                    running -= 1
                    if err is not None:
                        raise err
                    assert r is not None
                    done(task, r)
    finally:
        _RUN = None
        if live:
            board.close()
    return results


def sweep_tasks(policies: Sequence[str], sizes: Sequence[int]) -> list[Task]:
    """Every (policy, size); ``infinite`` once, at the largest size."""
    return [Task(p, n) for p in policies for n in ([sizes[-1]] if p == "infinite" else sizes)]


def sort_results(results: list[RunResult], policies: Sequence[str]) -> list[RunResult]:
    """In the order of ``policies``, then by cache size."""
    order = {p: i for i, p in enumerate(policies)}
    return sorted(results, key=lambda r: (order[r.policy], r.cache_blocks))


def sweep(
    setup: SweepSetup,
    policies: Sequence[str],
    sizes: Sequence[int],
    jobs: int = 0,
    on_result: Callable[[RunResult], None] | None = None,
    board: ProgressBoard | None = None,
) -> list[RunResult]:
    """Run every (policy, size); ``infinite`` runs once. Parallel over processes."""
    return sort_results(run_tasks(setup, sweep_tasks(policies, sizes), jobs, on_result, board), policies)


def parse_sizes(spec: str) -> list[tuple[str, float | int]]:
    """``--cache-blocks`` as ``("blocks", n)`` and ``("percent", p)`` entries;
    ValueError naming the option (checked before any trace is loaded)."""
    out: list[tuple[str, float]] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if part.endswith("%"):
                out.append(("percent", check_number(f"{part!r} (percent)", float(part[:-1]), gt=0)))
            else:
                out.append(("blocks", check_number(f"{part!r} (blocks)", int(part), ge=2, integer=True)))
        except ValueError as e:
            raise ValueError(f"--cache-blocks: {e}; expected block counts (at least 2) or percentages, as in 5%,1000") from None
    if not out:
        raise ValueError("--cache-blocks: no cache sizes given")
    return out


def resolve_sizes(spec: str, trace: Trace, eval_start: float) -> list[int]:
    """``"1000,2000"`` blocks, or ``"5%,10%"`` of the unique blocks in the evaluation window.

    A size above what the trace can fill (every unique block plus one per
    request: the ``infinite`` policy's pool) is refused: its blocks would be
    allocated for nothing.
    """
    sizes = []
    unique = None
    # A served trace's replies hold KV of their own: no ceiling from the prompts.
    ceiling = math.inf if trace.fmt == "served" else unbounded_blocks(trace)
    for kind, value in parse_sizes(spec):
        if kind == "percent":
            if unique is None:
                unique = trace.unique_blocks(since=eval_start)
            sizes.append(max(2, int(math.ceil(unique * value / 100.0))))
        else:
            sizes.append(value)
        if sizes[-1] > ceiling:
            raise ValueError(
                f"--cache-blocks: {sizes[-1]} blocks is more than this trace can fill ({ceiling}: every unique "
                "block plus one per request); the infinite policy measures an unbounded cache"
            )
    return sorted(set(sizes))

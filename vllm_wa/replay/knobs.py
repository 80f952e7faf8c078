"""Tuning peers' knobs on the profile half of a trace, never on the evaluated half.

A peer with a knob (T-LRU's SLO, SLRU's protected threshold, the tool TTL's
break-even time) gets ONE setting per trace: every candidate replays the
profile half (the first ``profile_fraction`` of the trace) at one cache size,
warming on the first part of it and scored on the rest by the same rule as a
sweep (``eval_start`` of the profile half); the best token hit rate wins.
Optionally every candidate also replays the whole trace at that size, to
report the hindsight-best setting on the evaluated half beside the chosen one.
A trace measured from its first request (a served one) has no profile half:
its peers keep their knobs' defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm_wa.replay.peers import PEERS
from vllm_wa.replay.progress import ProgressBoard
from vllm_wa.replay.runner import RunResult, SweepSetup, Task, run_tasks, sort_results, sweep_tasks


@dataclass
class KnobChoice:
    """The setting chosen for one peer on one trace, and what it was chosen from."""

    peer: str
    knob: str
    unit: str
    cache_blocks: int
    profile: dict[float, float]  # candidate -> token hit rate on the profile half
    hindsight: dict[float, float] | None = None  # candidate -> token hit rate on the evaluated half

    @property
    def chosen(self) -> float:
        return _best(self.profile, PEERS[self.peer].knob.default)

    @property
    def hindsight_best(self) -> float | None:
        return _best(self.hindsight, PEERS[self.peer].knob.default) if self.hindsight else None

    def to_json(self) -> dict[str, Any]:
        return {
            "knob": self.knob,
            "unit": self.unit,
            "chosen": self.chosen,
            "chosen_on": "profile half",
            "cache_blocks": self.cache_blocks,
            "profile_token_hit_rate": {str(k): v for k, v in self.profile.items()},
            "hindsight_best": self.hindsight_best,
            "hindsight_token_hit_rate": {str(k): v for k, v in self.hindsight.items()} if self.hindsight else None,
        }


def _best(scores: dict[float, float], default: float) -> float:
    """Highest score; ties go to the knob's default, then to the first candidate."""
    top = max(scores.values())
    tied = [k for k, v in scores.items() if v == top]
    return default if default in tied else tied[0]


def profile_setup(setup: SweepSetup) -> SweepSetup:
    """The profile half as a replay of its own, scored after its own profile fraction."""
    part = setup.trace.until(setup.eval_start)
    if len(part.requests) < 2:
        raise ValueError(
            f"the profile half has {len(part.requests)} request(s), too few to tune peer knobs on: "
            "fix them with --peer-settings, or pass --profile-fraction 0 to run them at their defaults"
        )
    return replace(setup, trace=part, eval_start=part.eval_start(setup.cfg.profile_fraction))


def tuning_size(sizes: Sequence[int]) -> int:
    """The cache size knobs are tuned at: the middle of the sweep's sizes."""
    return sorted(sizes)[len(sizes) // 2]


class _Tuning:
    """The profile-half runs of every tunable peer, and each peer's choice once its runs are in."""

    def __init__(self, setup: SweepSetup, peers: Sequence[str], sizes: Sequence[int]) -> None:
        self.setup = setup
        self.size = tuning_size(sizes)
        self.peers = [p for p in peers if p in PEERS and PEERS[p].knob is not None]
        if not self.peers or setup.cfg.profile_fraction <= 0:
            self.peers = []
        elif setup.profile_half is None:
            setup.profile_half = profile_setup(setup)
        self.runs: dict[str, list[RunResult]] = {p: [] for p in self.peers}
        self.choices: dict[str, KnobChoice] = {}

    def tasks(self) -> list[Task]:
        return [Task(p, self.size, v, part="profile") for p in self.peers for v in PEERS[p].knob.values]

    def record(self, r: RunResult) -> KnobChoice | None:
        """A profile-half run is in; the peer's choice (also set in the setup) once all of its are."""
        runs = self.runs[r.policy]
        runs.append(r)
        values = PEERS[r.policy].knob.values
        if len(runs) < len(values):
            return None
        knob = PEERS[r.policy].knob
        c = KnobChoice(r.policy, knob.name, knob.unit, self.size, _scores(runs, r.policy, values))
        self.choices[r.policy] = c
        self.setup.peer_settings[r.policy] = c.chosen
        return c


def choose_settings(
    setup: SweepSetup,
    peers: Sequence[str],
    sizes: Sequence[int],
    jobs: int = 0,
    hindsight: bool = False,
    on_result: Callable[[RunResult], None] | None = None,
    board: ProgressBoard | None = None,
) -> dict[str, KnobChoice]:
    """Choose each tunable peer's setting on the profile half; sets ``setup.peer_settings``."""
    tuning = _Tuning(setup, peers, sizes)
    if not tuning.peers:
        return {}
    for r in run_tasks(setup, tuning.tasks(), jobs, on_result, board):
        tuning.record(r)
    choices = {p: tuning.choices[p] for p in tuning.peers}
    if hindsight:
        add_hindsight(setup, choices, jobs, on_result, board)
    return choices


def tuned_sweep(
    setup: SweepSetup,
    policies: Sequence[str],
    sizes: Sequence[int],
    jobs: int = 0,
    on_tuning: Callable[[RunResult], None] | None = None,
    on_choice: Callable[[KnobChoice], None] | None = None,
    on_result: Callable[[RunResult], None] | None = None,
    board: ProgressBoard | None = None,
) -> tuple[list[RunResult], dict[str, KnobChoice]]:
    """``sweep`` with the knobs of ``policies`` not yet in ``setup.peer_settings`` chosen on the profile half.

    One pool runs it all: the profile-half runs go first, the other policies'
    runs fill the cores beside them, and a peer's own runs start as soon as
    its knob is chosen; the chosen settings are those :func:`choose_settings`
    gives. Returns the sweep's results (as ``sweep`` orders them) and the choices.
    """
    tuning = _Tuning(setup, [p for p in policies if p not in setup.peer_settings], sizes)
    waiting = set(tuning.peers)
    results: list[RunResult] = []

    def follow(task: Task, r: RunResult) -> list[Task]:
        if task.part == "profile":
            if on_tuning:
                on_tuning(r)
            c = tuning.record(r)
            if c is None:
                return []
            if on_choice:
                on_choice(c)
            return [Task(c.peer, n, c.chosen) for n in sizes]
        results.append(r)
        if on_result:
            on_result(r)
        return []

    first = tuning.tasks() + [t for t in sweep_tasks(policies, sizes) if t.policy not in waiting]
    run_tasks(setup, first, jobs, board=board, follow=follow)
    return sort_results(results, policies), {p: tuning.choices[p] for p in tuning.peers}


def add_hindsight(
    setup: SweepSetup,
    choices: dict[str, KnobChoice],
    jobs: int = 0,
    on_result: Callable[[RunResult], None] | None = None,
    board: ProgressBoard | None = None,
) -> None:
    """Replay every candidate on the whole trace at the tuning size: the hindsight-best setting."""
    tasks = [Task(p, c.cache_blocks, v) for p, c in choices.items() for v in PEERS[p].knob.values]
    runs = run_tasks(setup, tasks, jobs, on_result, board)
    for p, c in choices.items():
        c.hindsight = _scores(runs, p, PEERS[p].knob.values)


def _scores(runs: Sequence[RunResult], peer: str, values: Sequence[float]) -> dict[float, float]:
    got = {r.extra.get("setting"): r.token_hit_rate for r in runs if r.policy == peer}
    return {v: got[v] for v in values}

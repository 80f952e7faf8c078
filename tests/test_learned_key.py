"""The learned class assignment: feature cells merged into K classes by their reuse data."""

from __future__ import annotations

import random
from array import array
from typing import Any

import numpy as np
import pytest

from vllm_wa.controller.config import CandidateSpec, ConfigError, ControllerConfig
from vllm_wa.controller.features import FeatureKey
from vllm_wa.controller.learned_key import FALLBACK, LearnedKey, assign, class_name
from vllm_wa.controller.survival import SurvivalData, reuse_within
from vllm_wa.engine_patch.block_tagger import RequestTags
from vllm_wa.params import time_to_live
from vllm_wa.replay.runner import ReplayConfig, SweepSetup, make_policy, prepare, run_one
from vllm_wa.replay.trace import Trace, TraceRequest


def cell(fast: int, slow: int, never: int) -> SurvivalData:
    d = SurvivalData()
    for _ in range(fast):
        d.add_event(5.0)
    for _ in range(slow):
        d.add_event(900.0)
    for _ in range(never):
        d.add_censored(3600.0)
    return d


def test_reuse_within_is_kaplan_meier():
    d = SurvivalData()
    for g in (1.0, 2.0, 3.0, 50.0, 100.0):
        d.add_event(g)
    for c in (10.0, 500.0, 500.0, 500.0, 500.0):
        d.add_censored(c)
    assert reuse_within(d, 5.0) == pytest.approx(0.3)
    # After 3 events and one censoring, 6 remain at risk at 50 s: S = 0.7 * 5/6.
    assert reuse_within(d, 60.0) == pytest.approx(1 - 0.7 * 5 / 6)
    assert reuse_within(SurvivalData(), 60.0) == 0.0


def test_assign_clusters_cells_by_early_reuse():
    cells = {
        "a": cell(90, 10, 0),  # mostly back within a minute
        "b": cell(80, 20, 0),
        "c": cell(10, 90, 0),
        "d": cell(5, 95, 100),
        "rare": cell(3, 0, 500),  # too few reuses: falls back
    }
    table = dict(assign(cells, 2, min_events=20, split_s=60.0))
    assert "rare" not in table
    assert table["a"] == table["b"] == class_name(1)
    assert table["c"] == table["d"] == class_name(0)
    four = dict(assign(cells, 4, min_events=20, split_s=60.0))
    assert [four[c] for c in "dcba"] == [class_name(k) for k in range(4)]
    # Deterministic, and never more classes than ranked cells.
    assert assign(cells, 4, 20, 60.0) == assign(dict(reversed(list(cells.items()))), 4, 20, 60.0)
    assert {v for _, v in assign(cells, 16, 20, 60.0)} == {class_name(k) for k in range(4)}
    assert assign({"rare": cells["rare"]}, 4, 20, 60.0) == ()


def test_learned_key_maps_cells_and_falls_back():
    cells = FeatureKey(("tag", "outcome"))
    key = LearnedKey(cells, (("chat.o:stop", "l:0"), ("agent.o:tool", "l:1")))
    assert key(RequestTags("r", "agent", "tool"), 0, 0) == "l:1"
    assert key(RequestTags("r", "chat", "stop"), 3, 2) == "l:0"
    assert key(RequestTags("r", "chat", "tool"), 0, 0) == FALLBACK
    assert key.class_of(cells.name_of(("agent", "tool", 0, 0, "u", 0, "u", "u"))) == "l:1"
    assert LearnedKey(cells, key.table) == key and LearnedKey(cells) != key
    with pytest.raises(ValueError, match="request features only"):
        LearnedKey(FeatureKey(("tag", "depth")))


def test_config_validates_learned_candidates():
    spec = CandidateSpec(("tag", "reply"), classes=4)
    assert spec.name == "tag+reply/hyper/posterior/L10/K4"
    ControllerConfig(candidates=(spec,))
    with pytest.raises(ConfigError, match="request features only"):
        ControllerConfig(candidates=(CandidateSpec(("tag", "depth"), classes=4),))
    with pytest.raises(ConfigError, match="classes"):
        ControllerConfig(candidates=(CandidateSpec(("tag",), classes=17),))
    with pytest.raises(ConfigError, match="at most one"):
        ControllerConfig(candidates=(spec, CandidateSpec(("tag",), classes=2)))
    loaded = ControllerConfig.from_dict({"tuner": {"candidates": [{"features": ["reply"], "classes": 3, "split_s": 30.0}]}})
    assert loaded.candidates[0].classes == 3 and loaded.candidates[0].split_s == 30.0


def reply_trace(seed: int = 0, conversations: int = 400, duration: float = 4000.0) -> Trace:
    """One tag, random outcomes; a short reply is followed by a quick next
    turn (2-10 s), a long one by a slow one (600-1200 s): only the reply
    length tells them apart."""
    rng = random.Random(seed)
    reqs: list[TraceRequest] = []
    next_id = 0
    for c in range(conversations):
        t, prompt = rng.uniform(-600.0, duration), []
        for k in range(rng.randint(3, 8)):
            prompt = prompt + list(range(next_id, next_id + 4))
            next_id += 4
            short = rng.random() < 0.5
            if 0.0 <= t < duration:
                reqs.append(TraceRequest(
                    f"c{c}t{k}", t, array("q", prompt), len(prompt) * 16, 50 if short else 1000,
                    tag="chat", conversation=c, outcome=rng.choice(("tool", "stop")),
                ))
            t += rng.uniform(2.0, 10.0) if short else rng.uniform(600.0, 1200.0)
    reqs.sort(key=lambda r: r.arrival)
    return Trace("reply-decides", 16, reqs, "generated", synthetic=True)


def run_fixed_candidate(spec: CandidateSpec) -> tuple[SweepSetup, Any]:
    """``wa-online`` on the reply trace with ``spec`` alone, tuner off, in 600 blocks."""
    config = ControllerConfig(
        refit_interval_s=10.0, fit_interval_s=10.0, min_samples=20, sample_rate=1.0,
        tuner_enabled=False, initial=spec.name, candidates=(spec,),
    )
    cfg = ReplayConfig(controller_config=config)
    setup = prepare(reply_trace(), ["lru", "wa-online"], cfg)
    pol = make_policy("wa-online", setup)
    run_one(setup.trace, pol, 600, cfg, setup.eval_start)
    return setup, pol


def test_controller_learns_which_cells_come_back_soon():
    spec = CandidateSpec(("tag", "outcome", "reply"), classes=2)
    setup, pol = run_fixed_candidate(spec)
    table = dict(pol.controller.candidates[spec.name].key.table)
    # Short replies (bucket y0) come back within a minute, long ones (y2) do not.
    fast = {v for k, v in table.items() if k.endswith(".y0")}
    slow = {v for k, v in table.items() if k.endswith(".y2")}
    assert fast == {class_name(1)} and slow == {class_name(0)}, table
    # The live tagger runs the learned table, and the state shows its classes.
    assert pol.tagger.class_key == pol.controller.candidates[spec.name].key
    state = pol.controller.state()
    (row,) = [c for c in state["candidates"] if c["name"] == spec.name]
    assert row["learned_cells"] == {"l:0": 2, "l:1": 2}
    # With the tuner off the fixed candidate's time still counts (bench-serve reports it).
    on = state["seconds_on_candidate"]
    assert on["lru"] == 0.0 and on[spec.name] > 0.9 * (setup.trace.end - setup.trace.start)


def test_the_state_reports_a_learned_keys_classes_as_the_fit_pools_them():
    """A learned class's data is its cells' data as the cells key holds it,
    less what that key's drifts forgot: /wa/params reports the numbers the
    models were fitted on, not the finest rows pooled afresh."""
    spec = CandidateSpec(("tag", "outcome", "reply"), classes=2)
    _, pol = run_fixed_candidate(spec)
    c = pol.controller
    key = c.candidates[spec.name].key
    cells = c._class_data(key.cells, None)
    busiest = max(cells, key=lambda name: cells[name].n_events)
    c._drift_of(key.cells).cut(busiest, np.stack((cells[busiest].events, cells[busiest].censored)), c.last_refit)
    fitted: dict[str, float] = {}
    for name, d in c._class_data(key.cells, None).items():
        fitted[key.class_of(name)] = fitted.get(key.class_of(name), 0.0) + d.n_events
    reported = {name: row["reuses"] for name, row in c.state()["classes"].items()}
    assert reported == {name: pytest.approx(v, abs=0.01) for name, v in fitted.items()}
    assert sum(reported.values()) < sum(row.n_events for row in c._bank.rows) - 1.0  # the cut shows


def test_a_ttl_candidate_keeps_the_class_that_comes_back_soon_for_longer():
    """Score mode "ttl" through the controller: each class's TTL comes from its
    fitted law, so short replies (back within seconds) get one and long
    replies (back after 10 to 20 minutes) none; the live queue runs it."""
    spec = CandidateSpec(("reply",), "exponential", "ttl", 100.0)
    _, pol = run_fixed_candidate(spec)
    params = pol.queue.params
    assert params.mode == "ttl" and params.source == f"online:{spec.name}"
    ttl = {name: time_to_live(m, 100.0) for name, m in params.models.items()}
    short = [v for k, v in ttl.items() if k.endswith("y0")]
    long = [v for k, v in ttl.items() if k.endswith("y2")]
    assert short and long, ttl
    assert min(short) > 5.0 and max(long) == 0.0, ttl

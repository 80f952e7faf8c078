"""The online controller: censored estimation, drift, the job's robustness, tuning, state."""

from __future__ import annotations

import json
import logging
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash

from vllm_wa.controller.checkpoint import read_checkpoint
from vllm_wa.controller.class_drift import ClassDrift, LookupDrift
from vllm_wa.controller.config import CandidateSpec, ConfigError, ControllerConfig
from vllm_wa.controller.controller import CHECKPOINT_MAX_CLASSES, WAController, start_online
from vllm_wa.controller.estimators import ReuseEstimator, SurvivalBank, fit_model, forgetting_factor, pooled
from vllm_wa.controller.features import FEATURES, FOLDED, FeatureKey
from vllm_wa.controller.reuse_tracker import ReuseTracker
from vllm_wa.controller.survival import (
    _C_LIK,
    _E_LIK,
    _EM_CHUNK,
    _MIDS,
    NUM_BINS,
    SurvivalData,
    fit_exponential,
    fit_hyperexponential,
    log_likelihood,
    naive_exponential,
    separates,
    separation_threshold,
)
from vllm_wa.engine_patch.block_tagger import RequestTags
from vllm_wa.engine_patch.conversations import ConversationTracker
from vllm_wa.engine_patch.events import (
    EventKind,
    EventSink,
    EvictedEvent,
    FinishedEvent,
    FreedEvent,
    LookupEvent,
    OutcomeEvent,
)
from vllm_wa.engine_patch.install import install_wa_queue, uninstall_wa_queue
from vllm_wa.params import ReuseModel, WAParams
from vllm_wa.serving import faults
from vllm_wa.sim.clock import SettableClock

from conftest import finish, make_manager, make_request, run_prefill

# ---- estimation under censoring --------------------------------------------------------------


def simulate_stream(p: float, a: float, evict_mean: float, n: int, seed: int, ghost_capacity: int):
    """Blocks freed as a Poisson stream; each is reused w.p. p after Exp(a).

    The cache evicts each block after an Exp(1/evict_mean) delay.  Returns the
    estimator fed through the controller's tracker (ghost table included),
    the naive data (only hits on resident blocks), and the eviction share.
    """
    rng = random.Random(seed)
    est = ReuseEstimator(drift_forget=1.0)  # a stationary stream: no forgetting
    tracker = ReuseTracker(
        ghost_capacity=ghost_capacity, watch_capacity=10 * n, max_watch_s=1e9,
        on_reuse=lambda k, gaps, t: est.update_many(gaps), on_censored=lambda k, e, t0: est.censor(e),
    )
    naive = SurvivalData()
    events = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(2.0)
        events.append((t, 0, i))  # freed
        reuse = rng.expovariate(a) if rng.random() < p else math.inf
        evict = rng.expovariate(1.0 / evict_mean)
        if evict < reuse:
            events.append((t + evict, 1, i))
        if reuse < math.inf:
            events.append((t + reuse, 2, i))
    events.sort()
    free_at = {}
    resident = set()
    evicted_before_reuse = 0
    for when, kind, i in events:
        if kind == 0:
            tracker.freed(i, 0, when)
            free_at[i] = when
            resident.add(i)
        elif kind == 1:
            tracker.evicted(i, when)
            resident.discard(i)
            evicted_before_reuse += 1
        else:
            tracker.looked_up([i], when)
            if i in resident:
                naive.add_event(when - free_at[i])
                resident.discard(i)
    end = events[-1][0]
    for _, exposure in tracker.at_risk(end):
        est.censor(exposure)
    return est, naive, evicted_before_reuse / n


@pytest.mark.parametrize("p, a", [(0.6, 1 / 60), (0.9, 1 / 20), (0.3, 1 / 300)])
def test_censored_estimates_within_10_percent_and_naive_is_far_off(p, a):
    n = 20000
    est, naive, evicted = simulate_stream(p, a, evict_mean=0.25 / a, n=n, seed=7, ghost_capacity=n)
    assert evicted >= 0.70, evicted
    p_hat, a_hat = fit_exponential(est.data)
    assert abs(p_hat - p) / p < 0.10, (p_hat, p)
    assert abs(a_hat - a) / a < 0.10, (a_hat, a)
    p_naive, a_naive = naive_exponential(naive, freed=n)
    # Ignoring censoring: gaps look short (rate too high), reuse looks rare.
    assert a_naive / a > 2.0, (a_naive, a)
    assert abs(p_naive - p) / p > 0.5, (p_naive, p)


def test_small_ghost_table_still_corrects_for_censoring():
    p, a, n = 0.7, 1 / 100, 20000
    est, _, evicted = simulate_stream(p, a, evict_mean=20.0, n=n, seed=3, ghost_capacity=400)
    assert evicted > 0.7
    p_hat, a_hat = fit_exponential(est.data)
    # Less information, larger error, but still the right ballpark.
    assert abs(p_hat - p) / p < 0.25 and abs(a_hat - a) / a < 0.35


def test_tracker_refiles_only_the_free_it_was_told_of():
    reused: list[tuple[int, list[float]]] = []
    tr = ReuseTracker(4, 4, 100.0, lambda k, gaps, t: reused.append((k, gaps)), lambda k, e: None)
    tr.freed("a", 1, 0.0)
    tr.freed("b", 1, 0.0)
    tr.evicted("b", 1.0)
    assert tr.refile("a", 0.0, 2) and tr.refile("b", 0.0, 2)  # watched, and in the ghost table
    tr.freed("c", 1, 0.0)
    tr.freed("c", 1, 5.0)  # freed again by a later request: the late fact was about the first free
    assert not tr.refile("c", 0.0, 2) and not tr.refile("gone", 0.0, 2)
    tr.looked_up(["a", "b", "c"], 10.0)
    assert sorted(reused) == [(1, [5.0]), (2, [10.0, 10.0])]


def test_a_ghost_watched_past_max_watch_is_censored_wherever_eviction_order_put_it():
    """The ghost table is in eviction order; a block freed early and evicted
    late still leaves it ``max_watch_s`` after its free, not when the blocks
    evicted before it do, and a later lookup of it is no reuse."""
    reused: list[tuple[int, list[float]]] = []
    censored: list[tuple[int, float, float]] = []
    tr = ReuseTracker(
        100, 100, 100.0, lambda k, gaps, t: reused.append((k, gaps)), lambda k, e, f: censored.append((k, e, f))
    )
    tr.freed("late", 1, 50.0)
    tr.freed("early", 2, 0.0)  # freed (again) before "late": the table keeps free order by moving it
    tr.freed("early", 2, 10.0)
    tr.evicted("late", 60.0)  # a workload-aware queue evicts the later-freed block first
    tr.evicted("early", 70.0)
    tr.expire(120.0)  # "early" (freed at 10) is past 100 s; "late" (freed at 50) is not
    assert censored == [(2, 110.0, 10.0)]
    assert list(tr.ghost) == ["late"]
    tr.looked_up(["early", "late"], 130.0)
    assert reused == [(1, [80.0])]
    tr.expire(1000.0)  # nothing left to censor, and the stale heap items are dropped
    assert len(censored) == 1 and not tr.ghost


def test_the_ghost_tables_free_time_heap_stays_bounded_under_churn():
    tr = ReuseTracker(8, 8, 1e9, lambda k, gaps, t: None, lambda k, e, f: None)
    for i in range(5000):
        h = i % 3  # freed, evicted and brought back again and again
        tr.freed(h, 1, float(i))
        tr.evicted(h, float(i))
        tr.looked_up([h], float(i) + 0.5)
    assert not tr.ghost and len(tr._ghost_heap) <= 2 * tr.ghost_capacity + 64


def test_hyperexponential_recovers_a_heavy_tailed_survival():
    rng = np.random.default_rng(0)
    n = 30000
    kind = rng.random(n)
    gaps = np.where(kind < 0.5, rng.exponential(10.0, n), rng.exponential(1000.0, n))
    reused = rng.random(n) < 0.8
    data = SurvivalData()
    exposure_limit = 3000.0
    for g, r in zip(gaps, reused):
        if r and g < exposure_limit:
            data.add_event(float(g))
        else:
            data.add_censored(exposure_limit)
    model, weights = fit_hyperexponential(data)
    assert model is not None and weights is not None
    truth = ReuseModel((0.4, 0.4), (1 / 10, 1 / 1000))
    for t in (5.0, 30.0, 300.0, 2000.0):
        assert abs(model.survival(t) - truth.survival(t)) < 0.03, t
    # A single exponential cannot follow both time scales.
    p, a = fit_exponential(data)
    single = ReuseModel.exponential(p, a)
    assert max(abs(single.survival(t) - truth.survival(t)) for t in (5.0, 30.0, 300.0, 2000.0)) > 0.08
    # Warm start from the previous weights converges to the same fit.
    again, _ = fit_hyperexponential(data, init=weights)
    assert abs(again.survival(100.0) - model.survival(100.0)) < 1e-3


def test_hyperexponential_fit_is_a_maximum_of_the_censored_likelihood():
    """No shift of mass between two components (the never mass included)
    raises the likelihood of the binned events and censored exposures:
    the EM step uses both kinds of observation, each with its own density."""
    rng = np.random.default_rng(5)
    data = SurvivalData()
    for g in rng.exponential(40.0, 3000):
        if rng.random() < 0.6 and g < 600.0:
            data.add_event(float(g))
        else:
            data.add_censored(float(rng.uniform(1, 600)))
    model, w = None, None
    for _ in range(20):  # warm starts, as the controller refits, to convergence
        model, w = fit_hyperexponential(data, init=w)
    assert model is not None and w is not None
    scales = [1.0 / r for r in model.rates]
    full = dict(zip(scales, model.weights))
    comps = list(full)
    base = log_likelihood(model, data)

    def moved(src: float | None, dst: float | None, eps: float) -> ReuseModel:
        ws = dict(full)
        for k, d in ((src, -eps), (dst, eps)):
            if k is not None:
                ws[k] = ws[k] + d
        return ReuseModel(tuple(ws.values()), tuple(1.0 / k for k in ws))

    for src in [*comps, None]:  # None: the never mass
        for dst in [*comps, None]:
            if src == dst:
                continue
            mass = full[src] if src is not None else 1.0 - model.p
            eps = min(0.01, 0.5 * mass)
            if eps <= 1e-9:
                continue
            assert log_likelihood(moved(src, dst, eps), data) <= base + 1e-6 * data.n, (src, dst)


def test_drift_detector_shortens_memory():
    est = ReuseEstimator(drift_delta=0.002, drift_forget=0.25)
    rng = random.Random(1)
    for _ in range(3000):
        est.update(rng.expovariate(1 / 5))
    before = est.data.n_events
    fired = False
    for _ in range(3000):
        fired |= est.update(rng.expovariate(1 / 500))
    assert fired and est.drifts >= 1
    # Old short gaps were largely forgotten: the fit reflects the new regime.
    assert est.data.n_events < before + 3000
    model = est.get("exponential")
    assert 1 / model.a > 100


def test_blocks_of_one_lookup_are_one_drift_observation():
    """A lookup brings back many blocks freed together, all with the same gap.

    Fed block by block, those identical gaps look like a shift to ADWIN and a
    stationary class keeps losing its memory; fed as one value per lookup it
    keeps everything, and a real shift is still detected.
    """
    rng = random.Random(0)
    batched, per_block = ReuseEstimator(), ReuseEstimator()
    total = 0
    for _ in range(400):
        gap, n = rng.expovariate(1 / 30), rng.randint(50, 300)
        total += n
        batched.update_many([gap] * n)
        for _ in range(n):
            per_block.update(gap)
    assert batched.drifts == 0 and batched.data.n_events == pytest.approx(total)
    assert per_block.drifts > 10 and per_block.data.n_events < total / 10
    shifted = ReuseEstimator()
    fired = [shifted.update_many([rng.expovariate(1 / (5 if i < 400 else 500))] * 100) for i in range(800)]
    assert not any(fired[:400]) and any(fired[400:])


# ---- the controller job -------------------------------------------------------------------------


def small_config(**kw) -> ControllerConfig:
    # A few dozen reuses per class: each class keeps its own fit (no separation test).
    base = dict(refit_interval_s=1.0, fit_interval_s=1.0, min_samples=5, tuner_min_requests=10, tuner_min_batches=2,
                tuner_batch_s=1.0, tuner_window_s=60.0, tuner_demote_window_s=10.0,
                initial="tag+outcome/hyper/posterior/L10", class_confidence=0.0)
    base.update(kw)
    return ControllerConfig(**base)


class Applied:
    def __init__(self) -> None:
        self.calls: list[tuple[WAParams, FeatureKey | None]] = []

    def __call__(self, params, key) -> None:
        self.calls.append((params, key))


def feed(sink: EventSink, t0: float, n_conv: int = 6, rounds: int = 8, gap_tool: float = 2.0, gap_human: float = 60.0):
    """Conversations: tool loops come back fast, people slowly."""
    t = t0
    for r in range(rounds):
        for c in range(n_conv):
            tag = "tool" if c % 2 else "human"
            rid = f"{tag}-{c}-{r}"
            hashes = tuple((j, (c, j)) for j in range(4 + r))
            sink.emit(LookupEvent(EventKind.LOOKUP, t, rid, tag, tuple(h for _, h in hashes), ()))
            t += 0.1
            req = RequestTags(rid, tag, "tool" if tag == "tool" else "stop")
            for j, h in hashes:
                sink.emit(FreedEvent(EventKind.FREED, t, h, req, j, r))
            sink.emit(FinishedEvent(EventKind.FINISHED, t, rid, req))
        t += gap_tool if r % 3 else gap_human
    return t


def test_refit_learns_classes_and_swaps_params():
    sink = EventSink(capacity=100000)
    applied = Applied()
    clock = [0.0]
    c = WAController(small_config(), 200, applied, sink, clock=lambda: clock[0])
    clock[0] = feed(sink, 0.0)
    c.refit()
    assert c.errors == 0 and c.refits == 1 and c.swaps == 1
    params, key = applied.calls[-1]
    assert params.version == 1 and isinstance(key, FeatureKey)
    # What was swapped in is what was learned: the running candidate's fitted classes, not the prior.
    assert params.source == "online:tag+outcome/hyper/posterior/L10"
    assert {"tool.o:tool", "human.o:stop"} <= set(params.models)
    st = c.state()
    assert {"tool.o:tool", "human.o:stop"} <= set(st["classes"])
    assert st["classes"]["tool.o:tool"]["reuses"] > 0
    assert st["reuses_seen"] >= st["ghost_reuses"] >= 0 and st["reuses_seen"] > 0
    assert json.loads(json.dumps(st)) == st  # plain JSON for /wa/params
    # Watches no reuse ended by max_watch_s are censored at the next refit.
    censored = st["watches_censored"]
    clock[0] += small_config().max_watch_s + 1.0
    c.refit()
    assert c.state()["watches_censored"] > censored
    assert len(st["candidates"]) == len(ControllerConfig().all_candidates)
    assert any(cand["name"] == "lru" for cand in st["candidates"])


@pytest.mark.parametrize("publish", [True, False])
def test_refit_publishes_the_state_only_for_readers(publish):
    """The engine publishes a snapshot at every refit for /wa/params; a replay
    (no reader) skips it and its refits learn and swap the same."""
    sink = EventSink(capacity=100000)
    applied = Applied()
    clock = [0.0]
    c = WAController(small_config(), 200, applied, sink, clock=lambda: clock[0], publish=publish)
    clock[0] = feed(sink, 0.0)
    c.refit()
    assert c.errors == 0 and c.swaps == 1
    if publish:
        # As of the refit (refit_seconds is set after it).
        assert {**c.snapshot, "refit_seconds": None} == {**c.state(), "refit_seconds": None}
    else:
        assert c.snapshot is None


def _em_step_by_step(data: SurvivalData, w: np.ndarray, iters: int, tol: float) -> tuple[np.ndarray, int]:
    """The EM of ``fit_hyperexponential`` written plainly: test after every step."""
    re, rc = np.flatnonzero(data.events), np.flatnonzero(data.censored)
    lik = np.vstack((_E_LIK[re], _C_LIK[rc]))
    share = np.concatenate((data.events[re], data.censored[rc])) / data.n
    for step in range(1, iters + 1):
        w_new = w * ((share / np.maximum(lik @ w, 1e-300)) @ lik)
        if np.abs(w_new - w).max() < tol:
            return w_new, step
        w = w_new
    return w, iters


def test_chunked_em_returns_exactly_the_step_by_step_fit():
    """The fit tests convergence once per chunk of steps; it must return the
    weights of the first converged step, bit for bit, wherever that step
    falls in a chunk (and when the step budget runs out first)."""
    rng = np.random.default_rng(11)
    data = SurvivalData()
    for g in rng.exponential(30.0, 500):
        data.add_event(float(g))
    for e in rng.uniform(1, 900, 300):
        data.add_censored(float(e))
    start = np.full(len(_E_LIK[0]), 1.0 / len(_E_LIK[0]))
    seen_offsets = set()
    cases = [(400, tol) for tol in (1e-6, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3)]
    for iters, tol in [*cases, (1, 1e-6), (_EM_CHUNK, 1e-6), (_EM_CHUNK + 3, 1e-6)]:
        want_w, want_steps = _em_step_by_step(data, start, iters, tol)
        if want_steps < iters:
            seen_offsets.add(want_steps % _EM_CHUNK)
        model, w = fit_hyperexponential(data, iters=iters, tol=tol, init=start)
        assert np.array_equal(w, np.maximum(want_w, 1e-12)), (iters, tol)
        # The model keeps the components above 1e-6, scaled down if they sum past one.
        kept = want_w[:-1][want_w[:-1] > 1e-6]
        assert model is not None and np.allclose(model.weights, kept / max(1.0, kept.sum())), (iters, tol)
    assert len(seen_offsets) > 2  # converged at several places within a chunk, the budget ran out too


def test_survival_bank_pools_and_forgets_rows_exactly_as_one_by_one():
    """Rows grow past the first capacity (the views move), their own updates
    land in the bank, and pooling by labels (with extra censored counts) and
    decaying give the same numbers, bit for bit, as ``pooled`` and ``decay``
    of separate copies."""
    rng = np.random.default_rng(3)
    bank = SurvivalBank(capacity=2)
    rows, plain = [], []
    for i in range(9):
        d = bank.new_row()
        p = SurvivalData()
        for g in rng.exponential(20.0, 30 + i):
            d.add_event(float(g))
            p.add_event(float(g))
        for e in rng.uniform(1, 500, 10):
            d.add_censored(float(e))
            p.add_censored(float(e))
        d.groups += 1.5 * i
        p.groups += 1.5 * i
        rows.append(d)
        plain.append(p)
        if i == 4:
            bank.decay(0.7)
            for q in plain:
                q.decay(0.7)
    for d, p in zip(rows, plain):
        assert np.array_equal(d.events, p.events) and np.array_equal(d.censored, p.censored)
        assert d.groups == p.groups
    labels = np.array([2, 0, 2, 1, 0, 2, 2, 1, 0], dtype=np.intp)
    extra_rows = np.array([1, 5, 6])
    extra = rng.uniform(0, 3, (3, len(_MIDS)))
    got = bank.pool(labels, 3, (extra_rows, extra))
    for c in range(3):
        members = [i for i in range(9) if labels[i] == c]
        watched = [SurvivalData(np.zeros(len(_MIDS)), extra[j]) for j, r in enumerate(extra_rows) if labels[r] == c]
        want = pooled(*(plain[i] for i in members), *watched)
        assert np.array_equal(got[c].events, want.events), c
        assert np.array_equal(got[c].censored, want.censored), c
        assert got[c].groups == want.groups, c


def test_candidates_with_one_key_and_family_share_fits_and_get_the_models_of_their_own_fits():
    sink = EventSink(capacity=100000)
    clock = [0.0]
    c = WAController(small_config(), 200, Applied(), sink, clock=lambda: clock[0])
    clock[0] = feed(sink, 0.0)
    c.refit()
    cands = c.candidates
    l10, l120 = cands["tag+outcome/hyper/posterior/L10"], cands["tag+outcome/hyper/posterior/L120"]
    exp, think = cands["tag+outcome/exp/pr/L5"], cands["tag+outcome+think/hyper/posterior/L10"]
    assert l10.fits is l120.fits and l10.fits  # the same key at two horizons: fitted once
    assert exp.fits is not l10.fits and think.fits is not l10.fits
    assert l10.params.models == l120.params.models and l10.params.horizon != l120.params.horizon
    # The shared models are what each candidate's own fits give (the feed's classes are fitted).
    assert len(l10.params.models) >= 2 and l10.params.source == "online:tag+outcome/hyper/posterior/L10"
    by_key = c._class_data(l10.key, c._at_risk(clock[0]))
    for name, model in l10.params.models.items():
        own = fit_model(by_key[name], "hyperexponential")
        assert model.weights == pytest.approx(own.weights, rel=1e-3, abs=1e-6)
        assert model.rates == own.rates


def test_refit_failure_is_counted_and_last_params_stay(monkeypatch):
    sink = EventSink()
    applied = Applied()
    clock = [0.0]
    c = WAController(small_config(), 200, applied, sink, clock=lambda: clock[0])
    clock[0] = feed(sink, 0.0)
    c.refit()
    good = c.params
    import vllm_wa.controller.controller as mod

    def boom(*a, **k):
        raise RuntimeError("fit exploded")

    monkeypatch.setattr(mod.ModelFit, "get", boom)
    clock[0] = feed(sink, clock[0])
    c.refit()  # must not raise
    assert c.errors == 1 and "fit exploded" in c.last_error
    assert c.params is good and len(applied.calls) == 1
    monkeypatch.undo()
    clock[0] += 2.0  # the next fit, with the data the failed one could not use
    c.refit()
    assert c.errors == 1 and len(applied.calls) == 2


def test_a_clock_that_steps_back_stalls_nothing():
    sink = EventSink(capacity=1 << 20)
    now = [0.0]
    c = WAController(small_config(), 200, Applied(), sink, clock=lambda: now[0])
    now[0] = feed(sink, 0.0)
    c.refit()
    stepped_from = now[0]
    now[0] -= 0.5
    for _ in range(5):
        c.refit()
        now[0] += 0.1
    assert c.errors == 0 and c.refits == 6
    assert c._last_forget == stepped_from  # nothing forgotten twice for the half second replayed


def test_a_swap_that_fails_bumps_no_version_and_counts_an_error_not_a_refit():
    sink = EventSink(capacity=1 << 20)
    now = [0.0]

    def apply(params, key):
        raise RuntimeError("the queue refused")

    c = WAController(small_config(), 200, apply, sink, clock=lambda: now[0])
    now[0] = feed(sink, 0.0)
    c.refit()
    assert (c.errors, c.refits, c.version, c.swaps) == (1, 0, 0, 0)


def test_the_live_queue_gets_other_keys_models_but_not_another_familys_of_its_own_key():
    """A class the running candidate's test left on its default stays there
    (as in its miniature cache); blocks filed under other keys' classes keep
    those keys' models."""
    c = WAController(small_config(), 200, Applied(), EventSink(capacity=16), clock=lambda: 0.0)
    hyper = c.candidates["tag+outcome/hyper/posterior/L10"]
    expo = c.candidates["tag+outcome/exp/pr/L5"]
    tag_only = c.candidates["tag/hyper/posterior/L10"]
    default = ReuseModel((0.3, 0.3), (1.0, 0.01))
    hyper.params = WAParams(models={"code.o:tool": ReuseModel((0.9,), (0.5,))}, default=default, horizon=10.0)
    expo.params = WAParams(models={"chat.o:stop": ReuseModel.exponential(0.2, 0.001)}, horizon=5.0, mode="pr")
    tag_only.params = WAParams(models={"chat": ReuseModel.exponential(0.4, 0.1)}, horizon=10.0)
    live = c._with_other_classes(hyper)
    assert live.model_for("chat.o:stop") == default
    assert live.model_for("chat") == ReuseModel.exponential(0.4, 0.1)
    assert live.model_for("code.o:tool") == ReuseModel((0.9,), (0.5,))


def test_refits_that_change_nothing_swap_nothing():
    sink = EventSink(capacity=100_000)
    now = [0.0]
    c = WAController(small_config(fit_interval_s=1e9), 200, Applied(), sink, clock=lambda: now[0])
    now[0] = feed(sink, 0.0)
    c.refit()
    assert (c.swaps, c.version) == (1, 1)
    for _ in range(5):
        now[0] += 1.0
        c.refit()
    assert (c.swaps, c.version) == (1, 1)


def test_miniature_caches_retire_idle_classes_as_the_live_queue_does():
    from vllm_wa.controller.shadow import ShadowCache

    sc = ShadowCache(CandidateSpec(("tag",)), 512, 64, FeatureKey(("tag",)), retire_after_s=1800.0)
    for i in range(100):  # a new tag every hour: each is idle long before the next
        t = 3600.0 * (i + 1)
        sc.lookup(f"r{i}", f"tag{i}", [("h", i, 0), ("h", i, 1)], t)
        sc.finish(f"r{i}", RequestTags(f"r{i}", f"tag{i}", "stop"), t)
    assert sc.queue.free_blocks_by_class().get("other", 0) == 0
    assert "tag99" in sc.queue.free_blocks_by_class()


def controller_after_lookups(lookups: int, reuse_counts: tuple[int, ...]) -> WAController:
    """Each lookup brings back one request's blocks, freed with these reuse counts."""
    sink = EventSink(capacity=1 << 20)
    c = WAController(small_config(), 200, Applied(), sink, clock=lambda: 0.0)
    t = 0.0
    for r in range(lookups):
        req = RequestTags(f"r{r}", "chat", "stop")
        hashes = [("b", r, j) for j in range(len(reuse_counts))]
        for j, h in enumerate(hashes):
            sink.emit(FreedEvent(EventKind.FREED, t, h, req, j, reuse_counts[j]))
        t += 5.0
        sink.emit(LookupEvent(EventKind.LOOKUP, t, f"n{r}", "chat", tuple(hashes), ()))
        t += 1.0
    c.process(sink.drain())
    return c


def test_a_lookup_is_one_observation_per_class_of_each_key_however_many_finest_classes_it_spans():
    """The class test scales its statistic by lookups per reused block: a
    lookup whose blocks fall in four reuse buckets is one lookup of the
    tag+outcome class, not four."""
    # A shared prefix: earlier blocks were reused more often.
    c = controller_after_lookups(20, (5, 5, 3, 3, 2, 1, 0, 0))
    coarse = c._class_data(FeatureKey(("tag", "outcome")), None)["chat.o:stop"]
    assert (coarse.groups, coarse.n_events) == (20.0, 160.0)
    # A candidate's key (the default reuse-and-growth one; no previous turn: growth unknown).
    by_reuse_growth = c._class_data(FeatureKey(("tag", "outcome", "reuse", "growth")), None)
    assert {name: d.groups for name, d in by_reuse_growth.items()} == {f"chat.o:stop.r{i}.gu": 20.0 for i in range(4)}


def test_past_the_finest_class_cap_new_classes_keep_their_tag_and_outcome(monkeypatch):
    import vllm_wa.controller.controller as mod

    monkeypatch.setattr(mod, "MAX_FINE_CLASSES", 4)
    monkeypatch.setattr(mod, "FOLDED_ROOM", 2)
    c = WAController(small_config(), 200, Applied(), EventSink(capacity=16), clock=lambda: 0.0)
    for i in range(4):
        c._fine_id(("a", "stop", i, 0, "u", 0, "u", "u"))
    folded = c._fine_id(("fresh", "tool", 1, 2, 3, 1, 2, 3))
    assert c._fine[folded][:2] == ("fresh", "tool") and set(c._fine[folded][2:]) == {"*"}
    assert c._fine_id(("fresh", "tool", 0, 0, 0, 0, 0, 0)) == folded
    c._fine_id(("b", "stop", 0, 0, 0, 0, 0, 0))  # the room is used up
    assert c._fine[c._fine_id(("c", "stop", 0, 0, 0, 0, 0, 0))][0] == "other"
    assert FeatureKey(("tag", "outcome")).name_of(c._fine[folded]) == "fresh.o:tool"


def test_a_freed_block_filed_under_a_folded_class_is_counted_once(monkeypatch):
    """``finest_folded`` counts freed blocks: a late outcome that refiles one
    (or a checkpoint row) is not another block."""
    import vllm_wa.controller.controller as mod

    monkeypatch.setattr(mod, "MAX_FINE_CLASSES", 4)
    c = WAController(small_config(), 200, Applied(), EventSink(capacity=16), clock=lambda: 0.0)
    for i in range(4):
        c.process([FreedEvent(EventKind.FREED, 1.0, f"b{i}", RequestTags(f"r{i}", f"t{i}", "stop"), 0, 0)])
    assert c.finest_folded == 0
    late = RequestTags("late", "fresh", "stop")
    c.process([FreedEvent(EventKind.FREED, 2.0, "x", late, 0, 0)])
    assert c.finest_folded == 1
    c.process([OutcomeEvent(EventKind.OUTCOME, 3.0, RequestTags("late", "fresh", "tool"), 2.0, ((0, "x", 0),))])
    assert c.finest_folded == 1


def test_finest_classes_unused_for_the_retire_time_give_their_slots_back(monkeypatch):
    """A server whose tags change: once the table is half full, a finest class
    with nothing freed into it, reused or censored for ``class_retire_s`` and
    no block still watched gives its slot back, so a new tag gets classes of its own again
    (without it, past the cap it folds, then becomes "other", for good). The
    kept classes keep their observations, watched blocks and lookup counts."""
    import vllm_wa.controller.controller as mod

    monkeypatch.setattr(mod, "MAX_FINE_CLASSES", 4)
    monkeypatch.setattr(mod, "RETIRE_FINE_AT", 2)
    monkeypatch.setattr(mod, "FOLDED_ROOM", 1)
    now = [0.0]
    sink = EventSink(capacity=1 << 12)
    c = WAController(small_config(class_retire_s=100.0), 200, Applied(), sink, clock=lambda: now[0])
    key = FeatureKey(("tag", "outcome"))

    def free(t: float, tag: str, block: str) -> None:
        sink.emit(FreedEvent(EventKind.FREED, t, block, RequestTags(f"r-{tag}-{t}", tag, "stop"), 0, 0))

    def lookup(t: float, *blocks: str) -> None:
        sink.emit(LookupEvent(EventKind.LOOKUP, t, f"q{t}", "chat", blocks, ()))

    for tag in ("old1", "watched", "kept"):
        free(0.0, tag, f"{tag}-0")
    old0 = [f"old0-{i}" for i in range(5)]  # enough reuses for a fit of its own
    for b in old0:
        free(0.0, "old0", b)
    lookup(5.0, *old0, "old1-0", "kept-0")  # three classes come back; "watched-0" stays watched
    now[0] = 10.0
    c.refit()
    assert c.finest_classes == 4 and c.finest_retired == 0
    fits = [cand.fits for cand in c.candidates.values() if cand.key == key]
    assert fits and all("old0.o:stop" in f for f in fits)
    kept_events = c._class_data(key, None)["kept.o:stop"].n_events

    free(150.0, "kept", "kept-1")
    now[0] = 150.0
    c.refit()  # old0 and old1: nothing freed since t = 10, nothing watched
    assert c.errors == 0
    assert c.finest_retired == 2 and c.finest_classes == 2
    data = c._class_data(key, None)
    assert set(data) == {"watched.o:stop", "kept.o:stop"}
    assert all(set(f) <= set(data) for f in fits)  # the retired class's fit is gone too
    kept = forgetting_factor(140.0, c.config.memory_s)  # what 140 s of forgetting leaves
    assert data["kept.o:stop"].n_events == pytest.approx(kept_events * kept)
    assert data["kept.o:stop"].groups == pytest.approx(kept)

    free(160.0, "new", "new-0")  # a new tag: its own class, not folded
    lookup(170.0, "watched-0", "new-0")  # the renumbered watched block is still its own class's
    now[0] = 170.0
    c.refit()
    assert c.finest_folded == 0 and ("new", "stop") in {comps[:2] for comps in c._fine}
    data = c._class_data(key, None)
    # One reuse each, at the refit's own time: recorded after this refit's forgetting.
    assert data["watched.o:stop"].n_events == pytest.approx(1.0) and data["new.o:stop"].n_events == pytest.approx(1.0)
    assert c.state()["finest_classes_retired"] == 2


def test_reading_the_state_counts_nothing_under_a_key_no_candidate_uses():
    """Under LRU the state shows classes by tag even when no candidate keys on
    the tag alone; reading it (every refit, for /wa/params) must not start
    counting lookups or detecting drifts under that key."""
    spec = CandidateSpec(("outcome",), "exponential", "posterior", 10.0)

    def run(publish: bool) -> WAController:
        sink = EventSink(capacity=100000)
        clock = [0.0]
        cfg = small_config(candidates=(spec,), initial="lru", tuner_enabled=False)
        c = WAController(cfg, 200, Applied(), sink, clock=lambda: clock[0], publish=publish)
        for _ in range(3):
            clock[0] = feed(sink, clock[0])
            c.refit()
        return c

    read, unread = run(True), run(False)
    assert set(read.state()["drifts"]) == set(unread.state()["drifts"]) == {"outcome"}
    assert set(read._key_classes) == {FeatureKey(("outcome",))}
    assert read.state()["classes"] == unread.state()["classes"]


def test_a_drift_forgets_in_the_view_of_the_key_that_detected_it_only():
    """A detection in a class of one key keeps ``drift_forget`` of that
    class's observations and lookups as that key pools them; another key's
    classes over the same finest rows keep all of theirs."""
    c = controller_after_lookups(40, (5, 5, 3, 0))
    coarse, fine = FeatureKey(("tag", "outcome")), FeatureKey(("tag", "outcome", "reuse", "growth"))
    before = {k: {n: d.n_events for n, d in c._class_data(k, None).items()} for k in (coarse, fine)}
    c._drift[coarse].update = lambda name, gaps: True  # the coarse key's detector fires at the next lookup
    req = RequestTags("last", "chat", "stop")
    hashes = [("last", j) for j in range(4)]
    events = [FreedEvent(EventKind.FREED, 300.0, h, req, j, (5, 5, 3, 0)[j]) for j, h in enumerate(hashes)]
    c.process([*events, LookupEvent(EventKind.LOOKUP, 305.0, "n-last", "chat", tuple(hashes), ())])
    forget = c.config.drift_forget
    cut = c._class_data(coarse, None)["chat.o:stop"]
    assert cut.n_events == pytest.approx(forget * (before[coarse]["chat.o:stop"] + 4))
    assert cut.groups == pytest.approx(forget * 41)
    kept = c._class_data(fine, None)
    assert {n: d.n_events for n, d in kept.items()} == {n: v * 41 / 40 for n, v in before[fine].items()}
    assert {d.groups for d in kept.values()} == {41.0}
    assert [(e["key"], e["class"]) for e in c.drift_events] == [("tag+outcome", "chat.o:stop")]
    # The finest rows themselves are never cut.
    assert sum(row.n_events for row in c._bank.rows) == pytest.approx(41 * 4)


def shifting_stream(lookups: int) -> list[tuple[float, list]]:
    """Prompts of four blocks that come back after about 1 s; halfway, the two
    blocks never reused before (reuse count 0) start to come back after 600
    to 1,200 s, the two reused ones still after 1 s: per lookup, its time and
    its events (in time order)."""
    rng = random.Random(7)
    t = 0.0
    out = []
    for r in range(lookups):
        req = RequestTags(f"r{r}", "chat", "stop")
        hashes = [("s", r, j) for j in range(4)]
        gap = rng.uniform(0.5, 1.5) if r < lookups // 2 else rng.uniform(600.0, 1200.0)
        late = [FreedEvent(EventKind.FREED, t, hashes[j], req, j, 0) for j in (2, 3)]
        recent = t + gap - rng.uniform(0.5, 1.5) if r >= lookups // 2 else t
        early = [FreedEvent(EventKind.FREED, recent, hashes[j], req, j, 4) for j in (0, 1)]
        events = [*late, *early, LookupEvent(EventKind.LOOKUP, t + gap, f"n{r}", "chat", tuple(hashes), ())]
        out.append((t + gap, events))
        t += gap + 1.0
    return out


def test_a_candidates_fits_do_not_depend_on_which_other_candidates_are_configured():
    """The same stream, with its reuse gaps shifting halfway, through a
    controller running one candidate and through one that also runs a
    candidate whose key splits the finest classes by reuse count: the first
    candidate's drift detections and fitted models, refit after refit, are
    the same in both (before, detection ran per finest class, so the second
    candidate's features changed the first one's fits)."""
    alone = (CandidateSpec(("tag", "outcome"), "exponential", "posterior", 10.0),)
    both = (*alone, CandidateSpec(("tag", "outcome", "reuse"), "exponential", "posterior", 10.0))
    stream = shifting_stream(600)
    fitted = []
    for candidates in (alone, both):
        sink = EventSink(capacity=1 << 20)
        now = [0.0]
        # A long memory: the drift's cut, not the forgetting, decides the fits.
        config = small_config(candidates=candidates, initial="lru", memory_s=1e7)
        c = WAController(config, 200, Applied(), sink, clock=lambda now=now: now[0])
        models = []
        for i, (t, events) in enumerate(stream):
            for ev in events:
                sink.emit(ev)
            if i % 10 == 9:
                now[0] = t
                c.refit()
                fit = c.candidates["tag+outcome/exp/posterior/L10"].params.models
                models.append({name: (*m.weights, *m.rates) for name, m in fit.items()})
        drifts = [(e["time"], e["class"]) for e in c.drift_events if e["key"] == "tag+outcome"]
        fitted.append((models, drifts))
    assert fitted[0][1], "the shift must be detected for the comparison to mean anything"
    assert fitted[0][1] == fitted[1][1]
    # Equal up to the order of summing the finest rows.
    assert fitted[0][0] == [{n: pytest.approx(v, rel=1e-9) for n, v in m.items()} for m in fitted[1][0]]


def test_pin_and_unpin():
    sink = EventSink()
    applied = Applied()
    c = WAController(small_config(), 200, applied, sink, clock=lambda: 1.0)
    pinned = WAParams.from_pr_json({"a": {"x": 0.5}, "p": {"x": 0.5}})
    c.pin(pinned, ("tag",))
    assert c.pinned is not None and applied.calls[-1][0].models == pinned.models
    c.refit()
    assert applied.calls[-1][0].models == pinned.models  # refits keep the pin
    c.unpin()
    assert c.pinned is None and c.state_light()["mode"] == "auto"


def test_a_pin_that_cannot_be_applied_leaves_the_controller_as_it_was():
    """The queue refused the pin's swap: no "pinned" mode over the old
    parameters, and later refits apply the learned ones without errors."""
    sink = EventSink()
    applied = Applied()
    c = WAController(small_config(), 200, applied, sink, clock=lambda: 1.0)
    c.refit()
    calls = len(applied.calls)

    def refuse(params, key):
        raise ValueError("the queue refused these parameters")

    c.apply = refuse
    with pytest.raises(ValueError):
        c.pin(WAParams.from_pr_json({"a": {"x": 0.5}, "p": {"x": 0.5}}), ("tag",))
    assert c.pinned is None and c.state_light()["mode"] == "auto"
    c.apply = applied
    c.refit()
    assert c.errors == 0 and len(applied.calls) >= calls


def test_checkpoint_round_trip_and_corrupt_file(tmp_path, caplog):
    sink = EventSink()
    clock = [0.0]
    c = WAController(small_config(), 200, Applied(), sink, clock=lambda: clock[0])
    clock[0] = feed(sink, 0.0)
    c.refit()
    path = tmp_path / "ckpt.json"
    c.save_checkpoint(str(path))
    fresh = WAController(small_config(), 200, Applied(), EventSink(), clock=lambda: clock[0])
    assert fresh.load_checkpoint(str(path))
    assert len(fresh._bank) == len(c._bank)
    assert fresh._bank.rows[0].n == pytest.approx(c._bank.rows[0].n)
    assert fresh._bank.rows[0].groups == pytest.approx(c._bank.rows[0].groups)
    assert c._bank.rows[0].groups > 0
    # The file holds what ran, model for model, up to the last bit of a float.
    running = c._target()[0].models
    saved = read_checkpoint(str(path), max_classes=CHECKPOINT_MAX_CLASSES).params.models
    assert running and saved.keys() == running.keys()
    for name, m in running.items():
        got = saved[name]
        assert got.weights == pytest.approx(m.weights, rel=1e-12) and got.rates == pytest.approx(m.rates, rel=1e-12)
    for bad in ["{not json", json.dumps({"version": 99}), json.dumps({"version": 1, "classes": [{"components": [1]}]})]:
        path.write_text(bad)
        other = WAController(small_config(), 200, Applied(), EventSink(), clock=lambda: 0.0)
        assert other.load_checkpoint(str(path)) is False
        assert other.params.source == "prior" and not len(other._bank)
    assert WAController(small_config(), 200, Applied(), EventSink()).load_checkpoint(str(tmp_path / "none")) is False
    assert "ignoring checkpoint" in caplog.text


def test_a_checkpoint_is_filed_as_this_run_files_blocks(tmp_path):
    """A checkpoint written under candidates that used more features is read
    into the finest classes this run's blocks go to (the unused features
    folded), and rows that fold together add up instead of overwriting."""
    wide = small_config(candidates=(CandidateSpec(("tag", "outcome", "reuse")),), initial="lru")
    narrow = small_config(candidates=(CandidateSpec(("tag", "outcome")),), initial="lru")
    sink = EventSink(capacity=100000)
    clock = [0.0]
    c = WAController(wide, 200, Applied(), sink, clock=lambda: clock[0])
    clock[0] = feed(sink, 0.0)
    c.refit()
    path = tmp_path / "ckpt.json"
    assert c.save_checkpoint(str(path))
    fresh = WAController(narrow, 200, Applied(), EventSink(), clock=lambda: clock[0])
    assert fresh.load_checkpoint(str(path))
    used = {FEATURES.index("tag"), FEATURES.index("outcome")}
    assert all(v == FOLDED for comps in fresh._fine for i, v in enumerate(comps) if i not in used)
    assert len(fresh._fine) < len(c._fine)
    assert sum(r.n_events for r in fresh._bank.rows) == pytest.approx(sum(r.n_events for r in c._bank.rows))
    assert sum(r.groups for r in fresh._bank.rows) == pytest.approx(sum(r.groups for r in c._bank.rows))


def test_checkpoint_written_atomically_by_the_job(tmp_path):
    path = tmp_path / "wa.json"
    sink = EventSink()
    clock = [0.0]
    c = WAController(small_config(checkpoint_path=str(path), checkpoint_interval_s=1.0), 200, Applied(), sink,
                     clock=lambda: clock[0])
    clock[0] = feed(sink, 0.0)
    c.refit()
    assert json.loads(path.read_text())["version"] == 2
    assert not list(tmp_path.glob("*.tmp*"))


# ---- configuration ----------------------------------------------------------------------------------


def test_default_config_file_matches_defaults():
    import os

    cfg = ControllerConfig.load(os.path.join(os.path.dirname(__file__), "..", "configs", "controller.toml"))
    assert cfg == ControllerConfig()


@pytest.mark.parametrize(
    "data, key",
    [
        ({"controller": {"refit_interval": 5}}, "controller.refit_interval"),
        ({"controller": {"refit_interval_s": -1}}, "refit_interval_s"),
        ({"controller": {"memory_s": "long"}}, "memory_s"),
        ({"controller": {"drift_forget": 0}}, "drift_forget"),
        ({"controller": {"class_confidence": 1.0}}, "class_confidence"),
        ({"controller": {"class_confidence": -0.5}}, "class_confidence"),
        ({"tuner": {"margin": -0.1}}, "tuner_margin"),
        ({"tuner": {"full_window_margin": -0.1}}, "tuner_full_window_margin"),
        ({"tuner": {"full_window_min_requests": 1.5}}, "tuner_full_window_min_requests"),
        ({"tuner": {"short_window_s": -1.0}}, "tuner_short_window_s"),
        ({"tuner": {"short_window_s": 45.0}}, "tuner_short_window_s"),  # under two batches
        ({"tuner": {"short_window_s": 150.0}}, "tuner_short_window_s"),  # under min_batches (6) batches
        ({"tuner": {"window_s": 120.0, "short_window_s": 0}}, "tuner_window_s"),  # could never promote
        ({"tuner": {"short_window_confidence": 1.0}}, "tuner_short_window_confidence"),
        ({"tuner": {"candidates": [{"features": ["color"]}], "initial": "lru"}}, "candidates[0].features"),
        ({"tuner": {"candidates": [{"features": ["tag", "tag"]}], "initial": "lru"}}, "candidates[0].features"),
        ({"tuner": {"candidates": [{"family": "weibull"}], "initial": "lru"}}, "candidates[0].family"),
        ({"tuner": {"candidates": [{"horizon": 0}], "initial": "lru"}}, "candidates[0].horizon"),
        ({"tuner": {"candidates": [{"speed": 1}], "initial": "lru"}}, "candidates[0].speed"),
        ({"tuner": {"candidates": [{"stamp": "arrival"}], "initial": "lru"}}, "candidates[0].stamp"),
        ({"tuner": {"candidates": [{"features": ["tag"], "lru": "no"}], "initial": "lru"}}, "candidates[0].lru"),
        ({"controller": {"ghost_factor": 1e308}}, "ghost_factor"),
        ({"controller": {"event_capacity": 2**63 - 1}}, "event_capacity"),  # a drop threshold never reached
        ({"tuner": {"initial": "nope"}}, "initial"),
        ({"extra": {}}, "extra"),
    ],
)
def test_bad_config_names_the_key(data, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        ControllerConfig.from_dict(data)


def test_counts_spelled_as_integral_floats_are_kept_as_integers():
    cfg = ControllerConfig.from_dict(
        {"controller": {"event_capacity": 131072.0, "max_classes": 64.0, "shadow_blocks": 4096.0},
         "tuner": {"min_batches": 6.0, "candidates": [{"features": ["tag"], "classes": 4.0}], "initial": "lru"}}
    )
    counts = (cfg.event_capacity, cfg.max_classes, cfg.shadow_blocks, cfg.tuner_min_batches, cfg.candidates[0].classes)
    assert counts == (131072, 64, 4096, 6, 4) and all(type(v) is int for v in counts)
    assert cfg.candidates[0].name == "tag/hyper/posterior/L10/K4"
    c = WAController(cfg, 10_000, Applied(), EventSink(capacity=cfg.event_capacity), clock=lambda: 0.0)
    c.refit()
    assert c.errors == 0


def test_config_file_errors_name_the_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[controller]\nrefit_interval_s = = 3\n")
    with pytest.raises(ConfigError, match="c.toml"):
        ControllerConfig.load(str(p))
    p.write_text("[tuner]\nwindow_s = 0\n")
    with pytest.raises(ConfigError, match="tuner_window_s"):
        ControllerConfig.load(str(p))
    p.write_bytes(b"\xff\xfe[controller]\n")  # not UTF-8: a clear error too, not a UnicodeDecodeError
    with pytest.raises(ConfigError, match="c.toml.*not UTF-8"):
        ControllerConfig.load(str(p))


def test_candidate_names_and_lru_always_present():
    cfg = ControllerConfig(candidates=(CandidateSpec(("outcome",), "exponential", "pr", 5.0),), initial="lru")
    names = [c.name for c in cfg.all_candidates]
    assert names == ["lru", "outcome/exp/pr/L5"]
    # The idle-time origin is part of a candidate's name (two stamps of one key are two candidates).
    both = ControllerConfig(
        candidates=(CandidateSpec(("tag",)), CandidateSpec(("tag",), stamp="lookup")), initial="lru"
    )
    assert [c.name for c in both.all_candidates] == ["lru", "tag/hyper/posterior/L10", "tag/hyper/posterior/L10/lookup"]


def test_feature_key_names_and_buckets():
    from vllm_wa.engine_patch.block_tagger import RequestTags

    k = FeatureKey(("tag", "outcome", "depth", "reuse"))
    assert k.uses_block_features
    assert k(RequestTags("r", "chat", "tool"), 0, 0) == "chat.o:tool.d0.r0"
    assert k(RequestTags("r", "chat", None), 5000, 9) == "chat.o:unknown.d3.r3"
    assert FeatureKey(("outcome",))(RequestTags("r", "tool", "tool"), 0, 0) == "o:tool"
    assert FeatureKey(("tag",))(RequestTags("r", "tool", "tool"), 0, 0) == "tool"
    assert not FeatureKey(("tag",)).uses_block_features
    with pytest.raises(ValueError):
        FeatureKey(("color",))


def test_a_key_without_the_tag_never_names_a_class_as_a_tag_could_be_named():
    """The live queue holds every candidate key's models at once, so a class
    of one key must not share its name with a tag of the tag key: before, the
    reuse key alone named its first bucket ``r0``, a valid tag."""
    from vllm_wa.engine_patch.block_tagger import RequestTags
    from vllm_wa.engine_patch.conversations import TurnTiming
    from vllm_wa.workload_classes import is_valid_tag

    timings = (None, TurnTiming(1, 0, 1, None, None), TurnTiming(1, 0, 7, 45.0, 0.3), TurnTiming(1, 0, 30, 4000.0, 2.0))
    keys = [FeatureKey((f,)) for f in FEATURES if f != "tag"] + [FeatureKey(())]
    for key in keys:
        names = set()
        for timing in timings:
            for reply in (0, 300, 5000):
                for position, reuse in ((0, 0), (100, 1), (5000, 9)):
                    req = RequestTags("r", "r0", "tool", reply, timing)
                    names.add(key(req, position, reuse))
                    assert key.name_of(key.components(req, position, reuse)) == key(req, position, reuse)
        assert names and not any(is_valid_tag(n) for n in names), (key.name, names)
    assert FeatureKey(("reuse",))(RequestTags("r", "chat"), 0, 0) == ":r0"
    assert FeatureKey(())(RequestTags("r", "chat"), 0, 0) == ":all"
    # Names that already hold a separator keep their form.
    assert FeatureKey(("depth", "reuse"))(RequestTags("r", "chat"), 0, 0) == "d0.r0"
    assert FeatureKey(("tag", "reuse"))(RequestTags("r", "r0"), 0, 0) == "r0.r0"


def test_feature_key_call_names_the_same_class_as_the_controllers_finest_classes():
    """The engine's fast path (``key(...)``) and the controller's pooling
    (``name_of(components(...))``) must agree, or a class's data and its blocks part."""
    import itertools

    from vllm_wa.controller.features import FEATURES
    from vllm_wa.engine_patch.conversations import TurnTiming

    rng = random.Random(0)
    keys = [FeatureKey(c) for r in range(4) for c in itertools.combinations(FEATURES, r)] + [FeatureKey(FEATURES)]
    for _ in range(300):
        timing = None if rng.random() < 0.3 else TurnTiming(
            1, 0, rng.randint(1, 30), rng.choice([None, rng.uniform(0, 4000)]), rng.choice([None, rng.uniform(0, 1)])
        )
        req = RequestTags("r", rng.choice(["a", "tool"]), rng.choice([None, "tool", "stop"]), rng.randint(0, 3000), timing)
        pos, reuse = rng.randint(0, 3000), rng.randint(0, 6)
        for k in keys:
            assert k(req, pos, reuse) == k.name_of(k.components(req, pos, reuse)), (k.features, req)


def test_feature_key_name_cache_is_bounded_and_stays_right_past_its_bound():
    """The key caches names by raw buckets: many distinct tags clear it,
    never grow it past its bound, and every name stays the uncached one."""
    from vllm_wa.controller import features

    key = FeatureKey(("tag", "outcome", "depth"))
    for i in range(features._MAX_CACHED_NAMES + 500):
        req = RequestTags("r", f"t{i}", "tool" if i % 2 else None)
        assert key(req, i, 0) == key.name_of(key.components(req, i, 0))
        assert len(key._names) <= features._MAX_CACHED_NAMES
    # Equal keys stay equal (the cache is not part of the key).
    assert key == FeatureKey(("tag", "outcome", "depth")) and hash(key) == hash(FeatureKey(("tag", "outcome", "depth")))


def test_fit_model_families():
    d = SurvivalData()
    for g in [1, 2, 3, 5, 8]:
        d.add_event(g)
    d.add_censored(100)
    assert fit_model(d, "exponential").p > 0.5
    assert fit_model(d, "hyperexponential") is not None
    assert fit_model(SurvivalData(), "exponential") is None
    with pytest.raises(ValueError):
        fit_model(d, "weibull")


def test_chain_sampled_miniature_caches_are_sized_by_the_chain_rate_whatever_the_watch_rate():
    cache_blocks = 100_000
    for rate in (None, 0.01, 0.5):
        cfg = ControllerConfig(shadow_blocks=4096, sample_rate=rate, shadow_sampling="chain")
        sink = EventSink(capacity=10, sample_rate=rate or 4096 / cache_blocks, chain_rate=4096 / cache_blocks)
        c = WAController(cfg, cache_blocks, Applied(), sink, clock=lambda: 0.0)
        assert c.shadow_blocks == 4096, rate


@pytest.mark.parametrize("sample_rate", [None, 1.0, 0.2, 0.01])
def test_miniature_caches_see_the_share_of_hashes_they_are_sized_for(sample_rate):
    """Their sample is nested in the watched one: a denser watch (or a sparser
    one) than the caches need must not change the share they see."""
    cache_blocks = 100_000
    cfg = ControllerConfig(shadow_blocks=4096, sample_rate=sample_rate)
    sink = EventSink(capacity=10, sample_rate=sample_rate or 4096 / cache_blocks)
    c = WAController(cfg, cache_blocks, Applied(), sink, clock=lambda: 0.0)
    hashes = range(200_000)
    watched = tuple(h for h in hashes if sink.is_sampled(h))
    seen, _ = c._shadow_hashes(LookupEvent(EventKind.LOOKUP, 0.0, "r", "t", watched, ()))
    assert set(seen) <= set(watched)
    assert len(seen) / len(hashes) == pytest.approx(c.shadow_blocks / cache_blocks, rel=0.05)
    assert c.shadow_blocks == round(cache_blocks * min(sink.sample_rate, 4096 / cache_blocks))


def test_shadow_caches_release_requests_whose_finish_was_lost():
    from vllm_wa.controller.shadow import ShadowCache

    sc = ShadowCache(CandidateSpec(("tag",)), num_blocks=20, max_classes=8, key=FeatureKey(("tag",)))
    for i in range(3):
        sc.lookup(f"r{i}", "t", [("h", i, j) for j in range(6)], float(i))
    assert sc.cache.pool.num_free_blocks == 1  # 19 usable, 18 pinned
    sc.lookup("r9", "t", [("h", 9, j) for j in range(6)], 5.0)
    assert sc.overflow == 1
    assert sc.expire(100.0, max_hold_s=50.0) == 3
    assert sc.cache.pool.num_free_blocks == 19
    assert sc.expired == 3 and sc.expire(200.0, max_hold_s=50.0) == 0 and sc.expired == 3  # each counted once


def test_shadow_caches_hold_a_bounded_number_of_requests_whose_finish_was_lost(monkeypatch):
    """Requests that share their sampled blocks (a common system prompt) are
    always admitted; with their finishes lost (a full event sink) they were
    held until they expired, max_watch_s later: a table that grew with the
    request rate. Past the live-request cap the oldest is released."""
    from vllm_wa.controller import shadow

    monkeypatch.setattr(shadow, "MAX_LIVE_REQUESTS", 8)
    sc = shadow.ShadowCache(CandidateSpec(("tag",)), num_blocks=20, max_classes=8, key=FeatureKey(("tag",)))
    for i in range(50):
        sc.lookup(f"r{i}", "t", [("system", j) for j in range(4)], float(i))
    assert len(sc._since) == len(sc._tags) == 8 and sc.lost_finishes == 42
    assert sorted(sc._since) == sorted(f"r{i}" for i in range(42, 50))
    sc.finish("r49", None, 60.0)
    assert len(sc._since) == 7


def test_shadow_cache_files_by_final_outcome_and_refiles_a_late_one():
    from vllm_wa.controller.shadow import ShadowCache

    sc = ShadowCache(CandidateSpec(("tag", "outcome")), num_blocks=20, max_classes=8,
                     key=FeatureKey(("tag", "outcome")))
    for i, outcome in enumerate(("tool", "stop", "tool")):
        sc.lookup(f"r{i}", "t", [("h", i, j) for j in range(3)], float(i))
        sc.finish(f"r{i}", RequestTags(f"r{i}", "t", outcome), float(i) + 0.5)
    assert sc.queue.free_blocks_by_class() == {"t.o:stop": 3, "t.o:tool": 6}
    # Nothing kept for late outcomes until the engine reports one (a replay never does).
    assert len(sc.tagger._finished) == 0
    sc.reclassify(RequestTags("r1", "t", "tool"), 3.0)
    assert sc.queue.free_blocks_by_class() == {"t.o:stop": 3, "t.o:tool": 6}
    sc.lookup("r3", "t", [("h", 3, j) for j in range(3)], 4.0)
    sc.finish("r3", RequestTags("r3", "t", "stop"), 4.5)
    # The engine's OUTCOME event: the reply of r3 called a tool after all.
    sc.reclassify(RequestTags("r3", "t", "tool"), 5.0)
    assert sc.queue.free_blocks_by_class() == {"t.o:stop": 3, "t.o:tool": 9}
    # A request it never held leaves nothing waiting for a release that will not come.
    sc.reclassify(RequestTags("r7", "t", "tool"), 3.0)
    assert len(sc.tagger._pending_outcome) == 0


def test_a_late_outcome_moves_the_controllers_observations_and_miniature_caches():
    """The API server reports a tool call after the engine released the blocks
    (the usual order): what the controller learns and measures follows the
    live queue's refile, not the outcome the release carried."""
    init_none_hash(sha256)
    clock = SettableClock()
    manager = make_manager(40)
    sink = EventSink(capacity=10_000)
    key = FeatureKey(("tag", "outcome"))
    handle = install_wa_queue(manager.block_pool, clock=clock, sink=sink, class_key=key,
                              conversations=ConversationTracker())
    try:
        c = WAController(small_config(), 40, Applied(), sink, clock=lambda: clock.t)
        # A first late outcome: from it on the miniature caches keep released requests for more.
        r0 = make_request("r0", list(range(9000, 9000 + 16 * 2 + 1)), tag="agent")
        run_prefill(manager, r0)
        finish(manager, r0)
        assert handle.tagger.reclassify("r0", "tool") == 2
        c.process(sink.drain())
        prompt = list(range(16 * 3 + 1))
        r1 = make_request("r1", prompt, tag="agent")
        run_prefill(manager, r1)
        clock.advance(1)
        finish(manager, r1)
        c.process(sink.drain())
        held = [s for s in c._shadows if s.tagger is not None and "outcome" in s.key.features]

        def tool_blocks(shadow):
            return sum(n for name, n in shadow.queue.free_blocks_by_class().items() if "o:tool" in name)

        before = [tool_blocks(s) for s in held]
        clock.advance(0.5)
        assert handle.tagger.reclassify("r1", "tool") == 3
        assert handle.queue.free_blocks_by_class() == {"agent.o:tool": 5}
        c.process(sink.drain())
        assert held and [tool_blocks(s) for s in held] == [n + 3 for n in before]
        clock.advance(3)
        r2 = make_request("r2", prompt + [7], tag="agent")
        run_prefill(manager, r2)
        c.process(sink.drain())
        booked = {name: d.n_events for name, d in c._class_data(key, None).items()}
        assert booked.get("agent.o:tool") == 3 and not booked.get("agent.o:stop")
        # The same report again moves nothing and sends nothing.
        assert handle.tagger.reclassify("r1", "tool") == 0
        assert not [e for e in sink.drain() if e.kind == EventKind.OUTCOME]
    finally:
        uninstall_wa_queue(manager.block_pool)


def test_estimator_is_river_style_validates_and_its_example_runs():
    import doctest

    import vllm_wa.controller.estimators as mod

    assert doctest.testmod(mod).failed == 0
    est = ReuseEstimator()
    for bad in (-1.0, float("nan"), float("inf"), "3", True):
        with pytest.raises(ValueError):
            est.update(bad)
        with pytest.raises(ValueError):
            est.censor(bad)
        with pytest.raises(ValueError):
            forgetting_factor(bad, 600.0)
    assert est.data.n == 0
    assert forgetting_factor(600.0, 600.0) == pytest.approx(math.exp(-1.0))
    assert forgetting_factor(0.0, 600.0) == 1.0
    # An owner that ages the statistics with memory_s gets them weighted by free time.
    aged = ReuseEstimator(memory_s=600.0)
    aged.update_many([0.0, 600.0])
    aged.censor(1200.0)
    assert aged.data.n_events == pytest.approx(1.0 + math.exp(-1.0))
    assert aged.data.groups == pytest.approx((1.0 + math.exp(-1.0)) / 2)
    assert aged.data.censored.sum() == pytest.approx(math.exp(-2.0))


def test_model_fit_refits_only_when_the_data_moved():
    from vllm_wa.controller.estimators import ModelFit

    d = SurvivalData()
    for g in (1.0, 2.0, 3.0, 50.0):
        d.add_event(g, 10)
    d.add_censored(500.0, 20)
    fit = ModelFit("hyperexponential")
    first = fit.get(d)
    # EM stops at its step cap here (the never mass creeps toward 0): each
    # call goes on from there until it converges.
    for _ in range(200):
        if fit._shape is not None:
            break
        first = fit.get(d)
    assert fit._shape is not None
    d.decay(0.5)  # forgetting: same shape, same fit, no work
    assert fit.get(d) is first
    d.add_event(200.0, 30)
    assert fit.get(d) is not first


# ---- when a class keeps its own model -----------------------------------------------------------


def clustered_data(rng: random.Random, p: float, mean_gap: float, lookups: int, blocks: int) -> SurvivalData:
    """Prompts of ``blocks`` blocks, freed together and reused together (or not):
    reused w.p. ``p`` after Exp(mean ``mean_gap``), else censored at a uniform
    exposure of up to 30 minutes, like a watch that expired."""
    d = SurvivalData()
    for _ in range(lookups):
        if rng.random() < p:
            gap = rng.expovariate(1.0 / mean_gap)
            for _ in range(blocks):
                d.add_event(gap)
            d.groups += 1.0
        else:
            exposure = rng.uniform(0.0, 1800.0)
            for _ in range(blocks):
                d.add_censored(exposure)
    return d


def test_log_likelihood_is_the_censored_likelihood_of_the_bins():
    m = ReuseModel((0.3, 0.2), (1.0 / 5, 1.0 / 300))
    d = SurvivalData()
    for g in (0.5, 3.0, 40.0, 900.0):
        d.add_event(g)
    d.add_censored(60.0, weight=2.0)
    mids = {b: float(x) for b, x in enumerate(_MIDS)}
    want = 0.0
    for b in np.flatnonzero(d.events):
        x = mids[int(b)]
        want += d.events[b] * math.log(0.3 / 5 * math.exp(-x / 5) + 0.2 / 300 * math.exp(-x / 300))
    for b in np.flatnonzero(d.censored):
        want += d.censored[b] * math.log(m.survival(mids[int(b)]))
    assert log_likelihood(m, d) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("family", ["hyperexponential", "exponential"])
def test_classes_of_one_law_share_the_pooled_model_and_different_laws_separate(family):
    threshold = separation_threshold(0.999, family)
    rng = random.Random(7)
    same = scaled = differ = 0
    for _ in range(20):
        a = clustered_data(rng, 0.6, 30.0, 150, 50)
        b = clustered_data(rng, 0.6, 30.0, 150, 50)
        c = clustered_data(rng, 0.6, 600.0, 150, 50)
        own_a, pooled_ab, own_c, pooled_ac = (fit_model(x, family) for x in (a, pooled(a, b), c, pooled(a, c)))
        same += separates(own_a, pooled_ab, a, threshold)
        differ += separates(own_c, pooled_ac, c, threshold)
        # Counting each block as an observation (no lookups) finds differences that are not there.
        blind = a.copy()
        blind.groups = 0.0
        scaled += separates(own_a, pooled_ab, blind, threshold)
    assert same <= 1 and differ == 20 and scaled >= 10, (same, differ, scaled)
    assert separates(own_a, pooled_ab, a, separation_threshold(0.0, family))  # 0 turns the test off


def feed_law(sink: EventSink, t0: float, gap_of, rounds: int = 40, n_conv: int = 8) -> float:
    """Conversations whose next turn comes after ``gap_of(tag, rng)`` seconds."""
    rng = random.Random(3)
    t = t0
    pending = [(t0 + 0.01 * c, c, 0) for c in range(n_conv)]
    while pending:
        pending.sort()
        t, c, r = pending.pop(0)
        tag = "tool" if c % 2 else "human"
        rid = f"{tag}-{c}-{r}"
        hashes = tuple((j, (c, j)) for j in range(4 + r))
        sink.emit(LookupEvent(EventKind.LOOKUP, t, rid, tag, tuple(h for _, h in hashes), ()))
        req = RequestTags(rid, tag, "tool" if tag == "tool" else "stop")
        for j, h in hashes:
            sink.emit(FreedEvent(EventKind.FREED, t + 0.1, h, req, j, r))
        sink.emit(FinishedEvent(EventKind.FINISHED, t + 0.1, rid, req))
        if r + 1 < rounds:
            pending.append((t + 0.1 + gap_of(tag, rng), c, r + 1))
    return t + 1.0


@pytest.mark.parametrize("tool_gap,separate", [(600.0, False), (3.0, True)])
def test_controller_scores_classes_that_do_not_separate_by_the_pooled_model(tool_gap, separate):
    sink = EventSink(capacity=1 << 20)
    clock = [0.0]
    config = small_config(tuner_enabled=False, initial="tag/hyper/posterior/L10", sample_rate=1.0,
                          class_confidence=0.999)
    c = WAController(config, 5000, Applied(), sink, clock=lambda: clock[0])
    clock[0] = feed_law(sink, 0.0, lambda tag, rng: rng.expovariate(1 / (tool_gap if tag == "tool" else 600.0)))
    c.refit()
    models = c.candidates["tag/hyper/posterior/L10"].params.models
    assert c.errors == 0
    if separate:
        assert {"tool", "human"} <= set(models)
    else:
        assert not models  # one law: every class is scored by the pooled model (LRU order)


def test_the_sample_salt_reaches_the_event_sink_and_is_checked():
    calls = []

    def install(sink, registry, key, conversations):
        calls.append(sink)
        return object(), SimpleNamespace(set_class_key=lambda k: None)

    start_online(ControllerConfig(sample_salt=7, sample_rate=0.5), 1000, install, clock=lambda: 0.0, publish=False)
    (sink,) = calls
    assert sink.salt == 7
    assert ControllerConfig.from_dict({"controller": {"sample_salt": 3}}).sample_salt == 3
    for bad in (-1, 1 << 64, 0.5, True, "1"):
        with pytest.raises(ConfigError, match="sample_salt"):
            ControllerConfig.from_dict({"controller": {"sample_salt": bad}})


def test_a_drift_detector_takes_odd_gaps_without_failing():
    """Gaps from a clock that stepped back (negative) or not numbers at all
    reach the detector as a reuse at once, or not at all: never an error
    that would stop the refit, never a NaN inside ADWIN."""
    drift = LookupDrift()
    for _ in range(50):
        assert drift.update([-5.0, 1.0, 2.0]) is False
    assert drift.update([math.nan, math.inf]) is False
    assert drift.update([]) is False
    for _ in range(200):  # and a real shift is still seen
        drift.update([600.0, 700.0])
    assert drift.drifts >= 1


def test_a_drift_detector_sees_the_median_log_gap_of_each_lookup():
    """One value per lookup: the median of its finite gaps' logs (clamped
    at zero), taken as the log of the median gap."""
    drift = LookupDrift()
    seen: list[float] = []
    drift._adwin = SimpleNamespace(update=seen.append, drift_detected=False)
    drift.update([30.0, -4.0, math.inf, 2.0, 500.0])  # finite, sorted: -4, 2, 30, 500
    drift.update([-1.0, -3.0])
    drift.update([7.0])
    assert seen == [math.log1p(30.0), 0.0, math.log1p(7.0)]


def test_the_real_cache_check_reads_only_requests_both_caches_could_fit():
    """A prompt larger than the miniature cache is predicted no hit there,
    while the real lookup counted the hits it found before the real cache
    refused the request too: counted, it read the real cache 10 points over
    the prediction on 1,000 requests of Mooncake's arXiv trace at 142 blocks
    (24.62 against 15.17).  A request the real cache refused (it leaves
    holding no blocks) but a sampled miniature cache fitted hits blocks
    there the real cache never held: counted, such requests read LRU's
    miniature cache 18 points over the real cache with half the blocks
    sampled.  Neither is checked now (the second is taken back when it
    leaves); a request that fits both still is."""
    sink = EventSink(capacity=1 << 16)
    c = WAController(small_config(initial="lru"), 8, Applied(), sink, clock=lambda: 50.0)
    assert c.shadow_blocks == 8  # every block sampled
    big = tuple(("b", i) for i in range(20))
    sink.emit(LookupEvent(EventKind.LOOKUP, 1.0, "big", "chat", big, (), 5))
    sink.emit(FinishedEvent(EventKind.FINISHED, 1.0, "big", None))
    refused = tuple(("r", i) for i in range(3))
    sink.emit(LookupEvent(EventKind.LOOKUP, 1.5, "refused", "chat", refused, (), 0))
    sink.emit(FinishedEvent(EventKind.FINISHED, 1.5, "refused", None))  # the real cache could not fit it
    small = tuple(("s", i) for i in range(4))
    sink.emit(LookupEvent(EventKind.LOOKUP, 2.0, "small", "chat", small, (), 0))
    c.refit()
    assert c.candidates["lru"].shadow.overflow == 1
    totals = c.tuner.calibration.totals["lru"]
    assert (totals.requests, totals.lookups, totals.real, totals.predicted) == (1, 4, 0, 0)
    [batch] = c.tuner.calibration.window(50.0).values()
    assert (batch.requests, batch.lookups) == (1, 4)  # the window's batches too
    sink.emit(FinishedEvent(EventKind.FINISHED, 3.0, "small", RequestTags("small", "chat", "stop")))
    c.refit()
    assert (totals.requests, totals.lookups) == (1, 4)  # finishing holding blocks keeps it


def test_a_lookup_made_before_the_live_queue_took_up_what_it_runs_checks_nothing():
    """Events are drained at the next refit, so a lookup made under a pin
    just lifted, or while a refit that switches is still fitting, is read
    after the change: its real-cache hits were the earlier configuration's,
    and they are not checked against the candidate running now."""
    sink = EventSink(capacity=1 << 16)
    now = [0.0]
    c = WAController(small_config(initial="lru", tuner_real_check_turnover=0.0), 200, Applied(), sink,
                     clock=lambda: now[0])
    c.refit()
    assert c.tuner.active == "lru"

    def look(t: float, rid: str) -> None:
        sink.emit(LookupEvent(EventKind.LOOKUP, t, rid, "chat", (("h", rid, 0), ("h", rid, 1)), (), 1))

    now[0] = 100.0
    c.pin(WAParams.from_pr_json({"a": {"x": 0.5}, "p": {"x": 0.5}}), ("tag",))
    c.refit()
    for i in range(5):
        look(106.0 + 0.1 * i, f"pinned{i}")  # under the pin, drained after the unpin
    now[0] = 108.0
    c.unpin()
    look(109.0, "after")  # under the tuner's candidate again
    now[0] = 110.0
    c.refit()
    totals = c.tuner.calibration.totals["lru"]
    assert totals.requests == 1 and c.tuner.real_check_since == 108.0

    # A switch: the swap is read on the clock once the live queue runs the
    # new candidate (here 0.4 s into the refit); a lookup stamped before that
    # ran under the old one.
    target = next(n for n in c.tuner.names if n != "lru")
    decide = c.tuner.decide

    def switch_while_fitting(t: float):
        c.tuner.decide = decide
        look(t + 0.2, "during")
        now[0] = t + 0.4
        cmp = SimpleNamespace(lead=0.0, batches=0, requests=0)
        return c.tuner._switch(t, target, "promote", cmp, 0.0)

    c.tuner.decide = switch_while_fitting
    now[0] = 120.0
    c.refit()
    assert c.tuner.active == target
    look(120.6, "new")
    now[0] = 125.0
    c.refit()
    assert c.tuner.calibration.totals[target].requests == 1  # "new" only
    assert totals.requests == 1  # and nothing more for LRU either


def test_a_pin_or_an_unpin_restarts_the_real_cache_checks_turnover():
    """The real-cache check waits for a turnover after anything changes what
    the real cache runs: a tuner switch, and also an operator's pin and unpin
    (no switch). While pinned, the real cache's hits are not checked against
    the tuner's candidate, which is not what runs."""
    sink = EventSink(capacity=1 << 16)
    now = [0.0]
    c = WAController(small_config(), 200, Applied(), sink, clock=lambda: now[0])
    c.refit()  # the first swap: the initial candidate, checked from the start
    assert c.tuner.active != "lru" and c.tuner.real_check_since == -math.inf

    def evict(n: int) -> None:
        for i in range(n):
            sink.emit(EvictedEvent(EventKind.EVICTED, now[0], ("e", now[0], i)))

    now[0] = 10.0
    c.pin(WAParams.from_pr_json({"a": {"x": 0.5}, "p": {"x": 0.5}}), ("tag",))
    c.refit()
    assert c.tuner.real_check_since == math.inf
    before = c.tuner.calibration.totals.get(c.tuner.active)
    req = RequestTags("r", "chat", "stop")
    sink.emit(FreedEvent(EventKind.FREED, 11.0, ("h", 0), req, 0, 0))
    sink.emit(LookupEvent(EventKind.LOOKUP, 12.0, "n", "chat", (("h", 0),), (), 1))
    now[0] = 20.0
    evict(200)  # a turnover of the 200 sampled blocks, under the pin
    c.refit()
    assert c.tuner.calibration.totals.get(c.tuner.active) == before  # the pin's hits checked nothing
    assert c.tuner.real_check_since == 20.0
    now[0] = 30.0
    c.unpin()
    c.refit()
    assert c.tuner.real_check_since == math.inf  # the candidate runs again: a new turnover
    now[0] = 40.0
    evict(200)
    c.refit()
    assert c.tuner.real_check_since == 40.0


def test_the_state_says_when_the_real_cache_check_began_counting():
    """The README points operators at ``/wa/params`` ``real_check_since``; the
    controller's state dropped the tuner's field."""
    sink = EventSink(capacity=100000)
    clock = [0.0]
    c = WAController(small_config(initial="lru"), 200, Applied(), sink, clock=lambda: clock[0], publish=False)
    clock[0] = feed(sink, clock[0])
    c.refit()
    assert c.state()["real_check_since"] == c.tuner.state(clock[0])["real_check_since"]
    c.tuner.real_check_since = 12.5  # as a switch's turnover sets it
    assert c.state()["real_check_since"] == 12.5


@pytest.mark.parametrize("weigh, drift_forget", [(True, 1.0), (True, 0.25), (False, 1.0)])
def test_forgetting_weighs_each_observation_by_its_blocks_free_time_so_steady_traffic_fits_its_law(weigh, drift_forget):
    """Blocks freed at a steady rate, 60 % reused after a 10-s or 600-s gap
    (70/30): the fit the controller keeps under forgetting must find that law.
    Recorded with weight 1 and then aged, an observation weighed by when it
    ended, so the blocks still watched and the watches that expired (up to
    ``max_watch_s`` after their free) outweighed the reuses, and the fit read
    about a third of the reuse within 30 s there is (0.14 against 0.41).
    With drift cuts on (ADWIN fires a few times on this bimodal stream), a cut
    that forgot what was recorded before it, and not the blocks freed before
    it, kept those blocks' slow outcomes and dropped their quick ones (0.28).
    ``weigh_by_free_time`` is opt-in (configs/controller.toml says why): off,
    the fit keeps that bias."""
    memory_s, watch_s, rate, horizon = 600.0, 2400.0, 2.0, 6000.0
    rng = random.Random(11)
    events: list[tuple[float, int, int]] = []  # (time, 0 = freed / 1 = looked up, block)
    t, i = 0.0, 0
    while t < horizon:
        t += rng.expovariate(rate)
        events.append((t, 0, i))
        if rng.random() < 0.6:
            gap = rng.expovariate(1 / 10.0) if rng.random() < 0.7 else rng.expovariate(1 / 600.0)
            events.append((t + gap, 1, i))
        i += 1
    events.sort()
    config = small_config(tuner_enabled=False, initial="tag/hyper/posterior/L10", sample_rate=1.0,
                          class_confidence=0.0, min_samples=30, memory_s=memory_s, max_watch_s=watch_s,
                          drift_forget=drift_forget, weigh_by_free_time=weigh)
    sink = EventSink(capacity=1 << 20)
    now = [0.0]
    c = WAController(config, 100_000, Applied(), sink, clock=lambda: now[0])
    refit_at = 30.0
    for when, kind, block in events:
        while when > refit_at:
            now[0] = refit_at
            c.refit()
            refit_at += 30.0
        if when > horizon:
            break
        if kind == 0:
            req = RequestTags(f"r{block}", "x", "stop")
            sink.emit(FreedEvent(EventKind.FREED, when, ("b", block), req, 0, 0))
            sink.emit(FinishedEvent(EventKind.FINISHED, when, f"r{block}", req))
        else:
            sink.emit(LookupEvent(EventKind.LOOKUP, when, f"q{block}", "x", (("b", block),), ()))
    assert c.errors == 0
    if drift_forget < 1.0:
        assert any(e["key"] == "tag" for e in c.drift_events)  # the key fitted here was cut
    model = c.candidates["tag/hyper/posterior/L10"].params.models["x"]

    def reused_by(s: float) -> float:
        return 0.6 * (0.7 * (1 - math.exp(-s / 10.0)) + 0.3 * (1 - math.exp(-s / 600.0)))

    if not weigh:
        assert 1.0 - model.survival(30.0) < 0.6 * reused_by(30.0)
        return
    for s in (30.0, 600.0):
        assert 1.0 - model.survival(s) == pytest.approx(reused_by(s), abs=0.05), s


def test_a_drift_cut_forgets_the_blocks_freed_before_it_whenever_their_outcome_comes():
    """A cut at t = 100 keeps ``forget`` of the class: of a block freed before
    it, a reuse or a censoring recorded later is kept at ``forget`` too (a
    second cut: ``forget`` squared), as is a block still watched; a block
    freed after it counts in full.  Cut times no watched block predates are dropped."""
    d = ClassDrift(forget=0.25)
    counts = np.zeros((2, NUM_BINS))
    counts[0, 3] = 8.0
    d.cut("c", counts, 100.0)
    data = SurvivalData(counts[0].copy(), counts[1].copy())
    data.events[5] += 1.0  # a late reuse of a block freed at 50
    d.forget_late("c", False, 5, 1.0, 50.0)
    data.censored[7] += 2.0  # a censoring of a block freed at 150: kept in full
    d.forget_late("c", True, 7, 2.0, 150.0)
    view = d.view("c", data)
    assert view.events[3] == pytest.approx(2.0) and view.events[5] == pytest.approx(0.25)
    assert view.censored[7] == pytest.approx(2.0)
    d.cut("c", np.stack((data.events, data.censored)), 200.0)
    assert d.kept("c", 50.0) == pytest.approx(0.0625) and d.kept("c", 150.0) == 0.25 and d.kept("c", 250.0) == 1.0
    watched = d.late_weights("c", np.array([50.0, 150.0, 250.0]), np.array([1.0, 1.0, 1.0]))
    assert watched == pytest.approx([1 - 0.0625, 0.75, 0.0])
    d.prune(120.0)
    assert d.kept("c", 50.0) == 0.25 and d.late()
    d.prune(200.0)
    assert not d.late() and d.kept("c", 50.0) == 1.0


def test_a_gap_that_is_not_a_number_is_no_observation():
    """``max(0.0, nan)`` is 0.0: a NaN gap was binned as an instant reuse, and one
    such value beside a real 2-s gap made the fit read p = 1."""
    d = SurvivalData()
    d.add_event(float("nan"))
    d.add_censored(float("nan"))
    assert d.n == 0.0
    d.add_event(float("inf"))  # an unbounded gap is the last bin's, as before
    assert d.events[-1] == 1.0


@pytest.mark.parametrize("weigh", [False, True])
def test_a_reuse_and_a_censoring_that_end_between_the_same_refits_weigh_alike(weigh):
    """Two blocks freed together: one comes back just before a refit, the
    other's watch runs out at it. Both end within the same interval and must
    weigh the same; forgetting after recording the drained reuses (and before
    the expired watches) aged the reuse by one more interval: 0.37 against 1
    here, where the interval equals ``memory_s``."""
    cfg = small_config(
        tuner_enabled=False, sample_rate=1.0, memory_s=1000.0, max_watch_s=1000.0,
        weigh_by_free_time=weigh, drift_forget=1.0, fit_interval_s=1e9,
    )
    sink = EventSink(capacity=1 << 16)
    now = [0.0]
    c = WAController(cfg, 1000, Applied(), sink, clock=lambda: now[0])
    req = RequestTags("r", "x", "stop")
    sink.emit(FreedEvent(EventKind.FREED, 0.0, ("b", "A"), req, 0, 0))
    sink.emit(FreedEvent(EventKind.FREED, 0.0, ("b", "B"), req, 0, 0))
    sink.emit(FinishedEvent(EventKind.FINISHED, 0.0, "r", req))
    c.refit()
    sink.emit(LookupEvent(EventKind.LOOKUP, 999.9, "q", "x", (("b", "A"),), ()))
    now[0] = 1000.0
    c.refit()
    row = c._bank.rows[0]
    assert c.errors == 0 and row.events.sum() > 0
    assert row.events.sum() == pytest.approx(row.censored.sum(), rel=1e-3)  # 0.1 s apart


def test_a_refit_at_a_clock_that_reads_nan_changes_nothing_and_is_counted():
    """At NaN every watch looked expired: all were dropped as censored with no
    exposure recorded, and forgetting was stamped NaN."""
    sink = EventSink(capacity=1 << 20)
    now = [0.0]
    c = WAController(small_config(max_watch_s=7200.0), 200, Applied(), sink, clock=lambda: now[0])
    now[0] = feed(sink, 0.0)
    c.refit()
    def observations() -> float:
        return sum(row.n for row in c._bank.rows)

    watched, last_forget, seen = len(c.tracker.watch), c._last_forget, observations()
    assert watched > 0 and c.errors == 0
    good = now[0]
    now[0] = math.nan
    c.refit()
    assert c.errors == 1 and "nan" in c.last_error
    assert (len(c.tracker.watch), c._last_forget, observations()) == (watched, last_forget, seen)
    now[0] = good + 1.0
    c.refit()
    assert c.errors == 1 and len(c.tracker.watch) == watched


def test_a_refit_error_that_repeats_logs_its_traceback_once(caplog, monkeypatch):
    """A clock stuck at NaN failed every refit, and each failure logged a full
    traceback: one every ``refit_interval_s`` for as long as it lasted.  Each
    failure is still counted; a cause is the error's type and the line that
    raised it (a message may carry values: NaN, then inf, is one cause), and
    a new cause is still logged."""
    now = [math.nan]
    c = WAController(small_config(), 200, Applied(), EventSink(capacity=1024), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="vllm_wa.controller.controller"):
        for _ in range(5):
            c.refit()
        now[0] = math.inf
        c.refit()
        now[0] = 10.0

        def broken(now: float) -> None:
            raise RuntimeError(f"at {now}")

        monkeypatch.setattr(c, "_refit", broken)
        c.refit()
        now[0] = 20.0
        c.refit()
    assert c.errors == 8
    logged = [r for r in caplog.records if "refit failed" in r.getMessage()]
    assert len(logged) == 2 and all(r.exc_info for r in logged)
    assert [r.exc_info[0] for r in logged] == [ValueError, RuntimeError]


def test_an_event_whose_time_is_not_finite_is_skipped_and_counted_not_the_batch():
    """One LOOKUP at NaN (or inf) time raised in the tuner's batching: the
    refit failed, and the rest of the drained batch was lost uncounted."""
    def run(bad_times):
        sink = EventSink(capacity=100000)
        clock = [0.0]
        c = WAController(small_config(), 200, Applied(), sink, clock=lambda: clock[0])
        t = feed(sink, 0.0)
        for bad in bad_times:
            sink.emit(LookupEvent(EventKind.LOOKUP, bad, f"x{bad}", "tool", (("z", 1),), ()))
        clock[0] = feed(sink, t)
        c.refit()
        return c

    clean, dirty = run(()), run((math.nan, math.inf, -math.inf))
    assert dirty.errors == 0 and dirty.refits == 1
    assert dirty.events_bad_time == 3 and clean.events_bad_time == 0
    assert dirty.events_processed == clean.events_processed + 3
    assert dirty.tracker.reuses == clean.tracker.reuses > 0
    assert dirty.state()["events_bad_time"] == 3
    assert dirty.tuner.state(math.nan)["window_rates"] == {}


def test_an_event_whose_handling_raises_is_skipped_and_the_batch_finishes_its_requests(monkeypatch):
    """An error in one event ended the batch: its FINISHED events were lost,
    and the miniature caches held those requests' blocks pinned for
    ``max_watch_s`` (a refit failing now and then filled them: every
    candidate read about no hits)."""
    cfg = small_config(shadow_blocks=64, sample_rate=1.0)
    c = WAController(cfg, 64, Applied(), EventSink(capacity=1 << 16), clock=lambda: 0.0)
    shadow = c.candidates["lru"].shadow
    lookup = type(shadow).lookup

    def buggy(self, rid, *args, **kwargs):
        if rid == "bad":
            raise RuntimeError("a bug in one event's handling")
        return lookup(self, rid, *args, **kwargs)

    monkeypatch.setattr(type(shadow), "lookup", buggy)
    events = []
    for i, rid in enumerate(("a", "bad", "b")):
        events.append(LookupEvent(EventKind.LOOKUP, 1.0 + i, rid, "chat", ((rid, 0), (rid, 1)), ()))
    for i, rid in enumerate(("a", "bad", "b")):
        events.append(FinishedEvent(EventKind.FINISHED, 5.0 + i, rid, RequestTags(rid, "chat", "stop")))
    c.process(events)
    assert c.events_failed == 1 and c.state()["events_failed"] == 1
    assert c.events_processed == len(events)
    assert not any(s.cache.holds(rid) for s in c._shadows for rid in ("a", "b"))
    pool = shadow.cache.pool
    assert sum(1 for b in pool.blocks if b.ref_cnt > 0 and b is not pool.null_block) == 0


def test_an_injected_refit_fault_fails_the_refit_after_its_events_are_applied(monkeypatch):
    """``VLLM_WA_FAULT_REFIT_EVERY`` models a bug in the learning code: the
    refit fails and counts, but the drained events (finishes included) are applied."""
    sink = EventSink(capacity=100000)
    clock = [0.0]
    c = WAController(small_config(), 200, Applied(), sink, clock=lambda: clock[0])
    faults.inject_refit_faults(c, 1)
    clock[0] = feed(sink, 0.0)
    drained = len(sink)
    c.refit()
    assert c.errors == 1 and "InjectedFault" in c.last_error
    assert len(sink) == 0 and c.events_processed == drained and c.tracker.reuses > 0


def test_a_repeated_lookup_of_a_request_one_miniature_cache_holds_pins_nothing_for_good():
    """LRU's miniature cache could not fit R, the candidate's could; R's
    finish was lost and the engine looked it up again.  Only LRU's cache was
    asked whether R was held, so the candidate's admitted R a second time, and
    the first admission's blocks stayed pinned after every request finished."""
    spec = CandidateSpec(("tag",), "exponential", "posterior", 10.0)
    cfg = small_config(candidates=(spec,), initial="lru", shadow_blocks=6, sample_rate=1.0)
    c = WAController(cfg, 6, Applied(), EventSink(capacity=1 << 16), clock=lambda: 0.0)
    lru, cand = c.candidates["lru"].shadow, c.candidates[spec.name].shadow
    cand.set_params(WAParams(
        models={"keep": ReuseModel.exponential(0.99, 1.0), "drop": ReuseModel.exponential(0.01, 1e-4)},
        default=ReuseModel.exponential(0.5, 0.01), horizon=10.0,
    ))

    def look(t, rid, tag, hashes):
        return LookupEvent(EventKind.LOOKUP, t, rid, tag, tuple(hashes), ())

    def done(t, rid, tag):
        return FinishedEvent(EventKind.FINISHED, t, rid, RequestTags(rid, tag, "stop"))

    c.process([look(1, "A", "keep", ["p"]), done(2, "A", "keep"),
               look(3, "B", "drop", ["d1", "d2"]), done(4, "B", "drop"),
               look(5, "Q", "drop", ["k1", "k2", "k3"]),
               look(6, "R", "keep", ["p", "k1", "k2", "k3"])])
    assert not lru.cache.holds("R") and cand.cache.holds("R")  # the caches disagree
    c.process([look(7, "R", "keep", ["p", "k1", "k2", "k3"]), done(8, "R", "keep"), done(9, "Q", "drop")])

    def pinned(shadow):
        pool = shadow.cache.pool
        return sum(1 for b in pool.blocks if b.ref_cnt > 0 and b is not pool.null_block)

    assert pinned(lru) == 0 and pinned(cand) == 0


def test_a_fit_stopped_at_its_em_step_cap_goes_on_at_the_next_call():
    """Heavy censoring makes EM creep: 20 reuses at 300 s beside 2,000 watches
    cut at 5 s read p = 0.648 after the 200 steps, against the maximum
    likelihood p = 1, a = events / exposure.  Forgetting leaves the shape of
    the data as it is, so the fit was kept as it stood, for good."""
    from vllm_wa.controller.estimators import ModelFit
    from vllm_wa.controller.survival import exponential_em, hyperexponential_em

    data = SurvivalData()
    for _ in range(20):
        data.add_event(300.0)
    for _ in range(2000):
        data.add_censored(5.0)
    p, _, converged = exponential_em(data)
    assert p < 0.7 and not converged
    a_mle = data.n_events / float(data.events @ _MIDS + data.censored @ _MIDS)
    fit = ModelFit("exponential")
    assert fit.get(data).p < 0.7
    for _ in range(20):
        data.decay(0.99)  # a refit's forgetting: the same shape
        model = fit.get(data)
    assert model.p == pytest.approx(1.0, abs=1e-3) and model.rates[0] == pytest.approx(a_mle, rel=1e-3)
    # The hyperexponential fit the same way: it reaches what EM gives with no cap.
    _, _, converged = hyperexponential_em(data)
    assert not converged
    best, _ = fit_hyperexponential(data, iters=100000)
    fit = ModelFit("hyperexponential")
    for _ in range(200):
        data.decay(0.99)
        model = fit.get(data)
    assert log_likelihood(model, data) == pytest.approx(log_likelihood(best, data), abs=1e-3)

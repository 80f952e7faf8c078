"""The tuner: paired evidence, promotion by a bound that holds at every look, fast demotion;
and the controller as the one owner of the live parameters."""

from __future__ import annotations

import math
import random
import threading
from dataclasses import replace

import pytest

from vllm_wa.controller.calibration import Calibration
from vllm_wa.controller.config import ConfigError, ControllerConfig
from vllm_wa.controller.controller import WAController
from vllm_wa.controller.tuner import LRU, PairedHits, Switch, Tuner, TunerSettings, sequential_z
from vllm_wa.engine_patch.events import EventSink
from vllm_wa.params import ReuseModel, WAParams, params_changed

WA = "wa"
SETTINGS = TunerSettings(margin=0.003, window_s=900, demote_window_s=300, batch_s=30, min_requests=200, min_batches=6)


def stream(tuner: Tuner, rng: random.Random, t0: float, t1: float, p_lru: float, p_wa: float, rate: float = 2.0):
    """Sampled requests at ``rate``/s, 8 sampled blocks each; each block hits
    in LRU's cache w.p. ``p_lru`` and in WA's w.p. ``p_wa`` (paired: one draw)."""
    t = t0
    while t < t1:
        u = [rng.random() for _ in range(8)]
        tuner.record(t, 8, [sum(x < p_lru for x in u), sum(x < p_wa for x in u)])
        t += 1.0 / rate


def run(tuner: Tuner, rng: random.Random, t0: float, t1: float, p_lru: float, p_wa: float, refit_s: float = 5.0):
    t = t0
    while t < t1:
        stream(tuner, rng, t, t + refit_s, p_lru, p_wa)
        t += refit_s
        tuner.decide(t)


def test_starts_on_lru_and_a_young_window_never_promotes():
    tuner = Tuner([LRU, WA], SETTINGS)
    assert tuner.active == LRU
    rng = random.Random(0)
    # A large early lead, but fewer batches than min_batches: no promotion.
    run(tuner, rng, 0.0, 5 * 30.0, 0.30, 0.60)
    assert tuner.active == LRU and tuner.promotions == 0
    run(tuner, rng, 150.0, 400.0, 0.30, 0.60)
    assert tuner.active == WA and tuner.promotions == 1
    sw = tuner.switches[-1]
    assert sw.reason == "promote" and sw.lower_bound > SETTINGS.margin and sw.requests >= 200


def test_a_lead_within_noise_never_promotes():
    tuner = Tuner([LRU, WA], SETTINGS)
    rng = random.Random(1)
    # The same hit probability: any lead is noise, over two hours of refits.
    run(tuner, rng, 0.0, 7200.0, 0.40, 0.40)
    assert tuner.promotions == 0 and tuner.active == LRU


def test_a_small_true_lead_promotes_only_over_the_full_window_margin():
    # +0.05 points: under both margins, never in an hour.
    tuner = Tuner([LRU, WA], SETTINGS)
    run(tuner, random.Random(2), 0.0, 3600.0, 0.400, 0.4005)
    assert tuner.promotions == 0
    # +0.2 points: under the 0.3-point margin of a young window, over the
    # full window's 0.1: it moves, and only on a full window.
    tuner = Tuner([LRU, WA], SETTINGS)
    run(tuner, random.Random(2), 0.0, 3600.0, 0.400, 0.402)
    assert tuner.promotions == 1
    sw = tuner.switches[-1]
    assert sw.batches >= 30 and sw.requests >= SETTINGS.full_window_min_requests
    assert SETTINGS.full_window_margin < sw.lower_bound < SETTINGS.margin


def test_leads_early_loses_later_back_on_lru_within_the_demotion_window():
    tuner = Tuner([LRU, WA], SETTINGS)
    rng = random.Random(3)
    run(tuner, rng, 0.0, 1200.0, 0.30, 0.40)
    assert tuner.active == WA
    crossover = 1200.0
    t = crossover
    while tuner.active == WA and t < crossover + 3600:
        stream(tuner, rng, t, t + 5.0, 0.40, 0.30)
        t += 5.0
        tuner.decide(t)
    assert tuner.active == LRU and tuner.demotions == 1
    # Deadline: within the demotion window after the crossover.
    assert t - crossover <= SETTINGS.demote_window_s
    assert tuner.switches[-1].reason == "demote"
    # The demoted candidate's early lead no longer counts: it stays demoted.
    run(tuner, rng, t, t + 600.0, 0.40, 0.30)
    assert tuner.active == LRU


def test_a_demotion_on_a_short_dip_is_undone_when_the_lead_comes_back():
    """WA leads LRU by 6 to 10 points for hours but for a dip of a few minutes: the
    dip demotes it (a demotion is quick), and once WA leads again over the
    demotion window since then, at the demotion's bar, it is back sooner
    than the promotion bar, which starts its evidence again, could move it."""
    tuner = Tuner([LRU, WA], SETTINGS)
    rng = random.Random(0)
    run(tuner, rng, 0.0, 1200.0, 0.30, 0.40)
    assert tuner.active == WA
    t = dip = 1200.0
    while tuner.active == WA and t < dip + 600.0:  # the dip, until it demotes WA
        run(tuner, rng, t, t + 5.0, 0.45, 0.20)
        t += 5.0
    assert tuner.active == LRU and tuner.reinstatable == WA
    demoted = tuner.switches[-1].time
    while tuner.active == LRU and t < 3600.0:  # a 6-point lead again
        run(tuner, rng, t, t + 5.0, 0.30, 0.36)
        t += 5.0
    assert tuner.active == WA and [sw.reason for sw in tuner.switches] == ["promote", "demote", "promote"]
    # Sooner than any promotion could: that needs min_batches batches since the demotion.
    assert t - demoted < (SETTINGS.min_batches - 1) * SETTINGS.batch_s
    assert tuner.reinstatable is None


def test_a_demoted_candidate_that_stays_behind_is_not_reinstated():
    tuner = Tuner([LRU, WA], SETTINGS)
    rng = random.Random(5)
    run(tuner, rng, 0.0, 1200.0, 0.30, 0.40)
    run(tuner, rng, 1200.0, 1500.0, 0.45, 0.20)
    assert tuner.active == LRU
    run(tuner, rng, 1500.0, 3600.0, 0.40, 0.40)  # level with LRU: no lead to come back on
    assert tuner.active == LRU and tuner.promotions == 1
    # A promotion window after the demotion the quick way back is closed: a
    # per-look bar tested for hours would bring a candidate back on noise.
    assert tuner.reinstatable is None


def stream_three(tuner: Tuner, rng: random.Random, t0: float, t1: float, p: tuple[float, float, float]) -> None:
    """Like ``stream`` for three candidates (LRU, A, B), paired by one draw per block."""
    t = t0
    while t < t1:
        u = [rng.random() for _ in range(8)]
        tuner.record(t, 8, [sum(x < q for x in u) for q in p])
        t += 0.5


def run_three(tuner: Tuner, rng: random.Random, t0: float, t1: float, p: tuple[float, float, float]) -> None:
    """Like ``run`` for three candidates: ``stream_three`` with a decision every 5 s."""
    t = t0
    while t < t1:
        stream_three(tuner, rng, t, t + 5.0, p)
        t += 5.0
        tuner.decide(t)


def test_a_candidate_that_falls_behind_another_is_replaced_within_the_demotion_window():
    """A leads early and is promoted; then B leads A (both still ahead of LRU):
    the tuner moves from A to B without going back to LRU, within the
    demotion window; with replacement off the mixture boundary takes longer."""
    a, b = "a", "b"
    times = {}
    for conf in (0.99, 0.0):
        settings = TunerSettings(
            margin=0.003, window_s=900, demote_window_s=300, batch_s=30, min_requests=200, min_batches=6,
            replace_confidence=conf,
        )
        tuner = Tuner([LRU, a, b], settings)
        rng = random.Random(4)
        run_three(tuner, rng, 0.0, 1500.0, (0.30, 0.45, 0.35))
        assert tuner.active == a and tuner.promotions == 1
        crossover = t = 1500.0
        while tuner.active == a and t < crossover + 3600:
            run_three(tuner, rng, t, t + 5.0, (0.30, 0.33, 0.45))
            t += 5.0
        assert tuner.active == b and tuner.demotions == 0
        times[conf] = t - crossover
        sw = tuner.switches[-1]
        assert sw.reason == ("replace" if conf else "promote")
        assert tuner.replacements == (1 if conf else 0)
        if conf:  # the replaced candidate's earlier lead no longer counts
            assert tuner.evidence_since[a] == sw.time
    assert times[0.99] <= 300.0 < times[0.0]


def test_replacement_never_moves_on_noise_or_away_from_lru():
    settings = TunerSettings(margin=0.003, window_s=900, demote_window_s=300, batch_s=30, min_requests=200, min_batches=6)
    tuner = Tuner([LRU, "a", "b"], settings)
    rng = random.Random(5)
    run_three(tuner, rng, 0.0, 1200.0, (0.30, 0.40, 0.30))
    assert tuner.active == "a"
    # A and B equal (both ahead of LRU) for two hours of refits: no move.
    run_three(tuner, rng, 1200.0, 8400.0, (0.30, 0.40, 0.40))
    assert tuner.active == "a" and tuner.replacements == 0
    # On LRU it never fires, whatever the candidates do between them: leaving
    # LRU takes a promotion's evidence.
    tuner = Tuner([LRU, "a", "b"], settings)
    stream_three(tuner, rng, 0.0, 600.0, (0.30, 0.30, 0.60))
    assert tuner.active == LRU
    assert tuner._replacement(600.0) is None and tuner._promotion(600.0) is not None


def run_unpaired(tuner: Tuner, rng: random.Random, t0: float, t1: float, p: tuple[float, ...]) -> float:
    """Every candidate draws its own hits (equal candidates differ by noise), a decision every 5 s."""
    t = t0
    while t < t1:
        end = t + 5.0
        while t < end:
            tuner.record(t, 8, [sum(rng.random() < q for _ in range(8)) for q in p])
            t += 0.5
        tuner.decide(t)
    return t


def run_while_running(
    tuner: Tuner, rng: random.Random, t0: float, p: tuple[float, ...], limit: float = 3600.0
) -> float:
    """``run_unpaired`` from ``t0`` while the candidate running at ``t0`` still runs (at most ``limit`` s)."""
    name, t = tuner.active, t0
    while tuner.active == name and t < t0 + limit:
        t = run_unpaired(tuner, rng, t, t + 5.0, p)
    return t


def test_replacement_leaves_only_a_candidate_that_trails_the_field():
    """Candidates a and b equally ahead, c and d a little ahead of LRU: noise
    between a and b moved the tuner on five of eight seeds in two hours with
    the gate off; with it (the others' median must lead the running one) it
    never moves. When a falls behind the field, the gate opens and a is
    replaced by the leader within one and a half demotion windows."""
    names = [LRU, "a", "b", "c", "d"]
    moved = {}
    for gate in (0.95, 0.0):
        moved[gate] = 0
        for seed in range(8):
            settings = TunerSettings(
                margin=0.003, window_s=900, demote_window_s=300, batch_s=30, min_requests=200, min_batches=6,
                replace_confidence=0.95, replace_gate_confidence=gate,
            )
            tuner = Tuner(names, settings)
            rng = random.Random(seed)
            run_unpaired(tuner, rng, 0.0, 1200.0, (0.30, 0.40, 0.30, 0.30, 0.30))
            assert tuner.active == "a"
            run_unpaired(tuner, rng, 1200.0, 8400.0, (0.30, 0.40, 0.40, 0.33, 0.33))
            moved[gate] += tuner.active != "a"
    assert moved[0.95] == 0 and moved[0.0] >= 3
    for seed in range(8):
        tuner = Tuner(names, TunerSettings(margin=0.003, window_s=900, demote_window_s=300, batch_s=30,
                                           min_requests=200, min_batches=6))
        rng = random.Random(seed)
        run_unpaired(tuner, rng, 0.0, 1200.0, (0.30, 0.40, 0.30, 0.30, 0.30))
        t = run_while_running(tuner, rng, crossover := 1200.0, (0.30, 0.34, 0.42, 0.36, 0.36))
        # Two points behind the others' median: within 300 s on seven seeds of
        # eight, 420 s on one (the mean, four points ahead, took at most 300 s).
        assert tuner.active == "b" and t - crossover <= 450.0
        assert tuner.switches[-1].reason == "replace" and tuner.demotions == 0


def test_a_lasting_lead_replaces_the_second_best_where_the_field_does_not_suit_the_traffic():
    """a runs, b leads it by six points, and c, d, e (keys that do not suit
    this traffic) read what LRU reads: the others' median (c, d, e) never
    leads a, so the gate alone would keep a for good. b's lead over a full
    promotion window, at the full window's bar, opens it: the tuner moves
    to b, by replacement, within the promotion window and a demotion window
    of the change, on every seed, while the gate itself stays shut."""
    names = [LRU, "a", "b", "c", "d", "e"]
    settings = TunerSettings(margin=0.003, window_s=900, demote_window_s=300, batch_s=30, min_requests=200,
                             min_batches=6)
    for seed in range(6):
        tuner = Tuner(names, settings)
        rng = random.Random(seed)
        run_unpaired(tuner, rng, 0.0, 1200.0, (0.30, 0.40, 0.30, 0.30, 0.30, 0.30))
        assert tuner.active == "a"
        t = run_while_running(tuner, rng, change := 1200.0, (0.30, 0.40, 0.46, 0.30, 0.30, 0.30))
        assert tuner.active == "b" and tuner.switches[-1].reason == "replace", seed
        assert t - change <= settings.window_s + settings.demote_window_s, (seed, t - change)
        # What the gate saw of a at the move: the others' median behind it.
        assert tuner.hits.compare_median(["b", "c", "d", "e"], "a", t - settings.demote_window_s).lead < 0


def test_replacement_takes_the_largest_measured_lead_among_those_that_clear_its_bar():
    """b and c both beat the running a over the demotion window: c by a steady
    5 points (its bound is its lead), b by 15 points on average but unevenly.
    b's bound is the lower, its lead the larger: the tuner moves to b."""
    names = [LRU, "a", "b", "c"]
    tuner = Tuner(names, SETTINGS)
    tuner.active, tuner.active_since = "a", 0.0
    for k in range(10):  # ten 30-s batches of 100 sampled lookups
        tuner.record(30.0 * k + 1.0, 100, [30, 40, 41 if k % 2 else 69, 45])
    now = 300.0
    since = tuner._running_window(now)
    b, c = tuner.hits.compare("b", "a", since), tuner.hits.compare("c", "a", since)
    q = tuner._replace_quantile(b.batches)
    assert b.lead > c.lead and SETTINGS.margin < b.lower(q) < c.lower(q)
    sw = tuner.decide(now)
    assert sw is not None and sw.reason == "replace" and sw.to_candidate == "b"
    assert sw.lead == pytest.approx(b.lead) and tuner.active == "b"


def test_compare_median_is_the_per_batch_median_of_the_group():
    hits = PairedHits([LRU, "a", "b", "c", "d"], batch_s=30.0, keep_s=300.0)
    for k in range(4):  # four batches of 100 lookups each
        hits.add(30.0 * k + 1.0, 100, [40, 50 + k, 10, 45, 70])
    # One member: the pairwise comparison.
    one, pair = hits.compare_median(["a"], LRU, 0.0), hits.compare("a", LRU, 0.0)
    assert (one.lead, one.stderr, one.batches) == (pair.lead, pair.stderr, pair.batches)
    # Three: the middle one per batch (c's 45 against a's 50-53 and b's 10), whatever b does.
    assert hits.compare_median(["a", "b", "c"], LRU, 0.0).lead == pytest.approx(0.05)
    # Even: the mean of the middle two (a and c).
    assert hits.compare_median(["a", "b", "c", "d"], LRU, 0.0).lead == pytest.approx((51.5 + 45) / 2 / 100 - 0.40)


def test_leaving_lru_shares_the_mixture_bars_error_among_the_candidates():
    """Eight candidates, each as good as LRU, on thin windows (the mixture
    boundary, no full-window bar): leaving LRU for the best of eight at the
    per-candidate bar moved on 5 of 24 seeds in 40 minutes; with the bar's
    error split among the eight (Bonferroni), on 2."""
    names = [LRU] + [f"c{i}" for i in range(8)]
    left = {}
    for corrected in (True, False):
        left[corrected] = 0
        for seed in range(24):
            settings = TunerSettings(min_requests=50, full_window_min_requests=10**9)
            tuner = Tuner(names, settings)
            assert tuner._leave_lru_confidence == pytest.approx(1 - 0.05 / 8)
            if not corrected:
                tuner._leave_lru_confidence = settings.confidence
            run_unpaired(tuner, random.Random(seed), 0.0, 2400.0, (0.30,) * 9)
            left[corrected] += tuner.promotions > 0
    assert left[True] <= 2 and left[False] >= 4


def test_a_poor_candidate_does_not_hold_the_gate_shut():
    """The gate asks whether the running candidate trails most of the others
    (their median), not their mean: one candidate far behind (e, at 5 % hit
    rate: a key that suits other traffic) pulls the mean below a running
    candidate that every other one beats (with the mean the move came
    615 to 690 s after the crossover, or went to LRU instead)."""
    names = [LRU, "a", "b", "c", "d", "e"]
    for seed in range(8):
        tuner = Tuner(names, TunerSettings(margin=0.003, window_s=900, demote_window_s=300, batch_s=30,
                                           min_requests=200, min_batches=6))
        rng = random.Random(seed)
        run_unpaired(tuner, rng, 0.0, 1200.0, (0.30, 0.40, 0.30, 0.30, 0.30, 0.05))
        assert tuner.active == "a"
        # The others' mean, (0.42 + 0.36 + 0.36 + 0.05) / 4 = 0.2975, is below a's 0.30.
        t = run_while_running(tuner, rng, crossover := 1200.0, (0.30, 0.30, 0.42, 0.36, 0.36, 0.05))
        assert tuner.active == "b" and t - crossover <= 300.0
        assert tuner.switches[-1].reason == "replace"


def just_promoted_demotions(episodes: int, seed: int) -> int:
    """Candidates as good as LRU, checked for demotion three batches after
    their promotion (each batch's lead is noise of 1 point)."""
    rng = random.Random(seed)
    demoted = 0
    for _ in range(episodes):
        tuner = Tuner([LRU, WA], SETTINGS, initial=WA)  # the window holds only the three batches below
        for b in range(3):
            diff = round(1000 * rng.gauss(0.0, 0.01))
            tuner.record(30.0 * b + 1.0, 1000, [400 + diff, 400])
        demoted += tuner.decide(61.0) is not None
    return demoted


def test_noise_in_the_few_batches_after_a_promotion_does_not_demote():
    # Student's t on three batches (two degrees of freedom): about 5 % of
    # noise-only windows clear the bound. A normal quantile on so few batches
    # demoted about three times as often.
    assert just_promoted_demotions(400, seed=11) <= 0.065 * 400
    assert Tuner([LRU, WA], SETTINGS)._demote_quantile(2) == pytest.approx(6.314, abs=1e-3)


def demoted_on(noise: int) -> Switch | None:
    """Ten batches in which LRU leads the running candidate by 6 hits in 1,000
    (0.6 points, twice the margin), each batch off by +-``noise`` hits."""
    tuner = Tuner([LRU, WA], SETTINGS, initial=WA)
    for b in range(10):
        diff = 6 + (noise if b % 2 else -noise)
        tuner.record(30.0 * b + 1.0, 1000, [400 + diff, 400])
    return tuner.decide(30.0 * 9 + 2.0)


def test_demotes_when_lrus_lead_clears_the_margin_with_confidence():
    # +-8 hits: standard error 0.27 points, bound 0.6 - 1.83 x 0.27 = 0.11 points:
    # above zero but under the 0.3-point margin, so the candidate stays.
    assert demoted_on(8) is None
    # +-2 hits: standard error 0.07 points, bound 0.48 > 0.3: back to LRU.
    sw = demoted_on(2)
    assert sw is not None and sw.reason == "demote" and sw.to_candidate == LRU
    assert sw.lead == pytest.approx(0.006) and sw.lower_bound > SETTINGS.margin


def test_lrus_small_full_window_lead_moves_back_as_a_demotion():
    """Under the demotion margin but over the full window's: back to LRU,
    counted as a demotion, and the candidate needs fresh evidence after."""
    t = Tuner(["lru", "x"], TunerSettings(), initial="x")
    rng = random.Random(1)
    sw = None
    for step in range(3000):
        for _ in range(3):  # LRU hits 0.2 points more often
            base = sum(rng.random() < 0.5 for _ in range(20))
            t.record(float(step), 20, [base + (rng.random() < 0.04), base])
        if step % 5 == 0 and (sw := t.decide(float(step))) is not None:
            break
    assert sw is not None and (sw.to_candidate, sw.reason) == ("lru", "demote")
    assert sw.lower_bound < TunerSettings().margin
    assert (t.promotions, t.demotions) == (0, 1) and t.evidence_since["x"] == sw.time


def test_seconds_on_each_candidate_add_up():
    tuner = Tuner([LRU, WA], SETTINGS)
    rng = random.Random(4)
    run(tuner, rng, 0.0, 1800.0, 0.3, 0.5)
    st = tuner.state(1800.0)
    on = st["seconds_on_candidate"]
    assert on[LRU] > 0 and on[WA] > 0
    assert on[LRU] + on[WA] == pytest.approx(1800.0 - 5.0)
    assert st["switches"][0]["to"] == WA


def test_paired_comparison_and_its_standard_error():
    hits = PairedHits(["a", "b"], batch_s=10.0, keep_s=100.0)
    rng = random.Random(5)
    for i in range(2000):
        t = i * 0.05
        u = [rng.random() for _ in range(4)]
        hits.add(t, 4, [sum(x < 0.6 for x in u), sum(x < 0.5 for x in u)])
    cmp = hits.compare("a", "b", since=0.0)
    assert cmp.batches == 10 and cmp.requests == 2000
    assert cmp.lead == pytest.approx(0.1, abs=0.02)
    assert 0.0 < cmp.stderr < 0.02
    # Only the kept window counts.
    assert hits.compare("a", "b", since=50.0).batches == 5


def test_sequential_bound_is_stricter_than_a_fixed_z_and_shrinks_with_evidence():
    assert sequential_z(6, 0.95, 6) > 1.645
    assert sequential_z(30, 0.95, 6) < sequential_z(6, 0.95, 6)


# ---- the controller owns the live parameters ----------------------------------------------------


class Applied:
    def __init__(self) -> None:
        self.calls: list = []

    def __call__(self, params, key) -> None:
        self.calls.append((params, key))


def _feed_batches(
    tuner: Tuner, leader: str, base: str, batches: int, requests: int = 10, swing: tuple[int, int] = (30, -6)
) -> list[float]:
    """One 30-s batch at a time, 1,000 sampled blocks each in ``requests``
    requests: ``leader`` hits ``swing`` blocks more than ``base`` in alternate
    batches (by default +3.0 / -0.6 %: a lead of 1.2 points, standard error
    0.33 over 30 batches); ``decide`` after each batch. Returns the decision
    times at which it switched."""
    idx = {n: i for i, n in enumerate(tuner.names)}
    switched = []
    for i in range(batches):
        hits = [300] * len(tuner.names)
        hits[idx[leader]] = 300 + swing[i % 2]
        for j in range(requests):
            share = [h // requests if j else h - (requests - 1) * (h // requests) for h in hits]
            tuner.record(30.0 * i + 1.0 + j * 25.0 / requests, 1000 // requests, share)
        now = 30.0 * i + 29.0
        if tuner.decide(now) is not None:
            switched.append(now)
    return switched


def test_a_full_window_leaves_lru_on_the_one_sided_bound_a_young_one_on_the_mixture():
    s = TunerSettings(margin=0.003, window_s=900, demote_window_s=300, batch_s=30, min_requests=10, min_batches=6)
    tuner = Tuner([LRU, WA], s)
    # 2.33 standard errors clear the margin (1.2 - 2.33 x 0.33 > 0.3 points),
    # the mixture boundary's 3.06 do not: it moves only when the 900-s window
    # holds its 30 batches (of 30 requests: 900, full_window_min_requests).
    assert _feed_batches(tuner, WA, LRU, 40, requests=30) == [30.0 * 29 + 29.0]
    sw = tuner.switches[-1]
    assert sw.batches == 30 and sw.lower_bound > s.margin
    assert sw.lead - 3.06 * (sw.lead - sw.lower_bound) / 2.326 < s.margin
    # With the full window's bound and margin as strict as the mixture's, it never moves.
    strict = TunerSettings(**{**s.__dict__, "full_window_confidence": 0.999999, "full_window_margin": s.margin})
    strict = Tuner([LRU, WA], strict)
    assert _feed_batches(strict, WA, LRU, 40, requests=30) == []


def test_a_full_window_of_few_requests_keeps_the_mixture_bound():
    """The one-sided bar assumes near-normal batch means: with 10 requests a
    batch (300 in the window, under ``full_window_min_requests``) the same
    hits face the mixture boundary and never move; lowering the minimum to
    300 lets them move when the window is full."""
    s = TunerSettings(margin=0.003, window_s=900, demote_window_s=300, batch_s=30, min_requests=10, min_batches=6)
    assert s.full_window_min_requests == 900
    assert _feed_batches(Tuner([LRU, WA], s), WA, LRU, 40, requests=10) == []
    loose = TunerSettings(**{**s.__dict__, "full_window_min_requests": 300})
    assert _feed_batches(Tuner([LRU, WA], loose), WA, LRU, 40, requests=10) == [30.0 * 29 + 29.0]


def test_a_full_window_leaves_lru_over_the_smaller_margin():
    """A lead of 0.7 points with a standard error of 0.20 over 30 batches of
    30 requests: 2.33 standard errors leave a bound of 0.22 points, under
    ``margin`` (0.3) and over ``full_window_margin`` (0.1), so it moves when
    the window is full; with ``full_window_margin`` raised to ``margin`` it
    never does. A young window keeps ``margin``."""
    s = TunerSettings(margin=0.003, window_s=900, demote_window_s=300, batch_s=30, min_requests=10, min_batches=6)
    assert s.full_window_margin == 0.001
    tuner = Tuner([LRU, WA], s)
    assert _feed_batches(tuner, WA, LRU, 40, requests=30, swing=(18, -4)) == [30.0 * 29 + 29.0]
    assert s.full_window_margin < tuner.switches[-1].lower_bound < s.margin
    same = TunerSettings(**{**s.__dict__, "full_window_margin": s.margin})
    assert _feed_batches(Tuner([LRU, WA], same), WA, LRU, 40, requests=30, swing=(18, -4)) == []


def test_a_move_between_two_candidates_keeps_the_mixture_bound_on_a_full_window():
    # Replacement off: this is the promotion's bar (with it, the one-sided
    # replacement bound moves at 329 s, the field being wb alone).
    s = TunerSettings(
        margin=0.003, window_s=900, demote_window_s=300, batch_s=30, min_requests=10, min_batches=6,
        replace_confidence=0.0,
    )
    tuner = Tuner([LRU, WA, "wb"], s, initial=WA)
    # wb leads the running candidate as WA led LRU above (LRU ties WA: no demotion).
    assert _feed_batches(tuner, "wb", WA, 40, requests=30) == []
    assert tuner.active == WA


def _promoted_after_a_late_lead(settings: TunerSettings, seed: int, lead: float) -> tuple[float, Switch]:
    """An hour of no lead fills the window; then WA leads by ``lead``: seconds until it runs."""
    tuner = Tuner([LRU, WA], settings)
    rng = random.Random(seed)
    run(tuner, rng, 0.0, 3600.0, 0.40, 0.40)
    assert tuner.active == LRU and tuner.promotions == 0
    t = 3600.0
    while tuner.active == LRU and t < 3600.0 + 1800.0:
        stream(tuner, rng, t, t + 5.0, 0.40, 0.40 + lead)
        t += 5.0
        tuner.decide(t)
    assert tuner.active == WA
    return t - 3600.0, tuner.switches[-1]


def test_a_lead_that_starts_late_promotes_on_the_short_look_before_the_full_window():
    """A half-point lead from t = 3,600 s, after an hour of none: the full
    window's mean is diluted by its older batches, the short window's is not."""
    short_t, short_sw = _promoted_after_a_late_lead(SETTINGS, seed=0, lead=0.005)
    no_short = TunerSettings(**{**SETTINGS.__dict__, "short_window_s": 0.0})
    full_t, full_sw = _promoted_after_a_late_lead(no_short, seed=0, lead=0.005)
    assert short_sw.batches <= SETTINGS.short_window_s / SETTINGS.batch_s + 1 < full_sw.batches
    assert short_t <= SETTINGS.short_window_s and short_t + 60.0 <= full_t  # measured: 330 s against 440 s
    assert short_sw.lower_bound > SETTINGS.full_window_margin


def test_a_young_window_never_takes_the_short_look():
    """A 0.25-point lead with a small standard error: from the 15th batch its
    last 450 s alone clear the short look's bar, but a window younger than
    900 s keeps the mixture boundary and the 0.3-point margin, so it moves
    only when the full window is in (on the full window's own bar)."""
    s = TunerSettings(margin=0.003, window_s=900, demote_window_s=300, batch_s=30, min_requests=10, min_batches=6)
    young = Tuner([LRU, WA], s)
    assert _feed_batches(young, WA, LRU, 16, requests=30, swing=(3, 2)) == []
    assert young._short_look(WA, 30.0 * 15 + 29.0) is not None
    tuner = Tuner([LRU, WA], s)
    assert _feed_batches(tuner, WA, LRU, 40, requests=30, swing=(3, 2)) == [30.0 * 29 + 29.0]
    assert tuner.switches[-1].batches == 30
    # A short window not shorter than the promotion window is no second look.
    assert Tuner([LRU, WA], TunerSettings(**{**s.__dict__, "short_window_s": 900.0}))._short_batches == 0
    assert ControllerConfig(tuner_window_s=60.0, tuner_batch_s=5.0).tuner_settings.short_window_s == 450.0


def test_pin_cannot_be_overwritten_by_a_concurrent_refit(monkeypatch):
    """A refit reads the pin state, then a pin lands, then the refit applies:
    without one owner the refit's stale parameters would replace the pin."""
    applied = Applied()
    c = WAController(ControllerConfig(), 200, applied, EventSink(), clock=lambda: 1.0)
    c.refit()
    read_pin_state = threading.Event()
    pin_returned = threading.Event()
    orig = c._target

    def target_then_wait():
        out = orig()
        read_pin_state.set()
        pin_returned.wait(timeout=1.0)  # let a pin race in here, if it can
        return out

    monkeypatch.setattr(c, "_target", target_then_wait)
    refit = threading.Thread(target=lambda: c._swap(2.0) and None)
    refit.start()
    assert read_pin_state.wait(5.0)
    monkeypatch.setattr(c, "_target", orig)
    pinned = WAParams.from_pr_json({"a": {"x": 0.5}, "p": {"x": 0.5}})
    pinner = threading.Thread(target=lambda: (c.pin(pinned, ("tag",)), pin_returned.set()))
    pinner.start()
    pinner.join(5.0)
    refit.join(5.0)
    assert c.pinned is not None
    assert applied.calls[-1][0].models == pinned.models  # the pin is what the queue runs
    assert c.params.models == pinned.models and c.params.source == "pinned"
    versions = [p.version for p, _ in applied.calls]
    assert versions == sorted(set(versions))  # one owner: versions strictly increase


def test_refits_without_change_do_not_swap():
    applied = Applied()
    c = WAController(ControllerConfig(), 200, applied, EventSink(), clock=lambda: 1.0)
    for _ in range(10):
        c.refit()
    assert c.refits == 10 and c.swaps == 1 and c.version == 1 and len(applied.calls) == 1


def test_params_changed_tolerance():
    base = WAParams(models={"a": ReuseModel.exponential(0.5, 0.1)})
    near = WAParams(models={"a": ReuseModel.exponential(0.503, 0.1)})
    far = WAParams(models={"a": ReuseModel.exponential(0.52, 0.1)})
    assert not params_changed(base, near, 0.01)
    assert params_changed(base, far, 0.01)
    assert params_changed(base, WAParams(models={"b": ReuseModel.exponential(0.5, 0.1)}), 0.01)
    assert params_changed(base, base.evolve(horizon=20.0), 0.01)
    assert params_changed(base, base.evolve(mode="posterior"), 0.01)


def test_replace_confidence_is_validated_and_zero_turns_it_off():
    from_config = ControllerConfig(tuner_replace_confidence=0.0).tuner_settings
    assert from_config.replace_confidence == 0.0
    assert ControllerConfig().tuner_settings.replace_confidence == 0.95
    for bad in (0.3, 1.0, -0.5):
        with pytest.raises(ConfigError, match="tuner_replace_confidence"):
            ControllerConfig(tuner_replace_confidence=bad)
    # The gate likewise: 0 turns it off, a value outside [0.5, 1) is refused.
    assert ControllerConfig(tuner_replace_gate_confidence=0.0).tuner_settings.replace_gate_confidence == 0.0
    assert ControllerConfig().tuner_settings.replace_gate_confidence == 0.95
    for bad in (0.3, 1.0, -0.5):
        with pytest.raises(ConfigError, match="tuner_replace_gate_confidence"):
            ControllerConfig(tuner_replace_gate_confidence=bad)


def run_with_real_cache(check: bool, real_gap: float, seconds: float = 7200.0) -> Tuner:
    """WA's miniature cache leads LRU's by 5 points (35 % against 30 %); while WA
    runs, the real cache hits ``real_gap`` below WA's prediction (paired draws)."""
    tuner = Tuner([LRU, WA], replace(SETTINGS, real_check=check))
    rng = random.Random(0)
    t = 0.0
    while t < seconds:
        for _ in range(10):  # 2 sampled requests a second, a decision every 5 s
            u = [rng.random() for _ in range(8)]
            p_real = 0.35 - real_gap if tuner.active == WA else 0.30
            tuner.record(t, 8, [sum(x < 0.30 for x in u), sum(x < 0.35 for x in u)], sum(x < p_real for x in u))
            t += 0.5
        tuner.decide(t)
    return tuner


def test_the_real_cache_check_demotes_a_candidate_its_miniature_cache_overstates():
    """The miniature caches say WA leads LRU by 5 points, but while WA runs the
    real cache hits 3 points below LRU's miniature cache (8 below WA's
    prediction): the real-cache check sends the cache back to LRU within the
    demotion window, and WA's later leads are discounted by the 8 points its
    miniature cache overstated, so the same lead never promotes it again.
    Without the check it stays on WA; with a faithful miniature cache the
    check never fires."""
    checked = run_with_real_cache(True, 0.08)
    reasons = [(sw.reason, sw.to_candidate) for sw in checked.switches]
    assert reasons == [("promote", WA), ("real-check", LRU)]
    assert checked.reinstatable is None  # the miniature caches were wrong: no quick way back
    assert checked.demotions == checked.real_check_demotions == 1
    promoted, demoted = checked.switches[0].time, checked.switches[1].time
    assert demoted - promoted <= SETTINGS.demote_window_s
    assert checked.overstated[WA] == pytest.approx(0.08, abs=0.02)
    assert checked.seconds_on[WA] <= SETTINGS.demote_window_s
    total = checked.state(7200.0)["calibration"]["total"]
    assert total[WA]["real_hit_rate"] == pytest.approx(0.27, abs=0.04)  # 90 s of WA: about 1,400 blocks
    assert total[WA]["predicted_hit_rate"] - total[WA]["real_hit_rate"] == pytest.approx(checked.overstated[WA])
    assert total[LRU]["real_hit_rate"] == total[LRU]["lru_predicted_hit_rate"]

    unchecked = run_with_real_cache(False, 0.08)
    assert [sw.reason for sw in unchecked.switches] == ["promote"] and unchecked.active == WA

    faithful = run_with_real_cache(True, 0.0)
    assert [sw.reason for sw in faithful.switches] == ["promote"] and faithful.active == WA


def test_a_real_cache_check_on_a_candidate_its_miniature_cache_did_not_overstate_is_undone_as_a_demotion():
    """WA's miniature cache leads LRU's by 5 points throughout; its real cache
    beats that prediction by 5 points for 800 s after the promotion, then
    trails it by 10 for a stretch (an excursion, not a fault: over its run the
    real cache read more than predicted). The real-cache check sends the
    cache back to LRU in the stretch; with nothing overstated there is no
    discount, and WA comes back as a demoted candidate does, on fewer batches
    than the promotion bar (min_batches since the demotion) needs."""
    tuner = Tuner([LRU, WA], SETTINGS)
    rng = random.Random(3)
    t, dip = 0.0, math.inf
    while t < 3600.0 and tuner.promotions < 2:
        for _ in range(10):
            u = [rng.random() for _ in range(8)]
            if tuner.active == WA and tuner.promotions == 1:
                if dip == math.inf and t - tuner.active_since >= 800.0:
                    dip = t
                p_real = 0.35 + (0.05 if t < dip else -0.10)
            else:
                p_real = 0.35 if tuner.active == WA else 0.30
            tuner.record(t, 8, [sum(x < 0.30 for x in u), sum(x < 0.35 for x in u)], sum(x < p_real for x in u))
            t += 0.5
        tuner.decide(t)
    reasons = [(sw.reason, sw.to_candidate) for sw in tuner.switches]
    assert reasons == [("promote", WA), ("real-check", LRU), ("promote", WA)]
    assert tuner.real_check_demotions == 1 and tuner.overstated[WA] == 0.0
    assert dip < tuner.switches[1].time <= dip + SETTINGS.demote_window_s
    assert tuner.switches[2].batches < SETTINGS.min_batches


def run_long_then_dip(p_real_over_run) -> tuple[Tuner, dict[str, int]]:
    """WA's miniature cache leads LRU's by 5 points; while WA runs, the real
    cache hits at ``p_real_over_run(seconds since the promotion)``. Runs to
    the first real-cache demotion, and sums what the check counted."""
    tuner = Tuner([LRU, WA], SETTINGS)
    rng = random.Random(0)
    t = 0.0
    counted = {"lookups": 0, "predicted": 0, "real": 0}
    while t < 6000.0 and tuner.real_check_demotions == 0:
        for _ in range(10):
            u = [rng.random() for _ in range(8)]
            p_real = p_real_over_run(t - tuner.active_since) if tuner.active == WA else 0.30
            hits = [sum(x < 0.30 for x in u), sum(x < 0.35 for x in u)]
            real = sum(x < p_real for x in u)
            if tuner.active == WA and t >= tuner.real_check_since:
                counted["lookups"] += 8
                counted["predicted"] += hits[1]
                counted["real"] += real
            tuner.record(t, 8, hits, real)
            t += 0.5
        tuner.decide(t)
    assert [(sw.reason, sw.to_candidate) for sw in tuner.switches] == [("promote", WA), ("real-check", LRU)]
    return tuner, counted


def test_what_a_miniature_cache_overstated_is_judged_over_the_candidates_whole_run():
    """The reinstatement rule and the discount read the candidate's whole run
    since the check counted, not the calibration's last window: before, a
    candidate whose real cache beat its prediction for 3,000 s and then dipped
    was judged on the dip alone (overstated by 1.5 points, no way back), and
    one overstated by 2 points for 3,000 s that then beat its prediction for
    600 s before a dip was judged not overstated and came back 65 s later."""
    beat_then_dip, counted = run_long_then_dip(lambda ran: 0.36 if ran < 3000.0 else 0.27)
    whole_run = (counted["predicted"] - counted["real"]) / counted["lookups"]
    assert whole_run < 0.0
    assert beat_then_dip.switches[1].time - beat_then_dip.switches[0].time > 3000.0
    assert beat_then_dip.overstated[WA] == 0.0 and beat_then_dip.reinstatable == WA

    over_then_dip, counted = run_long_then_dip(lambda ran: 0.33 if ran < 3000.0 else 0.40 if ran < 3600.0 else 0.26)
    whole_run = (counted["predicted"] - counted["real"]) / counted["lookups"]
    assert whole_run > 0.01
    assert over_then_dip.overstated[WA] == pytest.approx(whole_run, abs=1e-9)
    assert over_then_dip.reinstatable is None


def test_a_batch_whose_every_real_cache_check_was_taken_back_is_no_batch():
    """One check in the first batch, taken back (the real cache refused the
    request), then two batches where the real cache trails LRU's miniature
    cache by 30 points: two batches of evidence are fewer than the check's
    three, as if the taken-back check had never been recorded."""

    def run_checks(first: str) -> tuple[int, Switch | None]:
        tuner = Tuner([LRU, WA], SETTINGS, initial=WA)
        rng = random.Random(1)
        if first != "none":
            checked = tuner.record(1.0, 8, [4, 4], 0)
            if first == "taken back":
                tuner.retract_real(checked)
        for t in range(30, 90):
            u = [rng.random() for _ in range(8)]
            tuner.record(float(t), 8, [sum(x < 0.5 for x in u)] * 2, sum(x < 0.2 for x in u))
        return tuner.calibration.lead_over_real(tuner.real_check_since, WA).batches, tuner.decide(89.0)

    assert run_checks("none") == (2, None)
    assert run_checks("taken back") == (2, None)
    batches, switch = run_checks("kept")  # the check stands: three batches, and the real cache trails
    assert batches == 3 and switch is not None and switch.reason == "real-check"


def run_with_transition(turnover: float, transition_s: float, seconds: float = 3600.0) -> Tuner:
    """As :func:`run_with_real_cache`, with a real cache that trails WA's
    prediction by 8 points for ``transition_s`` after each switch to WA (it
    still holds what LRU kept) and matches it afterwards; it evicts one
    sampled block a second and holds 120 of them."""
    settings = replace(SETTINGS, real_check_turnover=turnover)
    tuner = Tuner([LRU, WA], settings, sampled_cache_blocks=120.0)
    rng = random.Random(0)
    t = 0.0
    while t < seconds:
        for _ in range(10):
            u = [rng.random() for _ in range(8)]
            if tuner.active == WA:
                p_real = 0.35 - (0.08 if t - tuner.active_since < transition_s else 0.0)
            else:
                p_real = 0.30
            tuner.record(t, 8, [sum(x < 0.30 for x in u), sum(x < 0.35 for x in u)], sum(x < p_real for x in u))
            t += 0.5
            if t % 1.0 == 0.0:
                tuner.evicted(t, 1)
        tuner.decide(t)
    return tuner


def test_the_real_cache_check_counts_once_the_real_cache_has_turned_over():
    """After a switch the real cache holds what LRU kept and trails the new
    candidate's prediction for a while: the check waits until the real cache
    has evicted as many sampled blocks as it holds (120 s here), so a
    transition of 100 s demotes nothing, where a check counting from the
    switch demoted WA and barred it for good. A real cache that trails for
    good is still demoted, within the demotion window after the turnover."""
    waited = run_with_transition(1.0, 100.0)
    assert [sw.reason for sw in waited.switches] == ["promote"] and waited.active == WA
    assert waited.real_check_since == pytest.approx(waited.active_since + 120.0, abs=1.0)

    at_once = run_with_transition(0.0, 100.0)
    assert [sw.reason for sw in at_once.switches][:2] == ["promote", "real-check"]
    assert at_once.overstated[WA] > 0.02

    faulty = run_with_transition(1.0, math.inf)
    assert [sw.reason for sw in faulty.switches][:2] == ["promote", "real-check"]
    promoted, demoted = faulty.switches[0].time, faulty.switches[1].time
    assert promoted + 120.0 <= demoted <= promoted + 120.0 + SETTINGS.demote_window_s
    assert faulty.overstated[WA] == pytest.approx(0.08, abs=0.02)


def test_a_candidate_the_tuner_started_on_is_checked_from_the_start():
    """``initial`` = WA (a restart on a trusted candidate): it ran since -inf,
    and what its miniature cache overstated counts from its first request."""
    tuner = Tuner([LRU, WA], SETTINGS, initial=WA)
    rng = random.Random(1)
    t = 0.0
    while tuner.active == WA and t < 600:
        for _ in range(10):
            u = [rng.random() for _ in range(8)]
            tuner.record(t, 8, [sum(x < 0.30 for x in u), sum(x < 0.35 for x in u)], sum(x < 0.27 for x in u))
            t += 0.5
        tuner.decide(t)
    assert [sw.reason for sw in tuner.switches] == ["real-check"]
    assert tuner.overstated[WA] == pytest.approx(0.08, abs=0.02)


def test_time_on_a_candidate_is_counted_once_when_the_clock_steps_back():
    tuner = Tuner(["lru", "x"])
    for now in (0.0, 100.0, 50.0, 100.0, 110.0):  # 50 s replayed once
        tuner.account(now)
    assert tuner.seconds_on == {"lru": 110.0, "x": 0.0}


def test_the_real_cache_checks_batches_stay_bounded_after_an_event_dated_far_ahead():
    """Batches left the window only from its head, by time: one check dated
    far ahead stayed at the head, and the list grew a batch every 30 s for good."""
    cal = Calibration(window_s=900.0, batch_s=30.0)
    cal.update(1e12, "lru", 4, 1, 1, 1)  # a clock outlier, far ahead
    for t in range(0, 86_400, 30):
        cal.update(float(t), "lru", 4, 2, 2, 2)
    assert len(cal._batches) <= 8 * 31
    window = cal.window(86_400.0 - 30.0)["lru"]
    assert window.requests == 31 and window.real == 62  # the last 900 s, as without the outlier

"""Parameters: validation, the PR's JSON format, and the score functions."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_wa.params import (
    _MAX_IDLE_S,
    MAX_MIXTURE_COMPONENTS,
    ClassScorer,
    ParamsError,
    ReuseModel,
    WAParams,
    params_changed,
    time_to_live,
)
from vllm_wa.workload_classes import ClassRegistry, TagCounters, normalize_tag


def test_pr_json_round_trip():
    src = {"a": {"text_1": 0.021, "image_1": 0.2}, "p": {"text_1": 0.4, "image_1": 0.8}}
    params = WAParams.from_pr_json(src)
    assert params.model_for("text_1") == ReuseModel.exponential(0.4, 0.021)
    assert params.horizon == 5.0 and params.mode == "pr"
    out = params.to_pr_json()
    assert out["a"] == pytest.approx(src["a"]) and out["p"] == pytest.approx(src["p"])
    again = WAParams.from_pr_json(json.dumps(out))
    assert again.models == params.models and again.default == params.default


def test_stamp_round_trips_and_is_validated():
    params = WAParams(models={"tool": ReuseModel.exponential(0.9, 0.1)}, stamp="lookup")
    assert WAParams.from_pr_json(params.to_pr_json()).stamp == "lookup"
    # The PR's own format (no stamp key) reads as release-stamped, and is written without the key.
    assert WAParams.from_pr_json({"a": {"x": 0.1}, "p": {"x": 0.5}}).stamp == "free"
    assert "stamp" not in WAParams().to_pr_json()
    with pytest.raises(ParamsError, match="stamp"):
        WAParams(stamp="arrival")
    with pytest.raises(ParamsError, match="stamp"):
        WAParams.from_pr_json({"a": {}, "p": {}, "stamp": 3})


def test_mixture_round_trip_and_effective_rate():
    m = ReuseModel((0.3, 0.5), (1.0, 0.01))
    params = WAParams(models={"tool": m}, horizon=30.0, mode="posterior", version=7)
    back = WAParams.from_pr_json(params.to_pr_json())
    assert back.model_for("tool") == m
    assert back.horizon == 30.0 and back.mode == "posterior" and back.version == 7
    assert m.p == pytest.approx(0.8)
    # effective rate: p / mean delay of reused blocks
    assert m.a == pytest.approx(0.8 / (0.3 / 1.0 + 0.5 / 0.01))


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"a": {"x": 1.0}}, "objects 'a'"),
        ({"a": {"x": 1.0}, "p": {"y": 0.5}}, "only one of"),
        ({"a": {"x": "fast"}, "p": {"x": 0.5}}, "number"),
        ({"a": {"x": 1.0}, "p": {"x": 1.2}}, r"\[0.0, 1.0\]"),
        ({"a": {"x": -0.1}, "p": {"x": 0.5}}, r"\[0.0, inf\]"),
        ({"a": {"x": float("nan")}, "p": {"x": 0.5}}, "finite"),
        ({"a": {"x": 1.0}, "p": {"x": 0.5}, "L": 0}, "positive"),
        ({"a": {"x": 1.0}, "p": {"x": 0.5}, "mode": "lfu"}, "mode"),
        ({"a": {"x": 1.0}, "p": {"x": 0.5}, "mixture": {"x": [[0.7, 1.0], [0.6, 2.0]]}}, "sum"),
        ({"a": {"x": 1.0}, "p": {"x": 0.5}, "version": 2**63}, "version"),
        ({"a": {"x": 1.0}, "p": {"x": 0.5}, "default": {"p": 0.5, "a": 1.0, "w": 3}}, "exactly 'p' and 'a'"),
        ({"a": {"x": 1.0}, "p": {"x": 0.5}, "default": {"p": 0.5}}, "exactly 'p' and 'a'"),
        ("{not json", "does not parse"),
        ([1, 2], "object"),
    ],
)
def test_bad_params_are_rejected_with_a_clear_message(bad, msg):
    with pytest.raises(ParamsError, match=msg):
        WAParams.from_pr_json(bad)


def test_rates_near_the_ends_of_the_float_range_give_finite_numbers_not_an_overflow():
    """Each number is finite and in range; their sums are not (``math.fsum`` raises)."""
    slow = WAParams.from_pr_json({"a": {"x": 1}, "p": {"x": 1}, "default": [[1, 0.1]],
                                  "mixture": {"x": [[0.5, 3e-309], [0.5, 3e-309]]}})
    assert slow.models["x"].a == 0.0 and slow.to_pr_json()["a"]["x"] == 0.0  # a mean delay past the range
    fast = WAParams.from_pr_json({"a": {"x": 1e308, "y": 1e308}, "p": {"x": 1, "y": 1}})
    assert fast.default.a == pytest.approx(1e308)
    assert WAParams.from_pr_json(json.dumps(fast.to_pr_json())).models == fast.models


def test_a_model_has_at_most_max_mixture_components():
    assert len(ReuseModel((1 / 16,) * 16, (0.1,) * 16).weights) == MAX_MIXTURE_COMPONENTS
    with pytest.raises(ParamsError, match="at most 16 components"):
        ReuseModel((1 / 17,) * 17, (0.1,) * 17)


def test_numbers_are_floats_and_versions_fit_int64():
    """Integers of any size are valid numbers in JSON; what the parameters keep
    must still cross vLLM's msgpack channel (ints up to 2**64 - 1 only)."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    big = 2**70
    p = WAParams.from_pr_json({"a": {"x": big}, "p": {"x": 1}, "L": big, "version": 2**63 - 1,
                               "mixture": {"x": [[1, big]]}, "default": {"p": 0, "a": big}})
    assert type(p.horizon) is float and p.horizon == float(big)
    assert all(type(v) is float for m in (*p.models.values(), p.default) for v in m.weights + m.rates)
    wire = MsgpackDecoder().decode(MsgpackEncoder().encode(p.to_pr_json()))
    assert WAParams.from_pr_json(wire) == p


def test_params_changed_sees_the_stamp():
    p = WAParams.from_pr_json({"a": {"x": 0.1}, "p": {"x": 0.5}})
    assert not params_changed(p, p.evolve(version=3), 0.01)
    assert params_changed(p, p.evolve(stamp="lookup"), 0.01)


def test_load_names_the_file(tmp_path):
    p = tmp_path / "params.json"
    p.write_text('{"a": {"x": 1}, "p": {"x": 3}}')
    with pytest.raises(ParamsError, match=str(p)):
        WAParams.load(str(p))
    with pytest.raises(ParamsError, match="cannot read"):
        WAParams.load(str(tmp_path / "missing.json"))
    # Not UTF-8, or nested past the parser's recursion limit: a clear error, not a traceback.
    p.write_bytes(b'{"a": {"\xff": 1}}')
    with pytest.raises(ParamsError, match="cannot read"):
        WAParams.load(str(p))
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ParamsError, match="nested too deeply"):
        WAParams.load(str(p))


def test_lru_params_are_uniform():
    assert WAParams.lru().is_uniform
    m = ReuseModel.exponential(0.5, 0.1)
    assert WAParams(models={"a": m, "b": m}, default=m).is_uniform
    assert not WAParams(models={"a": m}).is_uniform


@st.composite
def scorers(draw):
    k = draw(st.integers(1, 3))
    ws = draw(st.lists(st.floats(0.01, 1.0 / k), min_size=k, max_size=k))
    rs = draw(st.lists(st.floats(1e-3, 10.0), min_size=k, max_size=k))
    return ClassScorer(
        ReuseModel(tuple(ws), tuple(rs)),
        draw(st.sampled_from([1.0, 5.0, 120.0])),
        draw(st.sampled_from(["pr", "posterior", "density", "ttl"])),
    )


@given(scorers(), st.floats(0.0, 500.0), st.floats(0.0, 500.0))
def test_score_never_increases_with_idle_time(scorer, d1, d2):
    lo, hi = sorted((d1, d2))
    assert scorer.log_score(hi) <= scorer.log_score(lo) + 1e-12


@given(scorers(), st.floats(0.0, 300.0))
def test_idle_below_inverts_the_score(scorer, d):
    target = scorer.log_score(d)
    idle = scorer.idle_below(target)
    if math.isinf(idle):
        # Only where nothing up to the search limit scores below the target.
        assert target == -math.inf or scorer.log_score(_MAX_IDLE_S) >= target
        return
    assert scorer.log_score(idle * (1 + 1e-9) + 1e-9) < target or scorer.log_score(idle) < target
    # The search resolves idle time to 1e-9 * max(1, idle) seconds; any
    # earlier moment still scores at or above the target.
    earlier = idle - 1e-6 * max(1.0, idle)
    if earlier > 0:
        assert scorer.log_score(earlier) >= target - 1e-12


def test_idle_below_searches_up_to_its_limit_and_no_further():
    """Slow classes cross late: a crossing at 5e8 s is found (to 1e-9
    relative), one past the search limit (1e9 s, about 30 years) is inf."""
    scorer = ClassScorer(ReuseModel((0.5, 0.3), (1e-8, 1e-9)), 10.0, "pr")
    idle = scorer.idle_below(scorer.log_score(5e8))
    assert idle == pytest.approx(5e8, rel=1e-8)
    assert scorer.idle_below(scorer.log_score(2e9)) == math.inf


def test_scores_match_closed_forms():
    m = ReuseModel.exponential(0.6, 0.1)
    pr = ClassScorer(m, 5.0, "pr")
    post = ClassScorer(m, 5.0, "posterior")
    d = 12.0
    want_pr = 0.6 * (math.exp(-0.1 * d) - math.exp(-0.1 * (d + 5)))
    assert math.exp(pr.log_score(d)) == pytest.approx(want_pr)
    assert math.exp(post.log_score(d)) == pytest.approx(want_pr / m.survival(d))
    dens = ClassScorer(m, 5.0, "density")
    occupancy = 0.4 * 5.0 + 0.6 * math.exp(-0.1 * d) * (1 - math.exp(-0.5)) / 0.1  # integral of S over (d, d+5]
    assert math.exp(dens.log_score(d)) == pytest.approx(want_pr / occupancy)
    never = ClassScorer(ReuseModel.exponential(0.0, 1.0), 5.0, "pr")
    assert never.log_score(0.0) == -math.inf


def test_ttl_is_where_the_reuse_density_falls_to_one_over_the_break_even_time():
    """Exponential: ``p a exp(-a tau) = 1 / B``, so ``tau = ln(p a B) / a``; a
    class whose density starts below ``1 / B`` gets no time to live."""
    m = ReuseModel.exponential(0.6, 0.1)
    assert time_to_live(m, 300.0) == pytest.approx(math.log(0.6 * 0.1 * 300.0) / 0.1, rel=1e-5)
    assert time_to_live(m, 10.0) == 0.0  # 0.06 < 1/10
    assert time_to_live(ReuseModel.exponential(0.0, 1.0), 300.0) == 0.0
    # A mixture: the density at tau is 1/B.
    mix = ReuseModel((0.6, 0.3), (0.1, 0.002))
    tau = time_to_live(mix, 1000.0)
    assert 0.6 * 0.1 * math.exp(-0.1 * tau) + 0.3 * 0.002 * math.exp(-0.002 * tau) == pytest.approx(1e-3, rel=1e-4)
    # Ranking: LRU on stamp + tau, across classes.
    slow = ClassScorer(m, 300.0, "ttl")
    none = ClassScorer(ReuseModel.exponential(0.01, 0.1), 300.0, "ttl")
    assert none.ttl == 0.0 and slow.ttl > 0.0
    assert slow.log_score(slow.ttl + 5.0) == pytest.approx(none.log_score(5.0))
    assert slow.log_score(slow.ttl + 4.0) > none.log_score(5.0)


def test_tags_and_registry_cap():
    c = TagCounters()
    assert normalize_tag(None, c) == "default" and c.missing == 1
    assert normalize_tag("text_1", c) == "text_1"
    for bad in (3, "a b", "x" * 65, "", "<script>"):
        assert normalize_tag(bad, c) == "invalid"
    assert c.invalid == 5
    reg = ClassRegistry(max_classes=4)
    assert reg.id_of("a") == 3
    assert reg.id_of("b") == reg.id_of("other")
    assert reg.claim("b") is None and reg.find("b") is None and len(reg) == 4
    with pytest.raises(ValueError):
        ClassRegistry(max_classes=2)


@pytest.mark.parametrize("mode", ["posterior", "density"])
def test_a_class_with_no_never_mass_scores_without_cancellation_error_or_nan(mode):
    """Both sums of the score share exp(-r0 D), r0 the slowest rate: left in,
    it cancelled to within the rounding of r0 D (past the queue's tie width
    by D = 2**25 / 50 s, so two blocks of one memoryless class left LRU
    order), and overflowed to NaN at absurd rates."""
    flat = ClassScorer(ReuseModel.exponential(1.0, 50.0), 0.004, mode)
    d = 2.0**25 / 50
    assert len({flat.log_score(d + k * 0.25) for k in range(-4, 5)}) == 1
    mixed = ClassScorer(ReuseModel((0.5, 0.5), (1e300, 2e300)), 1.0, mode)
    scores = [mixed.log_score(x) for x in (0.0, 1.0, 1e9)]
    assert all(math.isfinite(s) for s in scores) and scores == sorted(scores, reverse=True)

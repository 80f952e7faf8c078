"""benchmarks/feature_ablation.py: one fixed candidate per feature set, with LRU and OPT."""

from __future__ import annotations

import pytest

from vllm_wa.cli import sample_path
from vllm_wa.controller.config import ConfigError, ControllerConfig
from vllm_wa.replay.loaders import load_trace
from vllm_wa.replay.runner import ReplayConfig, prepare, resolve_sizes

from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("feature_ablation")


def test_default_sets_cover_each_feature_alone_and_added_to_tag_outcome(bench):
    sets = bench.default_sets()
    assert len(set(sets)) == len(sets)
    for f in ("tag", "outcome", "depth", "reuse", "think", "reply", "growth", "turn"):
        assert (f,) in sets
        if f not in ("tag", "outcome"):
            assert ("tag", "outcome", f) in sets


def test_rows_on_the_mooncake_sample(bench):
    # Mooncake has no tags: the tag-only key has one class, whose posterior
    # score falls with idle time, so it evicts exactly in LRU order.
    trace = load_trace(sample_path("mooncake-conversation-sample.jsonl.xz")).head(600)
    setup = prepare(trace, ["lru", "opt", "wa-online"], ReplayConfig())
    (size,) = resolve_sizes("10%", setup.trace, setup.eval_start)
    base = ControllerConfig(refit_interval_s=20.0)
    rows = bench.ablation(setup, size, [("tag",), ("think",)], base)
    by = {r["policy"]: r for r in rows}
    assert list(by) == ["opt", "lru", "tag", "think"]
    assert by["lru"]["gap_closed"] == 0.0 and by["opt"]["gap_closed"] == pytest.approx(1.0)
    assert 0.0 < by["lru"]["token_hit_rate"] < by["opt"]["token_hit_rate"]
    assert by["tag"]["token_hit_rate"] == pytest.approx(by["lru"]["token_hit_rate"], abs=1e-12)
    for r in rows:
        assert r["token_hit_rate"] <= by["opt"]["token_hit_rate"] + 1e-12
    table = bench.format_table(trace.name, size, rows)
    assert "think" in table and "gap %" in table


def test_stamps_label_rows_and_one_release_stamped_class_is_lru(bench):
    trace = load_trace(sample_path("mooncake-conversation-sample.jsonl.xz")).head(600)
    setup = prepare(trace, ["lru", "opt", "wa-online"], ReplayConfig())
    (size,) = resolve_sizes("10%", setup.trace, setup.eval_start)
    rows = bench.ablation(setup, size, [()], ControllerConfig(refit_interval_s=20.0), stamps=("free", "lookup"))
    by = {r["policy"]: r for r in rows}
    assert list(by) == ["opt", "lru", "none", "none@lookup"]
    assert [r["stamp"] for r in rows[2:]] == ["free", "lookup"]
    # One class stamped at the release orders blocks exactly as LRU does.
    assert by["none"]["token_hit_rate"] == pytest.approx(by["lru"]["token_hit_rate"], abs=1e-12)
    assert 0.0 < by["none@lookup"]["token_hit_rate"] <= by["opt"]["token_hit_rate"]


def test_classes_run_each_set_as_a_learned_key_too(bench):
    trace = load_trace(sample_path("mooncake-conversation-sample.jsonl.xz")).head(600)
    setup = prepare(trace, ["lru", "opt", "wa-online"], ReplayConfig())
    (size,) = resolve_sizes("10%", setup.trace, setup.eval_start)
    rows = bench.ablation(setup, size, [("think", "turn")], ControllerConfig(refit_interval_s=20.0), classes=(0, 4))
    by = {r["policy"]: r for r in rows}
    assert list(by) == ["opt", "lru", "think+turn", "think+turn/K4"]
    assert [r["classes"] for r in rows] == [0, 0, 0, 4]
    for r in rows[2:]:
        assert 0.0 < r["token_hit_rate"] <= by["opt"]["token_hit_rate"] + 1e-12
    # A learned key is its own candidate: its name carries the class count.
    assert bench.candidate(("think", "turn"), classes=4).name != bench.candidate(("think", "turn")).name


def test_family_mode_and_horizon_replace_every_candidates_score(bench):
    spec = bench.candidate(("tag", "outcome"), score=("exponential", "ttl", 100.0))
    assert (spec.family, spec.mode, spec.horizon) == ("exponential", "ttl", 100.0)
    assert spec.name == "tag+outcome/exp/ttl/L100"
    assert bench.candidate(("tag", "outcome")).name == "tag+outcome/hyper/posterior/L10"
    # A bad mode stops the command before any trace is read.
    with pytest.raises(ConfigError, match="mode"):
        bench.main(["no-such-trace.jsonl", "--sets", "tag", "--mode", "bogus"])

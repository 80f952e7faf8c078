"""benchmarks/no_signal.py: the guard-rail over seeds of the no-signal trace."""

from __future__ import annotations

import itertools

import pytest

from vllm_wa.controller.config import ControllerConfig
from vllm_wa.replay.no_signal import CACHE_BLOCKS, no_signal_trace, scaled_cache_blocks, small_trace_controller
from vllm_wa.validation import parse_int_range

from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("no_signal")


def test_seed_ranges_and_lists(bench, capsys):
    assert parse_int_range("--seeds", "0-3") == [0, 1, 2, 3]
    assert parse_int_range("--seeds", "3,7") == [3, 7]
    for bad in ("x", "-1", "2-1", "3,-1"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_int_range("--seeds", bad)
    with pytest.raises(SystemExit, match="--seeds"):
        bench.main(["--seeds", "x"])
    assert "seed " not in capsys.readouterr().out  # nothing ran


def test_overrides_parse_numbers_and_strings(bench):
    got = bench.parse_overrides(["class_confidence=0.995", "shadow_sampling=chain", "tuner_enabled=false"])
    assert got == {"class_confidence": 0.995, "shadow_sampling": "chain", "tuner_enabled": False}


@pytest.mark.parametrize("item", ["no_such_field=1", "class_confidence=1.5", "class_confidence"])
def test_a_bad_override_stops_before_any_run(bench, item, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--seeds", "0", "--set", item])
    assert "class_confidence" in str(e.value) or "no_such_field" in str(e.value) or "field=value" in str(e.value)
    assert "seed" not in capsys.readouterr().out  # nothing ran


def test_table_counts_each_bound_separately(bench):
    rows = [
        {"seed": 0, "lru": 0.25, "wa_online": 0.25, "delta_points": 0.0, "off_lru_share": 0.0, "switches": []},
        {
            "seed": 1,
            "lru": 0.28,
            "wa_online": 0.2786,
            "delta_points": -0.14,
            "off_lru_share": 0.30,
            "switches": [{"reason": "promote", "to": "tag", "time": 5257.0}],
        },
        {"seed": 2, "lru": 0.28, "wa_online": 0.277, "delta_points": -0.30, "off_lru_share": 0.01, "switches": []},
    ]
    table = bench.format_table(rows)
    assert "promote -> tag at 5257 s" in table
    assert table.splitlines()[-1] == "within 0.2 points of lru: 2/3; at most 5 % of the time off LRU: 2/3"


def _conversations(trace) -> dict[int, list]:
    turns: dict[int, list] = {}
    for r in trace.requests:
        turns.setdefault(r.conversation, []).append(r)
    return turns


@pytest.mark.parametrize("lengths", ["uniform", "geometric"])
def test_the_trace_is_seeded_and_each_turn_extends_the_last(lengths):
    a, b = no_signal_trace(3, conversations=40, lengths=lengths), no_signal_trace(3, conversations=40, lengths=lengths)
    assert [r.hash_ids for r in a.requests] == [r.hash_ids for r in b.requests]
    other = no_signal_trace(4, conversations=40, lengths=lengths)
    assert [r.hash_ids for r in a.requests] != [r.hash_ids for r in other.requests]
    for reqs in _conversations(a).values():
        for prev, cur in itertools.pairwise(reqs):
            assert cur.arrival >= prev.arrival
            assert list(cur.hash_ids[: len(prev.hash_ids)]) == list(prev.hash_ids)
            assert len(cur.hash_ids) >= len(prev.hash_ids) + 2


def test_geometric_lengths_are_memoryless_uniform_ones_are_3_to_8():
    uniform = [len(t) for t in _conversations(no_signal_trace(0, conversations=400)).values()]
    assert min(uniform) == 3 and max(uniform) == 8
    geometric = [len(t) for t in _conversations(no_signal_trace(0, conversations=400, lengths="geometric")).values()]
    assert min(geometric) == 1 and max(geometric) > 12
    assert 4.5 < sum(geometric) / len(geometric) < 6.5  # mean 5.5, as the uniform lengths'
    # Memoryless: of the conversations that reach a turn, about the same share ends there.
    for k in (1, 3):
        reached = [n for n in geometric if n >= k]
        assert 0.1 < sum(n == k for n in reached) / len(reached) < 0.28  # 1 / 5.5 = 0.18
    with pytest.raises(ValueError, match="lengths"):
        no_signal_trace(0, lengths="zipf")


def test_the_cache_scales_with_the_traffic(bench, capsys):
    assert scaled_cache_blocks(600) == CACHE_BLOCKS == 300
    assert scaled_cache_blocks(2400) == 1200
    with pytest.raises(SystemExit, match="conversations"):
        bench.main(["--seeds", "0", "--conversations", "0"])
    assert "seed" not in capsys.readouterr().out


def test_a_config_files_candidates_run_on_the_scaled_controller(bench, tmp_path):
    """``--controller-config`` replaces the candidate set; the small trace's scaling still applies."""
    path = tmp_path / "c.toml"
    path.write_text('[[tuner.candidates]]\nfeatures = ["tag"]\nfamily = "exponential"\n')
    cfg = small_trace_controller(ControllerConfig.load(str(path)), tuner_min_requests=7)
    assert [c.name for c in cfg.all_candidates] == ["lru", "tag/exp/posterior/L10"]
    assert (cfg.sample_rate, cfg.tuner_min_requests) == (1.0, 7)
    assert small_trace_controller().candidates == ControllerConfig().candidates
    bad = tmp_path / "bad.toml"
    bad.write_text("[tuner]\nno_such_knob = 1\n")
    with pytest.raises(SystemExit, match="no_such_knob"):
        bench.main(["--seeds", "0", "--controller-config", str(bad)])

"""benchmarks/sample_luck.py: wa-online's hit rate at several sampling salts."""

from __future__ import annotations

import json
import statistics

import pytest

from vllm_wa.cli import sample_path
from vllm_wa.controller.config import ControllerConfig
from vllm_wa.replay.loaders import load_trace
from vllm_wa.replay.runner import ReplayConfig, make_policy, prepare, resolve_sizes, run_one
from vllm_wa.validation import parse_int_range

from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("sample_luck")


def test_salt_ranges_and_lists(bench, capsys):
    assert parse_int_range("--salts", "0-3") == [0, 1, 2, 3]
    assert parse_int_range("--salts", "3,7") == [3, 7]
    for bad in ("x", "-1", "2-1"):
        with pytest.raises(SystemExit, match="salts"):
            bench.main(["trace-not-read", "--sizes", "5%", "--salts", bad])
    assert "token hit rate" not in capsys.readouterr().out


def test_a_bad_config_stops_before_any_run(bench, tmp_path, capsys):
    bad = tmp_path / "c.toml"
    bad.write_text("[controller]\nsample_salt = -1\n")
    with pytest.raises(SystemExit, match="sample_salt"):
        bench.main(["trace-not-read", "--sizes", "5%", "--controller-config", str(bad)])
    assert "token hit rate" not in capsys.readouterr().out


def test_salt_zero_is_the_plain_replay(bench, tmp_path):
    """Salt 0 is the default sample: its run is ``vllm-wa replay``'s
    ``wa-online``, and ``lru`` is the plain LRU run; the summary is over the salts' runs."""
    path = sample_path("mooncake-conversation-sample.jsonl.xz")
    out = tmp_path / "luck.json"
    assert bench.main([path, "--sizes", "20%", "--salts", "0,1", "--jobs", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert [r["salt"] for r in row["runs"]] == [0, 1]
    cfg = ReplayConfig(controller_config=ControllerConfig())
    setup = prepare(load_trace(path), ["lru", "wa-online"], cfg)
    (blocks,) = resolve_sizes("20%", setup.trace, setup.eval_start)
    lru = run_one(setup.trace, make_policy("lru", setup), blocks, cfg, setup.eval_start)
    wa = run_one(setup.trace, make_policy("wa-online", setup), blocks, cfg, setup.eval_start)
    assert row["lru"] == pytest.approx(100 * lru.token_hit_rate)
    assert row["runs"][0]["token_hit_rate"] == pytest.approx(100 * wa.token_hit_rate)
    rates = [r["token_hit_rate"] for r in row["runs"]]
    assert row["mean"] == pytest.approx(statistics.fmean(rates))
    assert (row["min"], row["max"]) == (min(rates), max(rates))

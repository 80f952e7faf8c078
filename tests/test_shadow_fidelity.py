"""benchmarks/shadow_fidelity.py: predicted (miniature cache) vs full-size hit rates per candidate."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest

from vllm_wa.cli import sample_path
from vllm_wa.controller.config import ControllerConfig
from vllm_wa.replay.loaders import load_trace
from vllm_wa.replay.runner import ReplayConfig, resolve_sizes

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "shadow_fidelity.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("shadow_fidelity", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def result(bench):
    trace = load_trace(sample_path("mooncake-conversation-sample.jsonl.xz")).head(600)
    replay = ReplayConfig()
    sizes = resolve_sizes("10%", trace, trace.eval_start(replay.profile_fraction))
    # Few refits and a small candidate set keep it fast; the cache is far below
    # shadow_blocks, so every block is sampled and the miniature caches are full size.
    base = ControllerConfig(refit_interval_s=20.0, candidates=ControllerConfig().candidates[:2])
    return bench.fidelity(trace, sizes, base, replay)


def test_rows_for_every_candidate_and_rates_in_range(result):
    names = result["candidates"]
    assert names[0] == "lru" and len(names) == 3
    (entry,) = result["sizes"]
    assert [r["candidate"] for r in entry["rows"]] == names
    for r in entry["rows"]:
        for k in ("full", "block", "chain"):
            assert 0.0 <= r[k] <= 1.0, (r, k)
    for s in ("block", "chain"):
        sch = entry["schemes"][s]
        assert sch["sample_rate"] == 1.0 and sch["sampled_lookups"] > 0
        assert sch["mae"] >= abs(sch["bias"]) - 1e-12
    assert entry["schemes"]["chain"]["chain_rate"] == 1.0 and entry["schemes"]["block"]["chain_rate"] is None
    assert result["best"]["by_mae"] in ("block", "chain")


def test_unsampled_lru_shadow_matches_full_size_lru(result):
    # Every block sampled, shadow as big as the cache: the LRU miniature cache
    # is the real LRU cache (it may also hit a prompt's last block, which
    # a new turn's prompt hardly ever has cached).
    row = result["sizes"][0]["rows"][0]
    assert row["full"] > 0.02
    assert row["block"] == pytest.approx(row["full"], abs=0.01)
    # The replay on LRU with the tuner off is LRU.
    assert result["sizes"][0]["schemes"]["block"]["live_block_hit_rate"] == pytest.approx(row["full"], abs=1e-12)


def test_spearman(bench):
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert bench.spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)
    assert math.isnan(bench.spearman([1, 1, 1], [1, 2, 3]))


def test_table_and_json(bench, result, tmp_path):
    table = bench.format_table(result)
    for name in result["candidates"]:
        assert name in table
    assert "block MAE" in table and "chain Spearman" in table

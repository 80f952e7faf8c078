"""benchmarks/shadow_fidelity.py: predicted (miniature cache) vs full-size hit rates per candidate."""

from __future__ import annotations

import json
import math
import random
from array import array

import pytest

from vllm_wa.cli import sample_path
from vllm_wa.controller.config import CandidateSpec, ControllerConfig
from vllm_wa.replay.loaders import load_trace
from vllm_wa.replay.runner import ReplayConfig, resolve_sizes
from vllm_wa.replay.trace import Trace, TraceRequest

from conftest import load_benchmark

BLOCK = 16


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("shadow_fidelity")


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
    # What --json writes is strict JSON and reads back with every candidate and both schemes.
    path = tmp_path / "fidelity.json"
    bench.write_json(str(path), {"sizes": "10%"}, [result])
    back = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    [res] = back["results"]
    assert back["args"] == {"sizes": "10%"} and res["candidates"] == list(result["candidates"])
    assert res["sizes"][0]["schemes"].keys() == result["sizes"][0]["schemes"].keys() == {"block", "chain"}


def scan_trace(seed: int = 0, conversations: int = 300, duration: float = 3600.0) -> Trace:
    """Chat conversations among one-shot batch prompts, all behind one system prompt.

    Chat turns come back after 30-120 s; batch prompts (unique documents) are
    never reused but arrive at twice the chat volume, so LRU lets them push
    the chat out, and a tag-aware order keeps the chat: candidates far apart.
    Outcomes are random (an outcome-only candidate has nothing to learn).
    The shared system prompt is the case that makes chain sampling key on
    the first block after it.
    """
    rng = random.Random(seed)
    reqs: list[TraceRequest] = []
    system = list(range(8))
    next_id = len(system)

    def add(rid: str, t: float, prompt: list[int], tag: str, conv: int) -> None:
        reqs.append(
            TraceRequest(
                request_id=rid,
                arrival=t,
                hash_ids=array("q", prompt),
                input_tokens=len(prompt) * BLOCK,
                output_tokens=8,
                tag=tag,
                conversation=conv,
                outcome=rng.choice(("tool", "stop")),
            )
        )

    for c in range(conversations):
        t, prompt = rng.uniform(-600.0, duration), list(system)
        for k in range(rng.randint(4, 8)):
            grow = rng.randint(3, 6)
            prompt = prompt + list(range(next_id, next_id + grow))
            next_id += grow
            if 0.0 <= t < duration:
                add(f"c{c}t{k}", t, prompt, "chat", c)
            t += rng.uniform(30.0, 120.0)
    t, b = rng.expovariate(0.5), 0
    while t < duration:
        n = rng.randint(20, 40)
        add(f"b{b}", t, system + list(range(next_id, next_id + n)), "batch", conversations + b)
        next_id, b, t = next_id + n, b + 1, t + rng.expovariate(0.5)
    reqs.sort(key=lambda r: r.arrival)
    return Trace("scan", BLOCK, reqs, "generated", synthetic=True)


def test_miniature_caches_rank_candidates_like_full_size_caches(bench):
    """Issue 8: where candidates are far apart, the miniature caches (a
    sample of 200 blocks for caches of 500 and 1500) order them as the
    full-size caches do, under both sampling schemes, and block sampling also
    gets each candidate's lead over LRU right.
    """
    cands = tuple(
        CandidateSpec(f, fam, mode, h)
        for f, fam, mode, h in (
            (("tag",), "hyperexponential", "posterior", 10.0),
            (("tag",), "exponential", "pr", 5.0),
            (("outcome",), "hyperexponential", "posterior", 10.0),
        )
    )
    base = ControllerConfig(
        refit_interval_s=10.0, fit_interval_s=10.0, min_samples=5, candidates=cands, shadow_blocks=200
    )
    res = bench.fidelity(scan_trace(), [500, 1500], base, ReplayConfig())
    for entry in res["sizes"]:
        rows = entry["rows"]
        full = {r["candidate"]: r["full"] for r in rows}
        # The gap is large: both tag candidates lead LRU by more than 5 points.
        assert full["tag/hyper/posterior/L10"] - full["lru"] > 0.05, full
        assert full["tag/exp/pr/L5"] - full["lru"] > 0.05, full
        for scheme in ("block", "chain"):
            sch = entry["schemes"][scheme]
            assert sch["sample_rate"] < 0.5 and sch["sampled_lookups"] > 1000, sch
            pred = {r["candidate"]: r[scheme] for r in rows}
            for a in rows:
                for b in rows:
                    gap = full[a["candidate"]] - full[b["candidate"]]
                    if gap > 0.02:
                        assert pred[a["candidate"]] > pred[b["candidate"]], (scheme, entry["cache_blocks"], a, b)
        lru_predicted = next(r["block"] for r in rows if r["candidate"] == "lru")
        for r in rows:
            predicted, measured = r["block"] - lru_predicted, r["full"] - full["lru"]
            assert abs(predicted - measured) < 0.02, (entry["cache_blocks"], r, predicted, measured)
        # Chain sampling keyed past the shared system prompt still samples a fraction of the conversations.
        assert 0.0 < entry["schemes"]["chain"]["chain_rate"] < 0.5

"""benchmarks/tile_trace.py: a short trace repeated, shared prefixes kept, documents renamed."""

from __future__ import annotations

import json
import os

import pytest

from vllm_wa.replay.loaders import load_trace

from conftest import load_benchmark

ARXIV = os.path.join(os.path.dirname(__file__), os.pardir, "vllm_wa", "data", "mooncake-arxiv-sample.jsonl.xz")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("tile_trace")


def _rec(ts: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": 512 * len(ids), "output_length": 7, "hash_ids": ids}


def test_copies_keep_the_common_prefix_and_rename_the_rest(bench):
    # Block 0 is in every request (a system prompt), 5 in one (a document).
    records = [_rec(0, [0, 1]), _rec(400, [0, 2]), _rec(1000, [0, 5]), _rec(1000, [0, 1, 3])]
    out, info = bench.tile(records, copies=3, shared_share=0.5, gap_ms=100)
    assert (info.requests, info.copies, info.span_ms) == (4, 3, 1100)
    # 0 (in all four) and 1 (in two of four) are shared; 2, 3 and 5 are not.
    assert info.shared_ids == 2
    assert [r["timestamp"] for r in out] == [0, 400, 1000, 1000, 1100, 1500, 2100, 2100, 2200, 2600, 3200, 3200]
    assert out[:4] == records  # the first copy is the trace itself
    for k in (1, 2):
        copy = out[4 * k : 4 * k + 4]
        assert [r["hash_ids"][0] for r in copy] == [0, 0, 0, 0]
        assert copy[0]["hash_ids"][1] == 1 and copy[3]["hash_ids"][1] == 1
        private = {copy[1]["hash_ids"][1], copy[2]["hash_ids"][1], copy[3]["hash_ids"][2]}
        assert len(private) == 3 and private.isdisjoint({0, 1, 2, 3, 5})
        assert all(r["output_length"] == 7 and r["input_length"] == 512 * len(r["hash_ids"]) for r in copy)
    ids = [{h for r in out[4 * k : 4 * k + 4] for h in r["hash_ids"]} - {0, 1} for k in range(3)]
    assert ids[0].isdisjoint(ids[1]) and ids[1].isdisjoint(ids[2]) and ids[0].isdisjoint(ids[2])


def test_the_tiled_sample_is_a_trace_the_replay_reads(bench, tmp_path, capsys):
    out = tmp_path / "tiled.jsonl.gz"
    assert bench.main([ARXIV, "--copies", "3", "--out", str(out)]) == 0
    assert "3 copies of 1000 requests" in capsys.readouterr().out
    original = load_trace(ARXIV)
    tiled = load_trace(str(out))
    assert len(tiled.requests) == 3 * len(original.requests)
    first = {h for r in tiled.requests[:1000] for h in r.hash_ids}
    third = {h for r in tiled.requests[2000:] for h in r.hash_ids}
    shared = first & third
    # The shared ids are the system prompts (blocks 0, 46-57 and 74-78 of the sample), held by
    # most requests; the documents are new in every copy.
    assert 0 < len(shared) < 0.01 * len(first)
    assert tiled.requests[1000].arrival - tiled.requests[0].arrival == pytest.approx(
        original.requests[-1].arrival - original.requests[0].arrival + 1.0
    )


@pytest.mark.parametrize(
    "body, message",
    [
        ("", "no records"),
        ("not json\n", "not JSON"),
        ('{"timestamp": 0, "hash_ids": ["a"]}\n', "hash_ids"),
        ('{"timestamp": -1, "hash_ids": [1]}\n', "timestamp"),
    ],
)
def test_a_bad_trace_is_named(bench, tmp_path, body, message):
    src = tmp_path / "t.jsonl"
    src.write_text(body)
    with pytest.raises(SystemExit, match=message):
        bench.main([str(src), "--out", str(tmp_path / "o.jsonl")])
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_settings_are_refused(bench):
    records = [_rec(0, [0])]
    for kwargs in ({"copies": 0}, {"shared_share": 0.0}, {"shared_share": 1.5}, {"gap_ms": -1}):
        args = {"copies": 2, "shared_share": 0.5, "gap_ms": 0, **kwargs}
        with pytest.raises(ValueError):
            bench.tile(records, **args)
    assert json.dumps(bench.tile(records, 1, 1.0, 0)[0]) == json.dumps(records)

"""benchmarks/conversation_links.py: the tracker's links against a trace's own conversation ids."""

from __future__ import annotations

import json

import pytest

from vllm_wa.replay.loaders import load_trace

from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("conversation_links")


def _line(chat: int, ts: float, n_in: int, hashes: tuple, parent: int = -1) -> str:
    rec = {"chat_id": chat, "parent_chat_id": parent, "timestamp": ts, "input_length": n_in, "output_length": 5}
    return json.dumps({**rec, "type": "text", "turn": 1, "hash_ids": list(hashes)})


@pytest.mark.parametrize("as_served", [False, True])
def test_each_lookup_is_counted_as_what_its_link_is(bench, tmp_path, as_served):
    # (1, 2, 3) is a system prompt every chat starts with; chat 1 caches it.
    lines = [
        _line(1, 0.0, 83, (1, 2, 3, 50, 51, 52)),
        _line(2, 10.0, 64, (1, 2, 3, 10)),  # one full block of its own
        _line(3, 20.0, 69, (1, 2, 3, 20, 21)),  # another user's first request: not chat 2's turn 2
        _line(4, 30.0, 101, (1, 2, 3, 10, 30, 31, 32), parent=2),  # chat 2's turn 2
        _line(5, 40.0, 69, (1, 2, 3, 60, 61), parent=4),  # turn 3, holding nothing of turn 2's
    ]
    p = tmp_path / "links.jsonl"
    p.write_text("\n".join(lines) + "\n")
    counts = bench.measure(load_trace(str(p), "bailian"), as_served=as_served)
    assert (counts.right, counts.wrong, counts.false, counts.missed, counts.new) == (1, 0, 0, 1, 3)


def test_a_trace_without_conversation_ids_is_refused(bench, tmp_path):
    p = tmp_path / "mooncake.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="names no conversations"):
        bench.measure(load_trace(str(p)))

"""benchmarks/heldout_split.py: the conversations the development split leaves out."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from vllm_wa.replay.loaders import load_trace

from conftest import load_benchmark

SAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "vllm_wa", "data", "agentic-coding-sample.tar.xz")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("heldout_split")


def _conversations(n: int) -> list[bytes]:
    with tarfile.open(SAMPLE) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".json")][:n]
        return [tar.extractfile(m).read() for m in members]


def test_the_held_out_tar_holds_the_conversations_the_split_lacks(bench, tmp_path):
    a, b, c = _conversations(3)
    traces = tmp_path / "traces"
    traces.mkdir()
    for name, body in (("trace_0001.json", a), ("trace_0002.json", b), ("trace_0003.json", c), ("trace_0004.json", b"")):
        (traces / name).write_bytes(body)
    (traces / "README.md").write_text("not a conversation")
    split = tmp_path / "dev.tar.xz"
    with tarfile.open(split, "w:xz") as tar:  # the real split's members are ./trace_NNNN.json
        for name, body in (("./trace_0001.json", a), ("./trace_0003.json", c)):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))

    held = bench.write_heldout(str(traces), str(split), str(tmp_path / "held.tar.xz"))

    assert held.written == ["trace_0002.json"]
    assert held.skipped_empty == ["trace_0004.json"]  # a checkout without its large file
    assert held.in_split == 2
    with tarfile.open(tmp_path / "held.tar.xz") as tar:
        assert tar.getnames() == ["trace_0002.json"]
    alone = load_trace(str(tmp_path / "held.tar.xz"))
    assert alone.requests and alone.conversations

"""The parsed-trace cache: a parse is reused only while its file, options and parser are the same."""

from __future__ import annotations

import json
import os

import pytest

from vllm_wa.cli import sample_path
from vllm_wa.replay import trace_cache

MOONCAKE = sample_path("mooncake-conversation-sample.jsonl.xz")


@pytest.fixture
def parses(tmp_path, monkeypatch):
    """The cache in a fresh folder, and the list of real parses made."""
    monkeypatch.setenv("VLLM_WA_CACHE", str(tmp_path / "cache"))
    made = []
    real = trace_cache.load_trace

    def counted(*args, **kwargs):
        made.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(trace_cache, "load_trace", counted)
    return made


def test_a_parse_is_reused_until_the_parser_changes(parses, monkeypatch):
    first = trace_cache.load_trace_cached(MOONCAKE)
    again = trace_cache.load_trace_cached(MOONCAKE)
    assert len(parses) == 1 and len(again.requests) == len(first.requests)
    monkeypatch.setattr(trace_cache, "_parser_digest", lambda: "another loader")
    trace_cache.load_trace_cached(MOONCAKE)
    assert len(parses) == 2


def test_a_copy_that_keeps_size_and_mtime_is_parsed_again(parses, tmp_path):
    """``cp -p``, ``rsync -t`` and ``tar x`` keep a file's mtime: a same-size
    replacement was given the old file's parse."""
    path = tmp_path / "t.jsonl"
    rec = {"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}
    path.write_text(json.dumps(rec) + "\n")
    first = trace_cache.load_trace_cached(str(path))
    st = os.stat(path)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(rec | {"hash_ids": [2]}) + "\n")
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    again = trace_cache.load_trace_cached(str(path))
    assert list(first.requests[0].hash_ids) == [1] and list(again.requests[0].hash_ids) == [2]
    assert len(parses) == 2


def test_an_unreadable_entry_is_parsed_again(parses):
    trace_cache.load_trace_cached(MOONCAKE)
    (entry,) = os.listdir(trace_cache.cache_dir())
    # What a newer Python's pickle looks like to this one: "unsupported pickle protocol" (a ValueError).
    with open(os.path.join(trace_cache.cache_dir(), entry), "wb") as f:
        f.write(b"\x80\x09garbage")
    assert trace_cache.load_trace_cached(MOONCAKE).requests
    assert len(parses) == 2


def test_the_cache_keeps_only_the_most_recently_used_parses(parses, monkeypatch, tmp_path):
    monkeypatch.setattr(trace_cache, "MAX_ENTRIES", 2)
    folder = trace_cache.cache_dir()
    seen: set[str] = set()
    for i, cut in enumerate((100.0, 200.0, 300.0)):
        trace_cache.load_trace_cached(MOONCAKE, cut=cut)
        for name in set(os.listdir(folder)) - seen:  # distinct use times, whatever the clock's grain
            os.utime(os.path.join(folder, name), ns=(10**9 * (i + 1),) * 2)
            seen.add(name)
    assert len(os.listdir(folder)) == 2
    assert len(parses) == 3
    trace_cache.load_trace_cached(MOONCAKE, cut=300.0)  # kept
    trace_cache.load_trace_cached(MOONCAKE, cut=100.0)  # pruned: parsed again
    assert len(parses) == 4


def test_pruning_touches_only_the_caches_own_files(parses, monkeypatch):
    """``VLLM_WA_CACHE`` may name a folder with other pickles: pruning removed
    every ``*.pkl`` but the newest eight.  It also removes the partial entry
    of a write killed long ago, not one being written now."""
    monkeypatch.setattr(trace_cache, "MAX_ENTRIES", 1)
    folder = trace_cache.cache_dir()
    os.makedirs(folder)
    others = ["model_1.pkl", "notes.txt", "0123456789abcdef01234567.pkl.bak", "ABCDEF0123456789ABCDEF01.pkl"]
    for name in others:
        with open(os.path.join(folder, name), "w") as f:
            f.write("theirs")
        os.utime(os.path.join(folder, name), (1.0, 1.0))  # older than any entry
    killed, writing = "0" * 24 + ".pkl.tmp123-456", "1" * 24 + ".pkl.tmp789-1"
    for name, age in ((killed, 2 * trace_cache.STALE_PARTIAL_S), (writing, 10.0)):
        with open(os.path.join(folder, name), "w") as f:
            f.write("partial")
        t = os.stat(os.path.join(folder, name)).st_mtime - age
        os.utime(os.path.join(folder, name), (t, t))
    trace_cache.load_trace_cached(MOONCAKE, cut=100.0)
    trace_cache.load_trace_cached(MOONCAKE, cut=200.0)
    left = set(os.listdir(folder))
    assert set(others) | {writing} <= left and killed not in left
    assert len(left - set(others) - {writing}) == 1  # the newest entry


def test_a_cache_it_may_not_touch_is_still_read(parses, monkeypatch):
    trace_cache.load_trace_cached(MOONCAKE)

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(trace_cache.os, "utime", refuse)
    assert trace_cache.load_trace_cached(MOONCAKE).requests
    assert len(parses) == 1


@pytest.mark.parametrize("where", ["entry", "folder"])
def test_an_entry_anyone_may_write_is_not_unpickled(parses, where):
    """Unpickling runs code: a cache entry, or a cache folder, that every user
    may write is not read; the trace is parsed again.  Group-writable is read
    (under umask 002 every entry is)."""
    trace_cache.load_trace_cached(MOONCAKE)
    folder = trace_cache.cache_dir()
    (entry,) = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".pkl")]
    target = entry if where == "entry" else folder
    os.chmod(target, os.stat(target).st_mode | 0o020)
    trace_cache.load_trace_cached(MOONCAKE)
    assert len(parses) == 1
    os.chmod(target, os.stat(target).st_mode | 0o002)
    assert trace_cache.load_trace_cached(MOONCAKE).requests
    assert len(parses) == 2
    os.chmod(target, os.stat(target).st_mode & ~0o002)
    trace_cache.load_trace_cached(MOONCAKE)
    assert len(parses) == 2  # the rewritten entry is read again

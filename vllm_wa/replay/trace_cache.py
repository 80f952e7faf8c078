"""A pickle cache of parsed traces: the agentic split takes ~45 s to parse, ~2 s to unpickle."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import re
import time
from dataclasses import asdict
from typing import Any

from vllm_wa import fileio, served_format, validation, workload_classes
from vllm_wa.fileio import atomic_write
from vllm_wa.replay import block_chains, lifetime, loaders, records, served
from vllm_wa.replay import trace as trace_module
from vllm_wa.replay.loaders import AgenticOptions, check_trace_path, load_trace
from vllm_wa.replay.trace import Trace
from vllm_wa.sim import token_ids

logger = logging.getLogger(__name__)
CACHE_VERSION = 3
# Parsed traces kept, most recently used first (the agentic split's is 340 MB).
MAX_ENTRIES = 8
# An entry's name (:func:`_key`), or a partial one that ``atomic_write`` left.
_ENTRY = re.compile(r"[0-9a-f]{24}\.pkl(\.tmp\d+-\d+)?")
# A partial entry this old is a write that was killed (the agentic split's takes seconds).
STALE_PARTIAL_S = 3600.0
_PARSERS = (
    loaders, block_chains, records, trace_module, served, served_format, lifetime, token_ids, validation, fileio,
    workload_classes,  # tag names
)


@functools.cache
def _parser_digest() -> str:
    """The parsing code's own digest: a changed loader re-parses instead of reading an old parse."""
    h = hashlib.sha256()
    for module in _PARSERS:
        with open(module.__file__, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _ours(path: str) -> bool:
    """Whether ``path`` is this user's and not writable by every user.

    Unpickling runs code: an entry (or a folder) that another user owns, or
    that anyone may write, is not read, whatever ``VLLM_WA_CACHE`` points at;
    the trace is parsed again (and the entry rewritten, where this user can).
    Group-writable passes: under umask 002 (a user's own group) every entry
    is, and the folder this module creates is this user's alone.
    """
    st = os.stat(path)
    return st.st_uid == os.getuid() and not st.st_mode & 0o002


def cache_dir() -> str:
    return os.environ.get("VLLM_WA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "vllm-wa", "traces")


def _key(path: str, fmt: str | None, skip_bad: bool, agentic: AgenticOptions | None, cut: float | None) -> str:
    st = os.stat(path)
    parts: list[Any] = [
        CACHE_VERSION,
        _parser_digest(),
        os.path.abspath(path),
        st.st_size,
        st.st_mtime_ns,
        # A copy that keeps the mtime (cp -p, rsync -t, tar x) has the same
        # size and mtime; its inode or change time differs (ctime cannot be set).
        st.st_ino,
        st.st_ctime_ns,
        fmt,
        skip_bad,
        asdict(agentic) if agentic else None,
        cut,
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def load_trace_cached(
    path: str,
    fmt: str | None = None,
    *,
    skip_bad: bool = False,
    agentic: AgenticOptions | None = None,
    cut: float | None = None,
    use_cache: bool = True,
) -> Trace:
    """``load_trace`` with a cache keyed by the file's path, size, mtime and options."""
    check_trace_path(path)  # a pipe is refused before a cache entry is keyed by it
    if not use_cache or os.path.isdir(path):
        return load_trace(path, fmt, skip_bad=skip_bad, agentic=agentic, cut=cut)
    file = os.path.join(cache_dir(), _key(path, fmt, skip_bad, agentic, cut) + ".pkl")
    try:
        if _ours(file) and _ours(cache_dir()):
            with open(file, "rb") as f:
                trace = pickle.load(f)
            if isinstance(trace, Trace):
                with contextlib.suppress(OSError):  # a read-only cache is still read
                    os.utime(file)  # recently used: pruned last
                return trace
    except Exception:  # noqa: BLE001 - any unreadable entry (another Python's pickle, a torn file) is parsed again
        pass
    trace = load_trace(path, fmt, skip_bad=skip_bad, agentic=agentic, cut=cut)
    try:
        os.makedirs(cache_dir(), mode=0o700, exist_ok=True)
        with atomic_write(file, "wb") as f:
            pickle.dump(trace, f, protocol=pickle.HIGHEST_PROTOCOL)
        prune(MAX_ENTRIES)
    except OSError as e:
        logger.warning("could not write the trace cache %s: %s", file, e)
    return trace


def prune(keep: int, now: float | None = None) -> list[str]:
    """Remove all but the ``keep`` most recently used parsed traces, and the
    partial files of writes killed over an hour ago; returns what was removed.

    Only this cache's own files (:data:`_ENTRY`, named by :func:`_key`) are
    touched: ``VLLM_WA_CACHE`` may point at a folder that holds others.
    """
    folder = cache_dir()
    now = time.time() if now is None else now
    entries, stale = [], []
    for name in os.listdir(folder):
        m = _ENTRY.fullmatch(name)
        if m is None:
            continue
        full = os.path.join(folder, name)
        try:
            mtime = os.stat(full).st_mtime
        except OSError:
            continue
        if m.group(1) is None:
            entries.append((mtime, full))
        elif now - mtime > STALE_PARTIAL_S:
            stale.append(full)
    entries.sort(reverse=True)
    removed = []
    for full in [full for _, full in entries[keep:]] + stale:
        with contextlib.suppress(OSError):  # another process removed it first
            os.remove(full)
            removed.append(full)
    return removed

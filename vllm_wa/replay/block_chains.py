"""Trace block ids read as vLLM's prefix cache reads its hashes: a block is its id *and* its prefix.

vLLM chains each block's hash with its parent's, so a block is hit only
behind the prefix it was computed after.  Mooncake's and the agentic traces'
ids are chained already.  The Aliyun Bailian traces' are not: each 16-token
block is hashed on its own ("Apply salted SipHash-2-4 to each block", the
dataset's README), so repeated content repeats its id inside one prompt and
the same id follows different prefixes.  In trace A's third request (chat 2)
id 418 stands at blocks 418 and 420, and in its eighth (chat 7) ids
1169-1171 at blocks 80-82 and 131-133.  Taken as they come, such ids would
let a prompt hit a block computed after another prefix, and hold one block
twice.

:func:`chain_block_ids` renames, at load time, every id that appears after
another prefix than at its first appearance, so every policy and both
engines see chained ids.  A trace whose ids are chained keeps them as they
are, to the digit.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from vllm_wa.replay.trace import TraceRequest

_INT64_MAX = (1 << 63) - 1


def chains_hold(reqs: Sequence[TraceRequest]) -> bool:
    """True when every id follows one prefix: wherever it appears, the same
    id precedes it (none for a prompt's first block), and no id repeats
    within a prompt.  Vectorized: the common case costs no Python loop."""
    if not reqs:
        return True
    lens = np.fromiter((len(r.hash_ids) for r in reqs), dtype=np.int64, count=len(reqs))
    flat = np.concatenate([np.frombuffer(r.hash_ids, dtype=np.int64) for r in reqs])
    _, first, dense = np.unique(flat, return_index=True, return_inverse=True)
    pred = np.empty_like(dense)
    pred[1:] = dense[:-1]
    pred[np.cumsum(lens) - lens] = -1
    return not bool((pred[first][dense] != pred).any())


def chain_block_ids(reqs: Sequence[TraceRequest]) -> int:
    """Give every block id, in place, one prefix; returns how many requests changed.

    Requests are read in the order given (arrival order).  An id keeps its
    value behind the prefix of its first appearance; behind any other prefix
    (its predecessor's chained id differs) it becomes a new id, the same one
    for every request with that prefix.  New ids count up from the trace's
    largest id; should that pass 2**63 - 1, all ids are first renumbered
    densely from 0 (their equalities, all a replay reads, are kept).
    """
    if chains_hold(reqs):
        return 0
    top = max(max(r.hash_ids) for r in reqs)
    total = sum(len(r.hash_ids) for r in reqs)
    if top > _INT64_MAX - total:
        _renumber_densely(reqs)
        top = max(max(r.hash_ids) for r in reqs)
    first_prefix: dict[int, int] = {}  # id -> chained id before its first appearance (-1: none)
    renamed: dict[tuple[int, int], int] = {}  # (chained predecessor, id) -> its new id
    next_id = top + 1
    changed = 0
    for r in reqs:
        ids = r.hash_ids
        out: array | None = None
        prev = -1
        for j, h in enumerate(ids):
            if first_prefix.setdefault(h, prev) == prev:
                cur = h
            else:
                cur = renamed.get((prev, h), -1)
                if cur < 0:
                    cur = renamed[(prev, h)] = next_id
                    next_id += 1
                if out is None:
                    out = array("q", ids)
                out[j] = cur
            prev = cur
        if out is not None:
            r.hash_ids = out
            changed += 1
    return changed


def _renumber_densely(reqs: Sequence[TraceRequest]) -> None:
    lens = [len(r.hash_ids) for r in reqs]
    flat = np.concatenate([np.frombuffer(r.hash_ids, dtype=np.int64) for r in reqs])
    _, dense = np.unique(flat, return_inverse=True)
    start = 0
    for r, n in zip(reqs, lens, strict=True):
        r.hash_ids = array("q", dense[start : start + n].astype(np.int64).tobytes())
        start += n

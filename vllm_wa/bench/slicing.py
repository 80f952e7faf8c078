"""Cut a trace down to a benchmark slice a given server (and CPU) can serve.

The slice keeps the trace's prefix structure and timing: conversations keep
their own hash ids, arrival times and outcomes; only their number, the time
span and the prompt lengths shrink.  Every step is deterministic, so the LRU
and the ``--wa-online`` server receive the same requests.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, replace

from vllm_wa.replay.trace import Trace, TraceRequest


@dataclass(frozen=True)
class SliceSpec:
    """How to cut a trace; ``None`` keeps that dimension as it is.

    Args:
        block_size: re-block to this many tokens per block (a divisor or a
            multiple of the trace's block size), so it matches the server's.
        max_prompt_blocks: truncate every prompt to its first K blocks
            (counted after re-blocking).
        conversations: keep the N conversations that start first.
        duration: keep the requests arriving less than D s after the first one.
    """

    block_size: int | None = None
    max_prompt_blocks: int | None = None
    conversations: int | None = None
    duration: float | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_prompt_blocks", "conversations"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.duration is not None and not (math.isfinite(self.duration) and self.duration > 0):
            raise ValueError(f"duration must be a positive number of seconds, got {self.duration!r}")

    def describe(self) -> str:
        parts = []
        if self.conversations is not None:
            parts.append(f"the first {self.conversations} conversations")
        if self.duration is not None:
            parts.append(f"the first {self.duration:g} s")
        if self.block_size is not None:
            parts.append(f"{self.block_size}-token blocks")
        if self.max_prompt_blocks is not None:
            parts.append(f"prompts truncated to their first {self.max_prompt_blocks} blocks")
        return ", ".join(parts) or "the whole trace"


def reblock(trace: Trace, block_size: int) -> Trace:
    """The same requests with ``block_size``-token blocks.

    Splitting (the new size divides the old one) gives block ``h`` the ids
    ``h * f + j``; merging (the new size is a multiple) names each merged block
    by the id of its last old block, which implies all the blocks before it.
    Either way, two prompts share a new block exactly when they shared the old
    blocks it covers.
    """
    old = trace.block_size
    if block_size == old:
        return trace
    if old % block_size == 0:
        f = old // block_size

        def convert(ids: array, n_tokens: int) -> array:
            out = array("q", (h * f + j for h in ids for j in range(f)))
            return out[: math.ceil(n_tokens / block_size)]

    elif block_size % old == 0:
        f = block_size // old

        def convert(ids: array, n_tokens: int) -> array:
            n_new = math.ceil(n_tokens / block_size)
            return array("q", (ids[min(len(ids), (k + 1) * f) - 1] for k in range(n_new)))

    else:
        raise ValueError(f"cannot re-block {old}-token blocks into {block_size}-token blocks (neither divides the other)")
    limit = (1 << 62) // max(1, old // block_size)
    reqs = []
    for r in trace.requests:
        if old % block_size == 0 and max(r.hash_ids) >= limit:
            raise ValueError(f"request {r.request_id}: hash id too large to split into {block_size}-token blocks")
        reqs.append(replace(r, hash_ids=convert(r.hash_ids, r.input_tokens)))
    # Other ids: the file's ids of the old ones no longer name them.
    out = replace(trace.with_requests(reqs), block_size=block_size, source_ids=None)
    out.notes.append(f"re-blocked from {old}- to {block_size}-token blocks")
    return out


def truncate_prompts(trace: Trace, max_blocks: int) -> Trace:
    """Every prompt cut to its first ``max_blocks`` blocks (whole blocks)."""
    bs = trace.block_size
    reqs = []
    cut = 0
    for r in trace.requests:
        if len(r.hash_ids) > max_blocks:
            cut += 1
            r = replace(r, hash_ids=r.hash_ids[:max_blocks], input_tokens=max_blocks * bs)
        reqs.append(r)
    out = trace.with_requests(reqs)
    out.notes.append(f"{cut} of {len(reqs)} prompts truncated to their first {max_blocks} blocks ({max_blocks * bs} tokens)")
    return out


def fit_prompts_to_blocks(reqs: list[TraceRequest], block_size: int) -> tuple[list[TraceRequest], int]:
    """Prompts cut to the tokens their hash ids cover, and how many were cut.

    The agentic traces hash full blocks only: a prompt's last partial block
    (up to ``block_size - 1`` tokens) has no id, so nothing says what its
    tokens are.  Sent as they stand, the prompt could not be spelled from its
    ids, and re-blocking would name the uncovered tokens by the last id again.
    A partial block is never cached, so the cut changes no hit.
    """
    out, cut = [], 0
    for r in reqs:
        covered = len(r.hash_ids) * block_size
        if r.input_tokens > covered:
            r = replace(r, input_tokens=covered)
            cut += 1
        out.append(r)
    return out, cut


def slice_trace(trace: Trace, spec: SliceSpec) -> Trace:
    """Apply ``spec``: conversations, then duration, then re-blocking, then truncation.

    Prompts longer than their hash ids cover are cut to them first
    (:func:`fit_prompts_to_blocks`).
    """
    reqs, uncovered = fit_prompts_to_blocks(list(trace.requests), trace.block_size)
    if spec.conversations is not None and not trace.conversations:
        raise ValueError(f"{trace.name} names no conversations to keep; cut it by time (--duration) instead")
    if spec.conversations is not None:
        first: dict[int, float] = {}
        for r in reqs:
            first.setdefault(r.conversation, r.arrival)
        keep = set(sorted(first, key=lambda c: (first[c], c))[: spec.conversations])
        reqs = [r for r in reqs if r.conversation in keep]
    if spec.duration is not None and reqs:
        limit = reqs[0].arrival + spec.duration
        reqs = [r for r in reqs if r.arrival < limit]
    if not reqs:
        raise ValueError(f"the slice ({spec.describe()}) holds no requests")
    out = trace.with_requests(reqs)
    if uncovered:
        out.notes.append(
            f"{uncovered} of {len(trace.requests)} prompts cut to the full blocks their hash ids cover "
            "(their last partial block has no id)"
        )
    if spec.block_size is not None:
        out = reblock(out, spec.block_size)
    if spec.max_prompt_blocks is not None:
        out = truncate_prompts(out, spec.max_prompt_blocks)
    out.notes.append(f"slice: {spec.describe()} ({len(out.requests)} requests)")
    return out

"""The replay's in-memory trace: requests with prompt block hashes and times."""

from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import dataclass, field, replace
from operator import attrgetter

import numpy as np

# A split window holding under this share of the requests its share of the
# time would is reported (``Trace.split_warning``).
LOPSIDED_SPLIT = 0.1


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace, normalized across formats.

    ``hash_ids`` has one id per ``Trace.block_size``-token block of the
    prompt; ids are global to the trace (per-conversation namespaces are
    folded in by the loader), and a block's id implies its whole prefix.
    """

    request_id: str
    arrival: float
    hash_ids: array
    input_tokens: int
    output_tokens: int
    tag: str = "default"
    conversation: int = -1
    # What the reply did: "tool" (asked for a tool), "stop" (ended the
    # turn), "length"; None when the trace does not say.
    outcome: str | None = None
    # Seconds the request holds its blocks, when the trace records it.
    service_time: float | None = None


@dataclass
class Trace:
    """A whole trace, requests sorted by arrival time."""

    name: str
    block_size: int
    requests: list[TraceRequest]
    fmt: str
    synthetic: bool = False
    skipped_lines: int = 0
    notes: list[str] = field(default_factory=list)
    # Whether ``TraceRequest.conversation`` identifies conversations (a client
    # hint some peer policies read); Mooncake traces have none.
    conversations: bool = False
    # Set by ``renumber_ids``: the file's id of each block id (index: id).
    source_ids: np.ndarray | None = None

    @property
    def start(self) -> float:
        return self.requests[0].arrival if self.requests else 0.0

    @property
    def end(self) -> float:
        return self.requests[-1].arrival if self.requests else 0.0

    @property
    def id_space(self) -> int | None:
        """``n`` when the block ids are ``0 .. n-1`` (set by ``renumber_ids``), else None."""
        return len(self.source_ids) if self.source_ids is not None else None

    def eval_start(self, profile_fraction: float) -> float:
        """The time from which hits are measured (after the profiling window)."""
        return self.start + profile_fraction * (self.end - self.start)

    def requests_since(self, t: float) -> int:
        """How many requests arrive at or after ``t`` (the requests are in arrival order)."""
        return len(self.requests) - bisect_left(self.requests, t, key=attrgetter("arrival"))

    def split_warning(self, profile_fraction: float) -> str | None:
        """A warning when the profile or evaluation window holds under a tenth
        of the requests its share of the time would: the split is by time, so
        one stray timestamp (milliseconds read as seconds, say) can leave a
        handful of requests to measure."""
        n = len(self.requests)
        eval_start = self.eval_start(profile_fraction)
        k = self.requests_since(eval_start)
        for window, share, expected in (
            ("evaluation", k / n if n else 1.0, 1.0 - profile_fraction),
            ("profile", (n - k) / n if n else 1.0, profile_fraction),
        ):
            if expected > 0 and share < LOPSIDED_SPLIT * expected:
                gap, at = max(
                    ((b.arrival - a.arrival, a.arrival) for a, b in zip(self.requests, self.requests[1:])),
                    default=(0.0, self.start),
                )
                return (
                    f"warning: the {window} window ({expected:.0%} of the time, split at t={eval_start:.6g}s) "
                    f"holds {share:.1%} of the {n} requests; the longest gap between arrivals is {gap:.6g}s "
                    f"of {self.end - self.start:.6g}s, after t={at:.6g}s: check the timestamps"
                )
        return None

    def unique_blocks(self, since: float = float("-inf"), until: float = float("inf")) -> int:
        reqs = [r for r in self.requests if since <= r.arrival < until]
        if self.id_space is not None and reqs:
            # Renumbered ids: mark them in an array (a set of millions of ints takes seconds).
            seen = np.zeros(self.id_space, dtype=bool)
            seen[np.concatenate([np.frombuffer(r.hash_ids, dtype=np.int64) for r in reqs])] = True
            return int(np.count_nonzero(seen))
        ids: set[int] = set()
        for r in reqs:
            ids.update(r.hash_ids)
        return len(ids)

    def full_blocks(self, req: TraceRequest) -> int:
        """How many of ``req``'s listed blocks are full.

        Bailian and Mooncake list a prompt's partial last block too (the
        agentic loader lists full blocks only); only the last one can be
        partial, whatever the token count says.
        """
        n = len(req.hash_ids)
        return n if req.input_tokens >= n * self.block_size else max(0, n - 1)

    def tags(self) -> list[str]:
        return sorted({r.tag for r in self.requests})

    @property
    def has_outcomes(self) -> bool:
        """Whether any request says how its reply ended (a client hint for some peers)."""
        return any(r.outcome is not None for r in self.requests)

    def with_requests(self, requests: list[TraceRequest]) -> Trace:
        """The same trace (name, format, notes) with other requests."""
        return replace(self, requests=requests, notes=list(self.notes))

    def head(self, n: int) -> Trace:
        """The first ``n`` requests, as a trace of their own."""
        return self.with_requests(self.requests[:n])

    def until(self, t: float) -> Trace:
        """The requests arriving before ``t``, as a trace of their own."""
        return self.with_requests([r for r in self.requests if r.arrival < t])


def renumber_ids(trace: Trace) -> Trace:
    """The trace with its block ids renumbered ``0 .. n-1`` in the order of their values.

    Every policy reads block ids only by equality (and never by value), so
    this changes no result; it speeds up every replay.  A Python dict finds
    an int key's slot from the int itself: dense ids put a prompt's
    consecutive blocks in neighbouring slots, where scattered ids (the
    agentic loader namespaces each conversation's in the high bits,
    ``(conversation + 1) << 40 | id``) cost a cache miss a block: 722 ns a
    lookup against 278 ns in a micro-benchmark with 1.6 M keys.  The
    numbering is monotone, so any order among ids is kept.  The file's ids
    stay in ``source_ids``, by which the controller hash-samples blocks, so
    it watches the same blocks.  A trace whose ids are already ``0 .. n-1``
    (or that was renumbered, or whose ids are not int64 arrays) is returned
    as is.
    """
    reqs = trace.requests
    if trace.source_ids is not None or not reqs:
        return trace
    if not all(isinstance(r.hash_ids, array) and r.hash_ids.typecode == "q" for r in reqs):
        return trace  # ids that are not the loaders' int64 arrays (tests' stand-ins)
    flat = np.concatenate([np.frombuffer(r.hash_ids, dtype=np.int64) for r in reqs])
    source, dense = np.unique(flat, return_inverse=True)
    if source[0] == 0 and source[-1] == len(source) - 1:
        return trace
    bounds = np.cumsum([len(r.hash_ids) for r in reqs])[:-1]
    out = []
    for r, ids in zip(reqs, np.split(dense.astype(np.int64, copy=False), bounds)):
        a = array("q")
        a.frombytes(ids.tobytes())
        out.append(replace(r, hash_ids=a))
    renumbered = trace.with_requests(out)
    renumbered.source_ids = source
    return renumbered

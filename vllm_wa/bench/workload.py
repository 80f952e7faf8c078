"""What the benchmark client sends: a trace's requests, grouped into conversations.

Each conversation is replayed closed-loop: a turn is sent at
``max(its trace time, the previous reply's end + its think time)``, both
scaled by the time scale, so a slow server delays a conversation's next turn
the way a slow reply delays a person or a tool.  A trace that names no
conversations (Mooncake's) is replayed open-loop: each request is sent at
its own time, whatever the replies before it.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

from vllm_wa.replay.trace import Trace

# The replies' outcomes a hint may carry (see vllm_wa.serving.outcome_hints).
HINT_OUTCOMES = ("tool", "stop", "length")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send; times in trace seconds from the slice's first request."""

    index: int
    trace_id: str
    conversation: int
    tag: str
    outcome: str | None
    arrival: float
    think: float
    hash_ids: array
    input_tokens: int
    max_tokens: int


@dataclass
class Workload:
    """The requests of a slice, by conversation, with what was left out and why."""

    name: str
    block_size: int
    requests: list[BenchRequest]
    # Requests sent one after the other, by conversation; a trace without
    # conversations has one entry a request, keyed by its negated index + 1.
    conversations: dict[int, list[int]]
    excluded_too_long: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def span(self) -> float:
        return max((r.arrival for r in self.requests), default=0.0)

    def unique_blocks(self) -> int:
        seen: set[int] = set()
        for r in self.requests:
            seen.update(r.hash_ids)
        return len(seen)

    def max_prompt_tokens(self) -> int:
        return max((r.input_tokens for r in self.requests), default=0)

    def max_request_tokens(self) -> int:
        return max((r.input_tokens + r.max_tokens for r in self.requests), default=0)


def build_workload(trace: Trace, max_output_tokens: int, max_model_len: int | None = None) -> Workload:
    """Requests of ``trace`` with ``max_tokens = min(trace output, max_output_tokens)`` (at least 1).

    A request whose prompt plus reply would not fit ``max_model_len`` is left
    out (counted); build the slice so that none is.  Think time: the gap
    between a turn's arrival and the previous turn's arrival plus its recorded
    service time (the whole gap when the trace records none).  Without
    conversations in the trace every request stands alone (think time 0).
    """
    if max_output_tokens < 1:
        raise ValueError(f"max output tokens must be at least 1, got {max_output_tokens}")
    t0 = trace.start
    prev: dict[int, tuple[float, float]] = {}
    reqs: list[BenchRequest] = []
    convs: dict[int, list[int]] = {}
    too_long = 0
    for r in trace.requests:
        if not (math.isfinite(r.arrival) and r.input_tokens >= 1 and len(r.hash_ids) >= 1):
            raise ValueError(f"request {r.request_id}: bad arrival time or empty prompt")
        max_tokens = max(1, min(r.output_tokens, max_output_tokens))
        last = prev.get(r.conversation) if trace.conversations else None
        think = 0.0 if last is None else max(0.0, r.arrival - last[0] - last[1])
        prev[r.conversation] = (r.arrival, r.service_time or 0.0)
        if max_model_len is not None and r.input_tokens + max_tokens > max_model_len:
            too_long += 1
            continue
        i = len(reqs)
        reqs.append(
            BenchRequest(
                index=i,
                trace_id=r.request_id,
                conversation=r.conversation,
                tag=r.tag,
                outcome=r.outcome if r.outcome in HINT_OUTCOMES else None,
                arrival=r.arrival - t0,
                think=think,
                hash_ids=r.hash_ids,
                input_tokens=r.input_tokens,
                max_tokens=max_tokens,
            )
        )
        convs.setdefault(r.conversation if trace.conversations else -1 - i, []).append(i)
    if not reqs:
        raise ValueError("no request of the trace fits the server's max_model_len")
    w = Workload(trace.name, trace.block_size, reqs, convs, too_long, list(trace.notes))
    if too_long:
        w.notes.append(f"{too_long} requests left out: prompt + reply over max_model_len {max_model_len}")
    return w

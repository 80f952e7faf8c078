"""How well the engine-side conversation tracker links turns, checked against a trace's own conversation ids.

The tracker (:mod:`vllm_wa.engine_patch.conversations`) sees block hashes
only; its think time, turn count and growth are features of the candidates'
class keys.  A trace that names its conversations (agentic, Bailian) says
which of its links are right.  Each request's lookup is counted as one of:

* ``right``: linked to a finished request of its own conversation;
* ``wrong``: linked to another conversation's request, when its own had one before;
* ``false``: linked, though it is its conversation's first request (a shared
  system prompt's block taken for a turn's tip reads like this);
* ``missed``: not linked, though its conversation had a request before;
* ``new``: not linked, and its conversation's first request.

Requests finish when the replay's lifetime model says (by their next turn's
arrival, :meth:`~vllm_wa.replay.lifetime.LifetimeModel.finish_times`).  A request's cached prefix
is what an infinite cache would hold (it decides which blocks a request
computed itself, and so whether a continuation leaves a second tip; a finite
cache recomputes more of them).  ``--as-served`` gives the tracker each prompt's full
blocks only, as vLLM hashes them: a trace's partial last block is dropped.

    python benchmarks/conversation_links.py agentic-coding-dev.tar.xz
    python benchmarks/conversation_links.py synthetic-bailian.jsonl.gz --as-served
"""

from __future__ import annotations

import argparse
import heapq
from dataclasses import asdict, dataclass
from typing import Any

from vllm_wa.engine_patch.conversations import ConversationTracker
from vllm_wa.replay.lifetime import LifetimeModel
from vllm_wa.replay.loaders import load_trace
from vllm_wa.replay.trace import Trace


@dataclass
class LinkCounts:
    right: int = 0
    wrong: int = 0
    false: int = 0
    missed: int = 0
    new: int = 0

    @property
    def lookups(self) -> int:
        return self.right + self.wrong + self.false + self.missed + self.new


def measure(trace: Trace, as_served: bool = False, lifetime: LifetimeModel | None = None) -> LinkCounts:
    """Replay ``trace``'s lookups and finishes through a tracker; count its links."""
    if not trace.conversations:
        raise ValueError(f"{trace.name} names no conversations: nothing to check the links against")
    lifetime = lifetime or LifetimeModel()
    tracker = ConversationTracker()
    counts = LinkCounts()
    cached: set[Any] = set()
    seen_conversations: set[int] = set()
    conversation_of: dict[int, tuple[Any, int]] = {}  # id(tip) -> (tip, its request's conversation)
    finishing: list[tuple[float, int, Any, tuple, int, int]] = []
    finish = lifetime.finish_times(trace)
    for serial, req in enumerate(trace.requests):
        now = req.arrival
        while finishing and finishing[0][0] <= now:
            at, _, timing, tips, n_blocks, conv = heapq.heappop(finishing)
            tracker.finished(timing, tips, n_blocks, at)
            if tips:
                tip = tracker.tips[tips[-1]]
                conversation_of[id(tip)] = (tip, conv)
        full = trace.full_blocks(req)
        hashes = list(req.hash_ids[:full]) if as_served else list(req.hash_ids)
        n_hit = 0
        for h in hashes:
            if h not in cached:
                break
            n_hit += 1
        tracker.expire(now)
        found = tracker.continued(hashes)  # before the lookup resolves it
        timing = tracker.lookup(hashes, n_hit, now)
        before = req.conversation in seen_conversations
        if found is None:
            counts.missed += before
            counts.new += not before
        elif conversation_of[id(found[1])][1] == req.conversation:
            counts.right += 1
        elif before:
            counts.wrong += 1
        else:
            counts.false += 1
        seen_conversations.add(req.conversation)
        cached.update(hashes)
        tips = tracker.tips_of(hashes, n_hit, None if as_served else full, timing.start)
        heapq.heappush(finishing, (float(finish[serial]), serial, timing, tips, len(hashes), req.conversation))
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="an agentic or Bailian trace (one that names its conversations)")
    ap.add_argument("--as-served", action="store_true", help="full blocks only, as vLLM hashes a prompt")
    args = ap.parse_args(argv)
    try:
        counts = measure(load_trace(args.trace), as_served=args.as_served)
    except ValueError as e:  # a trace without conversation ids
        raise SystemExit(f"{args.trace}: {e}") from None
    n = max(1, counts.lookups)
    print(f"{args.trace}{' (as served)' if args.as_served else ''}: {counts.lookups} lookups")
    for name, value in asdict(counts).items():
        print(f"  {name:7s} {value:8d}  {100.0 * value / n:6.2f} %")


if __name__ == "__main__":
    main()

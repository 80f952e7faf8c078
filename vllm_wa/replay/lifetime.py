"""How long a replayed request pins its blocks.

A request holds its prompt's blocks from arrival until it finishes.  Traces
that record a service time (``api_time`` in the agentic-coding traces) use
it; otherwise a throughput model: the prompt is prefilled at
``prefill_tokens_per_s`` and the reply decoded at ``decode_tokens_per_s``.
The model deliberately ignores cache hits, so every policy replays the same
timeline and differences in hit rate come from eviction alone.

A trace that names its conversations also says when a reply had finished at
the latest: the next turn, which carries the reply, arrived.  A service time,
modelled or recorded, that runs past that arrival is cut there
(:meth:`LifetimeModel.finish_times`); otherwise the replay would hold a turn's
blocks while its own continuation looks them up, and read the continuation
as a new conversation (5.4 % of the synthetic Bailian trace's requests did).
The agentic traces' recorded ``api_time`` runs past it in 34 requests of the
development split, by at most 0.61 s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_wa.replay.trace import Trace, TraceRequest

# Turns of one conversation still waiting for their continuation; a
# conversation whose prompts stop extending each other (a client that
# compacts its history) drops the oldest.
MAX_OPEN_TURNS = 64


@dataclass(frozen=True)
class LifetimeModel:
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 30.0
    min_service_s: float = 0.05
    use_trace_service_time: bool = True
    # Cut a service time at the arrival of the turn that continues it (traces with conversation ids).
    end_by_next_turn: bool = True

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_tokens_per_s <= 0 or self.min_service_s < 0:
            raise ValueError("throughputs must be positive and min_service_s non-negative")

    def service_time(self, req: TraceRequest) -> float:
        if self.use_trace_service_time and req.service_time is not None:
            return max(self.min_service_s, req.service_time)
        return max(
            self.min_service_s,
            req.input_tokens / self.prefill_tokens_per_s + req.output_tokens / self.decode_tokens_per_s,
        )

    def finish_times(self, trace: Trace) -> np.ndarray:
        """Each request's finish time, in trace order.

        A request's continuation is the first later request of its
        conversation whose prompt holds the request's full blocks, or all but
        the last of them and a block of its own in the last one's place (a
        client that rewrote the end of its last block: the conversation
        tracker's earlier tip); the request finishes by that arrival.
        Requests of traces without conversation ids, and requests nothing
        continues, keep their service time.
        """
        reqs = trace.requests
        finish = np.fromiter((r.arrival + self.service_time(r) for r in reqs), dtype=np.float64, count=len(reqs))
        if not (self.end_by_next_turn and trace.conversations):
            return finish
        # conversation -> (request, its full blocks, the id a continuation holds at position k)
        open_turns: dict[int, list[tuple[int, int, int, Any]]] = {}
        for j, req in enumerate(reqs):
            waiting = open_turns.setdefault(req.conversation, [])
            ids = req.hash_ids
            still = []
            for turn in waiting:
                i, n, k, held = turn
                if len(ids) >= n and ids[k] == held:
                    finish[i] = min(finish[i], req.arrival)
                else:
                    still.append(turn)
            n = trace.full_blocks(req)
            if n > 0:
                k = max(0, n - 2)  # ids imply their prefix: holding block n-2 holds every earlier one
                still.append((j, n, k, ids[k]))
            open_turns[req.conversation] = still[-MAX_OPEN_TURNS:]
        return finish

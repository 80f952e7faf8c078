"""How long a replayed request pins its blocks.

A request holds its prompt's blocks from arrival until it finishes.  Traces
that record a service time (``api_time`` in the agentic-coding traces) use
it; otherwise a throughput model: the prompt is prefilled at
``prefill_tokens_per_s`` and the reply decoded at ``decode_tokens_per_s``.
The model deliberately ignores cache hits, so every policy replays the same
timeline and differences in hit rate come from eviction alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_wa.replay.trace import TraceRequest


@dataclass(frozen=True)
class LifetimeModel:
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 30.0
    min_service_s: float = 0.05
    use_trace_service_time: bool = True

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

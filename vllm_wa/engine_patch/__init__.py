"""The workload-aware free queue and the hooks that install it into vLLM."""

from vllm_wa.engine_patch.events import (
    EventKind,
    EventSink,
    EvictedEvent,
    FinishedEvent,
    FreedEvent,
    LookupEvent,
    OutcomeEvent,
)
from vllm_wa.engine_patch.free_queue import WorkloadAwareFreeQueue

__all__ = [
    "EventKind",
    "EventSink",
    "EvictedEvent",
    "FinishedEvent",
    "FreedEvent",
    "LookupEvent",
    "OutcomeEvent",
    "WorkloadAwareFreeQueue",
]

"""The block-event stream out of the engine.

The queue and the engine hooks produce events on the scheduler's thread; the
controller consumes them on its own thread.  The sink between them is bounded
and never blocks the producer: when it is full the event is dropped and
counted.  ``collections.deque.append``/``popleft`` are atomic under the GIL,
so one producer and one consumer need no lock.

Per-block events are emitted only for a hash-sampled subset of blocks (the
consumer sets the rate), so their volume stays proportional to what the
controller can use; per-class totals are counted for every block by the queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


class EventKind(IntEnum):
    FREED = 0
    REUSED = 1
    EVICTED = 2
    LOOKUP = 3
    FINISHED = 4


class FreedEvent(NamedTuple):
    """A sampled block is released by its last holder, with its features.

    ``tag`` and ``outcome`` describe the request that released it,
    ``position`` is the block's index in that prompt and ``reuse_count`` how
    many prefix hits it has had: what a class key may be built from.
    """

    kind: EventKind
    time: float
    block_hash: Any
    tag: str
    outcome: str | None
    position: int
    reuse_count: int


class BlockEvent(NamedTuple):
    """A free-list transition of one sampled block.

    ``REUSED``: a prefix hit took it off the free list after ``idle`` seconds.
    ``EVICTED``: it was reallocated after ``idle`` seconds; ``block_hash`` is
    the hash it held, for the controller's ghost table.
    """

    kind: EventKind
    time: float
    cls: int
    idle: float
    block_hash: Any


class LookupEvent(NamedTuple):
    """A request's prefix-cache lookup.

    ``hashes`` holds ``(position, hash)`` of the prompt blocks the consumer
    asked for (all, or the hash-sampled subset); ``hit_blocks`` counts the
    prefix hit among ``queried_blocks``.
    """

    kind: EventKind
    time: float
    request_id: str
    tag: str
    cls: int
    hit_blocks: int
    queried_blocks: int
    hashes: tuple[tuple[int, Any], ...]


class FinishedEvent(NamedTuple):
    """A request released its blocks; ``outcome`` is what its reply did, if known."""

    kind: EventKind
    time: float
    request_id: str
    tag: str
    outcome: str | None
    num_blocks: int


Event = FreedEvent | BlockEvent | LookupEvent | FinishedEvent


def hash_sample_value(block_hash: Any) -> int:
    """A stable 64-bit value of a block hash, for spatial sampling.

    vLLM block hashes are bytes (a SHA-256 digest followed by the group id);
    trace hash ids are integers.  Python's ``hash()`` is salted per process
    for bytes, so it is not used.
    """
    if isinstance(block_hash, (bytes, bytearray)):
        return int.from_bytes(block_hash[:8], "little")
    return ((hash(block_hash) & _MASK64) * _MIX) & _MASK64


@dataclass
class EventSink:
    """Bounded, lock-free, drop-when-full channel of engine events."""

    capacity: int = 1 << 16
    sample_rate: float = 1.0
    lookup_hashes: str = "sampled"  # "all", "sampled" or "none"
    emitted: int = 0
    dropped: int = 0
    _queue: deque = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.capacity, int) or self.capacity <= 0:
            raise ValueError(f"capacity must be a positive integer, got {self.capacity!r}")
        if not 0.0 < float(self.sample_rate) <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate!r}")
        if self.lookup_hashes not in ("all", "sampled", "none"):
            raise ValueError(f"lookup_hashes must be all, sampled or none, got {self.lookup_hashes!r}")
        self._threshold = int(float(self.sample_rate) * (1 << 64))

    @property
    def samples_all(self) -> bool:
        return self._threshold >= (1 << 64)

    def is_sampled(self, block_hash: Any) -> bool:
        return self._threshold >= (1 << 64) or hash_sample_value(block_hash) < self._threshold

    def emit(self, event: Event) -> bool:
        """Queue an event; never blocks.  Returns False if it was dropped."""
        q = self._queue
        if len(q) >= self.capacity:
            self.dropped += 1
            return False
        q.append(event)
        self.emitted += 1
        return True

    def drain(self, max_events: int | None = None) -> list[Event]:
        """Take up to ``max_events`` queued events (all when None), oldest first."""
        q = self._queue
        out: list[Event] = []
        n = len(q) if max_events is None else min(max_events, len(q))
        popleft = q.popleft
        for _ in range(n):
            try:
                out.append(popleft())
            except IndexError:
                break
        return out

    def __len__(self) -> int:
        return len(self._queue)

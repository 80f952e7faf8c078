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

import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np

_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_MIX_U64 = np.uint64(_MIX)
# hash(n) == n for integers in [0, modulus): a trace's block ids.
_HASH_IS_IDENTITY = sys.hash_info.modulus


_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_M1_U64, _M2_U64 = np.uint64(_M1), np.uint64(_M2)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def salted(value: int, salt: int) -> int:
    """A sample value under a sampling salt: splitmix64's finalizer of
    ``value`` XOR the salt (``value`` itself for salt 0).

    The finalizer is a bijection of 64-bit values, so a uniform value stays
    uniform (the sample keeps its size, and a nested sample, the values below
    a smaller threshold, stays nested), and it mixes every bit into the high
    ones that decide membership, so two salts draw nearly independent samples.
    """
    if not salt:
        return value
    z = value ^ salt
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def salted_array(values: np.ndarray, salt: int) -> np.ndarray:
    """:func:`salted` of a uint64 array, in one pass."""
    if not salt:
        return values
    z = values ^ np.uint64(salt)
    z = (z ^ (z >> _S30)) * _M1_U64
    z = (z ^ (z >> _S27)) * _M2_U64
    return z ^ (z >> _S31)


class EventKind(IntEnum):
    FREED = 0
    EVICTED = 1
    LOOKUP = 2
    FINISHED = 3
    OUTCOME = 4


class FreedEvent(NamedTuple):
    """A sampled block is released by its last holder.

    ``request`` is what the freeing request is filed under (its tag, outcome
    and turn timing, a ``RequestTags``, shared by the events of its blocks),
    ``position`` the block's index in the prompt and ``reuse_count`` its prefix
    hits so far: what a class key is built from.
    """

    kind: EventKind
    time: float
    block_hash: Any
    request: Any
    position: int
    reuse_count: int


class EvictedEvent(NamedTuple):
    """A sampled block was reallocated; ``block_hash`` is the hash it held (for the ghost table)."""

    kind: EventKind
    time: float
    block_hash: Any


class LookupEvent(NamedTuple):
    """A request's prefix-cache lookup.

    ``hashes``: the hash-sampled prompt blocks' hashes, in prompt order (reuse
    observations, and the miniature caches' prompt).  ``chain``: the hashes of
    every block from the conversation's own start, when the request's
    conversation is sampled for the miniature caches (chain sampling), else
    empty.  ``real_hits``: how many of ``hashes``, the first ones, the real
    cache had (its prefix hit): what the miniature caches' predictions are
    checked against (None: not reported).
    """

    kind: EventKind
    time: float
    request_id: str
    tag: str
    hashes: tuple[Any, ...]
    chain: tuple[Any, ...]
    real_hits: int | None = None


class FinishedEvent(NamedTuple):
    """A request released its blocks; ``request`` is what it was filed under (None: it held none)."""

    kind: EventKind
    time: float
    request_id: str
    request: Any


class OutcomeEvent(NamedTuple):
    """A late outcome (the API server saw a tool call) refiled a finished request.

    ``request`` is what the request is filed under now (its new outcome);
    ``freed_at`` the time of its FREED events and ``blocks`` their
    ``(position, block_hash, reuse_count)``: the sampled blocks whose
    observations move to the new class.
    """

    kind: EventKind
    time: float
    request: Any
    freed_at: float
    blocks: tuple[tuple[int, Any, int], ...]


Event = FreedEvent | EvictedEvent | LookupEvent | FinishedEvent | OutcomeEvent


def carried_hashes(event: Event) -> int:
    """How many block hashes an event carries in its sequences (a lookup's
    prompt and chain, an outcome's blocks): what its size grows with."""
    kind = event[0]
    if kind is _LOOKUP:
        return len(event[4]) + len(event[5])
    if kind is _OUTCOME:
        return len(event[4])
    return 0


_LOOKUP, _OUTCOME = EventKind.LOOKUP, EventKind.OUTCOME


def hash_sample_value(block_hash: Any) -> int:
    """A stable 64-bit value of a block hash, for spatial sampling.

    vLLM block hashes are bytes (a SHA-256 digest followed by the group id);
    trace hash ids are integers.  Python's ``hash()`` is salted per process
    for bytes, so it is not used.
    """
    if isinstance(block_hash, (bytes, bytearray)):
        return int.from_bytes(block_hash[:8], "little")
    return ((hash(block_hash) & _MASK64) * _MIX) & _MASK64


def trace_ids(block_hashes: Sequence[Any], start: int = 0) -> np.ndarray | None:
    """``block_hashes[start:]`` as an int64 array when they are all trace block
    ids (non-negative integers that hash to themselves), else None.

    vLLM's bytes digests, None and other hashables return None, to be hashed
    one by one.  A replay samples tens of millions of block ids: a call each
    costs ten times one numpy pass.
    """
    if start >= len(block_hashes) or type(block_hashes[start]) is not int:
        return None
    ids = np.asarray(block_hashes[start:] if start else block_hashes)
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= _HASH_IS_IDENTITY:
        return None
    return ids


@dataclass
class EventSink:
    """Bounded, lock-free, drop-when-full channel of engine events."""

    capacity: int = 1 << 16
    sample_rate: float = 1.0
    # Share of conversations whose whole chain goes to the miniature caches
    # (None: no chain sampling; they then use the hash-sampled blocks).
    chain_rate: float | None = None
    # Replays only: the id in the trace file of each trace block id (the
    # replay renumbers ids densely, see ``replay.trace.renumber_ids``).  A
    # trace id is sampled by the hash of its file id, so the sample does not
    # depend on how the replay numbers blocks.
    source_ids: np.ndarray | None = None
    # Which blocks and conversations are sampled: 0 is the default sample,
    # another value draws another sample of the same size (a replay measures
    # how much a result owes to the sample drawn).
    salt: int = 0
    # Block hashes that the queued lookup and outcome events may carry in
    # all (None: 8 per event slot).  A stalled consumer then holds at most
    # ``capacity`` events and this many hashes, however long the prompts.
    hash_capacity: int | None = None
    dropped: int = 0
    _queue: deque = field(default_factory=deque, repr=False)
    # Hashes carried by the events queued so far and by those drained: each
    # written by one thread (producer, consumer), so no lock.
    _hashes_in: int = field(default=0, repr=False)
    _hashes_out: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.capacity, int) or self.capacity <= 0:
            raise ValueError(f"capacity must be a positive integer, got {self.capacity!r}")
        if self.hash_capacity is None:
            self.hash_capacity = 8 * self.capacity
        if not isinstance(self.hash_capacity, int) or self.hash_capacity <= 0:
            raise ValueError(f"hash_capacity must be a positive integer, got {self.hash_capacity!r}")
        if not 0.0 < float(self.sample_rate) <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate!r}")
        self._threshold = int(float(self.sample_rate) * (1 << 64))
        self._samples_all = self._threshold >= (1 << 64)
        if self.chain_rate is not None and not 0.0 < float(self.chain_rate) <= 1.0:
            raise ValueError(f"chain_rate must be in (0, 1], got {self.chain_rate!r}")
        self._chain_threshold = -1 if self.chain_rate is None else int(float(self.chain_rate) * (1 << 64))
        if type(self.salt) is not int or not 0 <= self.salt < (1 << 64):
            raise ValueError(f"salt must be an integer in [0, 2**64), got {self.salt!r}")
        self._id_values: np.ndarray | None = None
        if self.source_ids is not None:
            src = np.asarray(self.source_ids)
            if src.ndim != 1 or src.dtype.kind not in "iu" or (src.size and src.min() < 0):
                raise ValueError("source_ids must be a 1-d array of non-negative integer ids")
            # sample_value of each file id, in one pass.
            self._id_values = salted_array((src % _HASH_IS_IDENTITY).astype(np.uint64) * _MIX_U64, self.salt)
        # What the per-hash paths call: the plain hash unless there is a table or a salt.
        plain = self._id_values is None and not self.salt
        self._value_of = hash_sample_value if plain else self.sample_value

    @property
    def samples_all(self) -> bool:
        return self._samples_all

    def sample_value(self, block_hash: Any) -> int:
        """The 64-bit value a block is sampled by: ``hash_sample_value`` of its
        hash, or for a renumbered trace id, of its id in the trace file
        (:func:`salted` by the sink's salt)."""
        values = self._id_values
        if values is not None and type(block_hash) is int:
            return int(values[block_hash])
        return salted(hash_sample_value(block_hash), self.salt)

    def is_sampled(self, block_hash: Any) -> bool:
        return self._samples_all or self._value_of(block_hash) < self._threshold

    def _trace_id_values(self, hashes: Sequence[Any], start: int = 0) -> np.ndarray | None:
        """``sample_value`` of ``hashes[start:]`` in one pass when they are trace ids, else None."""
        ids = trace_ids(hashes, start)
        if ids is None:
            return None
        if self._id_values is not None:
            return self._id_values[ids]
        return salted_array(ids.astype(np.uint64) * _MIX_U64, self.salt)

    def sampled_from(self, hashes: Sequence[Any], start: int) -> list[Any]:
        """The sampled ``hashes`` from ``start`` on, in order.

        One pass without a call per hash: a prompt's uncached blocks are
        thousands on long agentic prompts, and this runs at every lookup.
        """
        if self._samples_all:
            return list(hashes[start:])
        values = self._trace_id_values(hashes, start)
        if values is not None:
            return [hashes[start + i] for i in np.flatnonzero(values < self._threshold).tolist()]
        thr, value = self._threshold, self._value_of
        return [h for i in range(start, len(hashes)) if value(h := hashes[i]) < thr]

    def subsample(self, hashes: Sequence[Any], threshold: int) -> list[Any]:
        """The ``hashes`` whose sample value is below ``threshold`` (< 2**64): a
        nested sample, such as the miniature caches' within the watched one."""
        values = self._trace_id_values(hashes)
        if values is not None:
            return [hashes[i] for i in np.flatnonzero(values < threshold).tolist()]
        value = self._value_of
        return [h for h in hashes if value(h) < threshold]

    def sampled_ids(self, hashes: Sequence[Any]) -> np.ndarray | None:
        """Whether each of ``hashes`` is sampled (a bool array), when they are
        all trace ids (one numpy pass); None otherwise (then ``is_sampled`` each)."""
        values = None if self._samples_all else self._trace_id_values(hashes)
        return None if values is None else values < self._threshold

    def chain_sampled(self, conversation: int) -> bool:
        """Whether a conversation (a 64-bit key) is in the miniature caches' sample."""
        return conversation < self._chain_threshold

    def emit(self, event: Event) -> bool:
        """Queue an event; never blocks.  Returns False if it was dropped: the
        queue is full, or the event's hashes would take the queued ones past
        ``hash_capacity`` (one event alone is always taken)."""
        q = self._queue
        if len(q) >= self.capacity:
            self.dropped += 1
            return False
        kind = event[0]
        if (kind is _LOOKUP or kind is _OUTCOME) and (n := carried_hashes(event)):
            held = self._hashes_in - self._hashes_out
            if held and held + n > self.hash_capacity:
                self.dropped += 1
                return False
            self._hashes_in += n
        q.append(event)
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
        self._hashes_out += sum(map(carried_hashes, out))
        return out

    @property
    def queued_hashes(self) -> int:
        """Block hashes the queued events carry (what ``hash_capacity`` bounds)."""
        return self._hashes_in - self._hashes_out

    def __len__(self) -> int:
        return len(self._queue)

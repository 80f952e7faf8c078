"""Workload tags, class names, and the bounded registries that intern them.

Clients tag a request with ``type_info`` (PR #22236 format ``"<type>_<turn>"``,
e.g. ``text_1``).  Tags are untrusted input: they become class names,
Prometheus label values and dictionary keys, so they are validated and the
number of distinct names is capped.  Nothing here raises on bad input; the
caller counts it.

Two :class:`ClassRegistry` instances bound what a client can create: one of
tags (hit accounting and its metrics) and one of eviction classes (the
queue's per-class lists), each with its own cap.  A name unused for
``retire_after_s`` gives its slot back, so a burst of junk tags does not push
later workloads into ``other`` for ever.  The reserved names cannot be sent
by clients.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CLASS = "default"
INVALID_CLASS = "invalid"
OTHER_CLASS = "other"
RESERVED_CLASSES = (DEFAULT_CLASS, INVALID_CLASS, OTHER_CLASS)
DEFAULT_ID, INVALID_ID, OTHER_ID = range(3)  # their ids in every registry
# 16 workload tags x 2 outcomes under the default class key, plus the reserved
# names, with room to spare; the queue compares one head per class in use.
DEFAULT_MAX_CLASSES = 64
# The most a registry may be configured with: each slot costs the queue two
# sentinel blocks, counters and stamp groups at start-up (two million slots
# took 1.7 GiB), and a lookup-stamped rebuild allocates the groups again.
MAX_CLASS_CAP = 4096
MAX_TAG_LENGTH = 64
# A class name joins a tag and bucketed features (``agent_1.o:length.d2.r1``).
MAX_CLASS_NAME_LENGTH = 128
_NAME_RE = re.compile(r"[A-Za-z0-9_.:-]+")
# A tag leaves out ``.`` and ``:``, which join a class name's parts: a tag
# ``chat.o:stop`` would be named as the tag-and-outcome key names tag
# ``chat`` with outcome ``stop``, and the live queue, which holds every
# key's models, would score one with the other's.
_TAG_CHARS = "A-Za-z0-9_-"
_TAG_RE = re.compile(f"[{_TAG_CHARS}]+")
# A character a tag does not take (a trace's label is made into a tag with it).
NOT_IN_TAG = re.compile(f"[^{_TAG_CHARS}]")


@dataclass
class TagCounters:
    """Requests whose tag was missing, invalid, or past the tag registry's cap (each counted once)."""

    missing: int = 0
    invalid: int = 0
    over_cap: int = 0


def is_reserved(name: str) -> bool:
    """A reserved name, or one that would pass for a class of it (``default.o:stop``)."""
    return name.split(".", 1)[0] in RESERVED_CLASSES


def is_valid_tag(tag: Any) -> bool:
    """A client tag: a short string of ``[A-Za-z0-9_-]``, not a reserved name."""
    return (
        isinstance(tag, str)
        and 0 < len(tag) <= MAX_TAG_LENGTH
        and _TAG_RE.fullmatch(tag) is not None
        and not is_reserved(tag)
    )


def is_valid_class_name(name: Any) -> bool:
    """A class name as a class key makes them (reserved names included)."""
    return isinstance(name, str) and 0 < len(name) <= MAX_CLASS_NAME_LENGTH and _NAME_RE.fullmatch(name) is not None


def normalize_tag(tag: Any, counters: TagCounters | None = None) -> str:
    """Map a client tag to a safe name.

    ``None`` -> ``default``; anything that is not a valid tag (see
    :func:`is_valid_tag`) -> ``invalid``.
    """
    if tag is None:
        if counters is not None:
            counters.missing += 1
        return DEFAULT_CLASS
    if is_valid_tag(tag):
        return tag
    if counters is not None:
        counters.invalid += 1
    return INVALID_CLASS


@dataclass
class ClassRegistry:
    """Interns names as small integer ids, at most ``max_classes`` at a time.

    The reserved names hold ids 0-2 for ever; other names get the lowest
    free id when claimed and give it back when :meth:`retire_idle` finds them
    unused for ``retire_after_s``.  The queue and the tagger index their
    per-class arrays by id, so whoever retires a name clears its entries
    (:meth:`WorkloadAwareFreeQueue.retire_idle_classes`).

    :meth:`find` never interns (lookups, metrics); :meth:`claim` does and
    refreshes the name's last use.  One thread (the engine's) claims and
    retires; readers on other threads see whole updates.
    """

    max_classes: int = DEFAULT_MAX_CLASSES
    retire_after_s: float = math.inf
    _ids: dict[str, int] = field(default_factory=dict, repr=False)
    _names: list[str | None] = field(default_factory=list, repr=False)
    _last_used: list[float] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_classes, bool)
            or not isinstance(self.max_classes, int)
            or not len(RESERVED_CLASSES) <= self.max_classes <= MAX_CLASS_CAP
        ):
            raise ValueError(
                f"max_classes must be an integer in [{len(RESERVED_CLASSES)}, {MAX_CLASS_CAP}], got {self.max_classes!r}"
            )
        if not self.retire_after_s > 0:
            raise ValueError(f"retire_after_s must be positive, got {self.retire_after_s!r}")
        for name in RESERVED_CLASSES:
            self._ids[name] = len(self._names)
            self._names.append(name)
            self._last_used.append(-math.inf)

    def find(self, name: str) -> int | None:
        """The id of ``name`` if it holds one; never interns."""
        return self._ids.get(name)

    def claim(self, name: str, now: float = 0.0) -> int | None:
        """The id of ``name``, interned if needed; None when every slot is taken."""
        cid = self._ids.get(name)
        if cid is None:
            with self._lock:
                cid = self._ids.get(name)
                if cid is None:
                    cid = self._free_id()
                    if cid is None:
                        return None
                    self._names[cid] = name
                    self._ids[name] = cid
        if now > self._last_used[cid]:
            self._last_used[cid] = now
        return cid

    def _free_id(self) -> int | None:
        for cid, name in enumerate(self._names):
            if name is None:
                return cid
        if len(self._names) < self.max_classes:
            self._names.append(None)
            self._last_used.append(-math.inf)
            return len(self._names) - 1
        return None

    def id_of(self, name: str, now: float = 0.0) -> int:
        """:meth:`claim`, or the id of ``other`` when the registry is full."""
        cid = self.claim(name, now)
        return OTHER_ID if cid is None else cid

    def touch(self, cid: int, now: float) -> None:
        """``cid`` was used at ``now`` (keeps it from retiring)."""
        if now > self._last_used[cid]:
            self._last_used[cid] = now

    def retire_idle(self, now: float, unused_since: float = -math.inf) -> list[int]:
        """Free the ids of names unused since ``now - retire_after_s`` (or since
        ``unused_since``, if later); returns them."""
        cutoff = max(now - self.retire_after_s, unused_since)
        if cutoff == -math.inf:
            return []
        retired = []
        with self._lock:
            for cid in range(len(RESERVED_CLASSES), len(self._names)):
                name = self._names[cid]
                if name is not None and self._last_used[cid] < cutoff:
                    del self._ids[name]
                    self._names[cid] = None
                    self._last_used[cid] = -math.inf
                    retired.append(cid)
        return retired

    def name_of(self, cid: int) -> str:
        """The name holding ``cid`` (``default`` for a free id: its blocks are scored by the default)."""
        name = self._names[cid] if 0 <= cid < len(self._names) else None
        return DEFAULT_CLASS if name is None else name

    def is_used(self, cid: int) -> bool:
        """Whether ``cid`` holds a name that has been claimed (reserved ones included)."""
        return self._names[cid] is not None and self._last_used[cid] > -math.inf

    def used_ids(self) -> list[int]:
        return [cid for cid in range(len(self._names)) if self.is_used(cid)]

    def used_names(self) -> list[str]:
        return [self._names[cid] for cid in self.used_ids()]  # type: ignore[misc]

    @property
    def names(self) -> list[str]:
        """Every name holding an id (reserved ones included)."""
        return [n for n in self._names if n is not None]

    def __len__(self) -> int:
        return len(self._ids)

"""Workload tags and the bounded registry of eviction classes.

Clients tag a request with ``type_info`` (PR #22236 format ``"<type>_<turn>"``,
e.g. ``text_1``).  Tags are untrusted input: they become class names, Prometheus
label values and dictionary keys, so they are validated and the number of
distinct classes is capped.  Nothing here raises on bad input; it is counted.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CLASS = "default"
INVALID_CLASS = "invalid"
OTHER_CLASS = "other"
RESERVED_CLASSES = (DEFAULT_CLASS, INVALID_CLASS, OTHER_CLASS)
DEFAULT_MAX_CLASSES = 32
MAX_TAG_LENGTH = 64
_TAG_RE = re.compile(r"[A-Za-z0-9_.:-]+")


@dataclass
class TagCounters:
    """How many tags were missing, invalid, or past the class cap."""

    missing: int = 0
    invalid: int = 0
    overflow: int = 0


def is_valid_tag(tag: Any) -> bool:
    return (
        isinstance(tag, str)
        and 0 < len(tag) <= MAX_TAG_LENGTH
        and _TAG_RE.fullmatch(tag) is not None
    )


def normalize_tag(tag: Any, counters: TagCounters | None = None) -> str:
    """Map a client tag to a safe class-name component.

    ``None`` -> ``default``; anything that is not a short string of
    ``[A-Za-z0-9_.:-]`` -> ``invalid``.
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
    """Interns class names as small integer ids, at most ``max_classes`` of them.

    Ids are stable for the life of the registry; the queue indexes its per-class
    lists by them.  Past the cap, new names map to ``other``.
    """

    max_classes: int = DEFAULT_MAX_CLASSES
    counters: TagCounters = field(default_factory=TagCounters)
    _ids: dict[str, int] = field(default_factory=dict, repr=False)
    _names: list[str] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_classes, int) or self.max_classes < len(RESERVED_CLASSES):
            raise ValueError(
                f"max_classes must be an integer >= {len(RESERVED_CLASSES)}, got {self.max_classes!r}"
            )
        for name in RESERVED_CLASSES:
            self._intern(name)

    def _intern(self, name: str, *, capped: bool = False) -> int:
        with self._lock:
            cid = self._ids.get(name)
            if cid is None:
                if capped and len(self._names) >= self.max_classes:
                    self.counters.overflow += 1
                    return self._ids[OTHER_CLASS]
                cid = len(self._names)
                self._names.append(name)
                self._ids[name] = cid
            return cid

    def id_of(self, name: str) -> int:
        """The id of a (validated) class name, or of ``other`` past the cap."""
        cid = self._ids.get(name)
        if cid is not None:
            return cid
        return self._intern(name, capped=True)

    def name_of(self, cid: int) -> str:
        return self._names[cid]

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def __len__(self) -> int:
        return len(self._names)

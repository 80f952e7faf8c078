"""Class keys built from what the engine knows when a block is freed.

A block's features at that moment: the client's tag, the outcome of the
request that freed it (its reply called a tool, ended the turn, hit the
length limit), its depth in that prompt, how often it has been reused, and
the request's place in its conversation, derived by the engine from the
prefix chain (:mod:`vllm_wa.engine_patch.conversations`): the think time
before it, the reply's length, the prompt's growth since the previous turn
and the turn count.  A :class:`FeatureKey` joins the chosen features,
bucketed, into a bounded class name; it is the class-key function the block
tagger calls.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

FEATURES = ("tag", "outcome", "depth", "reuse", "think", "reply", "growth", "turn")
# Features that depend on the block, not only on its request.
BLOCK_FEATURES = ("depth", "reuse")
_PREFIX = {"tag": "", "outcome": "o:", "depth": "d", "reuse": "r", "think": "k", "reply": "y", "growth": "g", "turn": "n"}
DEFAULT_DEPTH_EDGES = (64, 512, 2048)  # blocks: shallow, mid, deep, very deep
DEFAULT_REUSE_EDGES = (1, 2, 4)  # reuse counts: 0, 1, 2-3, 4+
DEFAULT_THINK_EDGES = (30.0, 300.0, 1800.0)  # seconds: a tool, a quick reply, a person, a break
DEFAULT_REPLY_EDGES = (100, 500, 2000)  # generated tokens
DEFAULT_GROWTH_EDGES = (0.02, 0.1, 0.5)  # prompt growth relative to the previous turn
DEFAULT_TURN_EDGES = (2, 5, 20)  # turn 1, 2-4, 5-19, 20+
UNKNOWN = "u"  # a timing feature of a conversation's first turn (no previous turn)
FOLDED = "*"  # a feature the controller's finest classes do not distinguish
TIMING_FEATURES = ("think", "growth", "turn")  # may be UNKNOWN
# Names a key keeps for its raw buckets (tags and outcomes are bounded
# upstream; the cache is cleared, never grown, past this).
_MAX_CACHED_NAMES = 4096


def _bucket(edges: tuple, value: float | None) -> Any:
    return UNKNOWN if value is None else bisect_right(edges, value)


@dataclass(frozen=True)
class FeatureKey:
    """Class name from a subset of :data:`FEATURES` (a ``ClassKeyFunction``)."""

    features: tuple[str, ...] = ("tag", "outcome")
    depth_edges: tuple[int, ...] = DEFAULT_DEPTH_EDGES
    reuse_edges: tuple[int, ...] = DEFAULT_REUSE_EDGES
    think_edges: tuple[float, ...] = DEFAULT_THINK_EDGES
    reply_edges: tuple[int, ...] = DEFAULT_REPLY_EDGES
    growth_edges: tuple[float, ...] = DEFAULT_GROWTH_EDGES
    turn_edges: tuple[int, ...] = DEFAULT_TURN_EDGES

    def __post_init__(self) -> None:
        bad = [f for f in self.features if f not in FEATURES]
        if bad or len(set(self.features)) != len(self.features):
            raise ValueError(f"features must be distinct names from {FEATURES}, got {list(self.features)}")
        for name in ("depth_edges", "reuse_edges", "think_edges", "reply_edges", "growth_edges", "turn_edges"):
            edges = getattr(self, name)
            if list(edges) != sorted(set(edges)) or any(e <= 0 for e in edges):
                raise ValueError(f"{name} must be increasing positive numbers, got {list(edges)}")
        object.__setattr__(self, "_index", tuple(FEATURES.index(f) for f in self.features))
        # Computed once: the tagger asks at every release, and a key is called per request.
        object.__setattr__(self, "uses_block_features", any(f in BLOCK_FEATURES for f in self.features))
        object.__setattr__(self, "_used", tuple(f in self.features for f in FEATURES))
        object.__setattr__(self, "_uses_timing", any(f in TIMING_FEATURES for f in self.features))
        object.__setattr__(self, "_names", {})

    def edges(self, feature: str) -> tuple:
        """Bucket edges of a bucketed feature (not ``tag`` or ``outcome``)."""
        return getattr(self, f"{feature}_edges")

    @property
    def name(self) -> str:
        return "+".join(self.features) if self.features else "none"

    def components(self, request: Any, position: int, reuse_count: int) -> tuple[Any, ...]:
        """Every feature, bucketed (the finest class), in :data:`FEATURES` order.

        ``request`` is a ``RequestTags``: tag, outcome, reply tokens and the
        turn timing the tagger found at its lookup (None: unknown).
        """
        timing = request.timing
        return (
            request.tag,
            request.outcome or "unknown",
            bisect_right(self.depth_edges, position),
            bisect_right(self.reuse_edges, reuse_count),
            _bucket(self.think_edges, timing.think_s if timing is not None else None),
            bisect_right(self.reply_edges, request.reply_tokens),
            _bucket(self.growth_edges, timing.growth if timing is not None else None),
            _bucket(self.turn_edges, timing.turn if timing is not None else None),
        )

    def name_of(self, comps: tuple[Any, ...]) -> str:
        """Class name of a finest-class tuple under this key's features.

        The tag stands alone (so the tag-only key gives PR-compatible names);
        other features carry a prefix, so names of different keys never
        collide (``tool`` the tag vs ``o:tool`` the outcome).  A key without
        the tag whose name would still read as a tag (one block or timing
        feature, ``r0``, or none, ``all``) gets a leading ``:``, which no
        tag holds: the live queue holds every key's models at once, and a
        tag ``r0`` must not be scored by the reuse key's model.
        """
        parts = [_PREFIX[FEATURES[i]] + str(comps[i]) for i in self._index]
        name = ".".join(parts) if parts else "all"
        if not self._used[0] and "." not in name and ":" not in name:
            name = ":" + name
        return name

    def __call__(self, request: Any, position: int, reuse_count: int) -> str:
        """``name_of(components(...))``, computing only this key's features
        (it runs on the engine thread at every release, and per block for a
        key with block features).

        The used features' raw buckets look the name up in a bounded cache:
        building it (a string per feature, then a join) cost twice as much
        as the buckets themselves for the six request features.
        """
        tag, outcome, depth, reuse, think, reply, growth, turn = self._used
        t = request.timing if self._uses_timing else None
        raw = (
            request.tag if tag else None,
            request.outcome if outcome else None,
            bisect_right(self.depth_edges, position) if depth else None,
            bisect_right(self.reuse_edges, reuse_count) if reuse else None,
            _bucket(self.think_edges, None if t is None else t.think_s) if think else None,
            bisect_right(self.reply_edges, request.reply_tokens) if reply else None,
            _bucket(self.growth_edges, None if t is None else t.growth) if growth else None,
            _bucket(self.turn_edges, None if t is None else t.turn) if turn else None,
        )
        names = self._names
        name = names.get(raw)
        if name is None:
            name = self.name_of((raw[0], raw[1] or "unknown", *raw[2:]))
            if len(names) >= _MAX_CACHED_NAMES:
                names.clear()
            names[raw] = name
        return name


FINEST = FeatureKey(FEATURES)

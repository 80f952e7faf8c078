"""Class keys built from per-block features.

A block's features at the moment it is freed: the client's tag, the outcome
of the request that freed it (its reply called a tool, ended the turn, hit
the length limit), its depth in that prompt and how often it has been reused.
A :class:`FeatureKey` joins the chosen features, bucketed, into a bounded
class name; it is the class-key function the block tagger calls.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

FEATURES = ("tag", "outcome", "depth", "reuse")
_PREFIX = {"tag": "", "outcome": "o:", "depth": "d", "reuse": "r"}
DEFAULT_DEPTH_EDGES = (64, 512, 2048)  # blocks: shallow, mid, deep, very deep
DEFAULT_REUSE_EDGES = (1, 2, 4)  # reuse counts: 0, 1, 2-3, 4+


@dataclass(frozen=True)
class FeatureKey:
    """Class name from a subset of :data:`FEATURES` (a ``ClassKeyFunction``)."""

    features: tuple[str, ...] = ("tag", "outcome")
    depth_edges: tuple[int, ...] = DEFAULT_DEPTH_EDGES
    reuse_edges: tuple[int, ...] = DEFAULT_REUSE_EDGES

    def __post_init__(self) -> None:
        bad = [f for f in self.features if f not in FEATURES]
        if bad or len(set(self.features)) != len(self.features):
            raise ValueError(f"features must be distinct names from {FEATURES}, got {list(self.features)}")
        for name, edges in (("depth_edges", self.depth_edges), ("reuse_edges", self.reuse_edges)):
            if list(edges) != sorted(set(edges)) or any(e <= 0 for e in edges):
                raise ValueError(f"{name} must be increasing positive integers, got {list(edges)}")

    @property
    def uses_block_features(self) -> bool:
        return "depth" in self.features or "reuse" in self.features

    @property
    def name(self) -> str:
        return "+".join(self.features) if self.features else "none"

    def components(self, tag: str, outcome: str | None, position: int, reuse_count: int) -> tuple[Any, ...]:
        """All four bucketed features (the finest class), in :data:`FEATURES` order."""
        return (
            tag,
            outcome or "unknown",
            bisect_right(self.depth_edges, position),
            bisect_right(self.reuse_edges, reuse_count),
        )

    def name_of(self, comps: tuple[Any, ...]) -> str:
        """Class name of a finest-class tuple under this key's features.

        The tag stands alone (so the tag-only key gives PR-compatible names);
        other features carry a prefix, so names of different keys never
        collide (``tool`` the tag vs ``o:tool`` the outcome).
        """
        parts = []
        for f in self.features:
            v = comps[FEATURES.index(f)]
            parts.append(_PREFIX[f] + str(v))
        return ".".join(parts) if parts else "all"

    def __call__(self, request: Any, position: int, reuse_count: int) -> str:
        return self.name_of(self.components(request.tag, request.outcome, position, reuse_count))


FINEST = FeatureKey(FEATURES)

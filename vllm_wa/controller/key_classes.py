"""One class key's view of the controller's finest classes.

The controller keeps its observations once, per finest class (every
feature some candidate's key uses); a candidate's key pools them into its
own classes.  :class:`KeyClasses` is that mapping for one key, extended as
finest classes appear, with the key's own count of lookups that found
reuses per class: pooling finest classes would count one lookup once in
each class it spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_wa.controller.features import FeatureKey


@dataclass
class KeyClasses:
    """``key``'s classes over the finest classes ``fine`` (see :meth:`extend`)."""

    key: FeatureKey
    # Class names, in order of their first finest class.
    names: list[str] = field(default_factory=list)
    # Each name's index in ``names``.
    index: dict[str, int] = field(default_factory=dict)
    # Each finest class's index in ``names``.
    labels: list[int] = field(default_factory=list)
    # Per class: lookups that found reuses in it (forgotten as the observations are).
    lookups: list[float] = field(default_factory=list)

    def extend(self, fine: Sequence[tuple]) -> np.ndarray:
        """Label the finest classes added since the last call; every label, as an array."""
        names, index, labels, lookups = self.names, self.index, self.labels, self.lookups
        for comps in fine[len(labels):]:
            name = self.key.name_of(comps)
            i = index.get(name)
            if i is None:
                i = index[name] = len(names)
                names.append(name)
                lookups.append(0.0)
            labels.append(i)
        return np.array(labels, dtype=np.intp)

    def rows(self, i: int) -> np.ndarray:
        """The finest classes (bank rows) of class ``i``, as labelled so far."""
        return np.flatnonzero(np.asarray(self.labels, dtype=np.intp) == i)

    def rows_of(self, name: str) -> np.ndarray | None:
        """The finest classes of the class called ``name``; None if the key has no such class."""
        i = self.index.get(name)
        return None if i is None else self.rows(i)

    def decay(self, factor: float) -> None:
        """Forget the lookup counts as the observations are forgotten."""
        self.lookups[:] = [g * factor for g in self.lookups]

    def relabel(self, fine: Sequence[tuple]) -> None:
        """Label ``fine`` afresh (the table was renumbered), keeping each class's lookups by name."""
        kept = dict(zip(self.names, self.lookups))
        self.names, self.index, self.labels, self.lookups = [], {}, [], []
        self.extend(fine)
        self.lookups[:] = [kept.get(name, 0.0) for name in self.names]

"""The one settable clock: replays, miniature caches and tests set the time."""

from __future__ import annotations


class SettableClock:
    """Seconds as last set; queues and controllers call it like ``time.monotonic``."""

    __slots__ = ("t",)

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t

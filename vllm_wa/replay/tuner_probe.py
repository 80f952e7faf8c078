"""``wa-online`` with a tap on its tuner: what it is fed, and when it decides.

Benchmarks that study the tuner (``tuner_paths.py`` records its paired
miniature-cache hits, ``shadow_fidelity.py`` sums them into predictions)
need the evidence exactly as the tuner sees it: one ``Tuner.record`` call
per sampled request, with its sampled blocks and every candidate's hit
blocks.  This is the one place that taps it; the replay itself runs
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_wa.controller.calibration import CheckedRequest
from vllm_wa.controller.tuner import Switch, Tuner
from vllm_wa.replay.online_policy import OnlineWAPolicy


@dataclass
class TunerProbePolicy(OnlineWAPolicy):
    """Calls :meth:`on_record` after every ``Tuner.record`` and
    :meth:`on_decide` before every ``Tuner.decide`` of its controller's tuner.

    The tap is installed at the first ``advance`` after the controller
    exists (the replay creates it with the cache), once.
    """

    _tapped: bool = field(default=False, repr=False)

    def on_tap(self, tuner: Tuner) -> None:
        """Called once, when the tap goes in (the candidates are known)."""

    def on_record(self, t: float, lookups: int, hits: list[int], real: int | None) -> None:
        """One sampled request: its sampled blocks, each candidate's hit blocks
        and the real cache's (None: not known)."""

    def on_decide(self, t: float) -> None:
        """The tuner is about to decide at ``t``."""

    def advance(self, now: float) -> None:
        if not self._tapped and self.controller is not None:
            self._tap(self.controller.tuner)
        super().advance(now)

    def _tap(self, tuner: Tuner) -> None:
        record, decide = tuner.record, tuner.decide

        def record_tapped(t: float, lookups: int, hits: list[int], real: int | None = None) -> CheckedRequest | None:
            checked = record(t, lookups, hits, real)
            self.on_record(t, lookups, hits, real)
            return checked  # the controller takes it back if the real cache refuses the request

        def decide_tapped(t: float) -> Switch | None:
            self.on_decide(t)
            return decide(t)

        tuner.record, tuner.decide = record_tapped, decide_tapped  # type: ignore[method-assign]
        self.on_tap(tuner)
        self._tapped = True

    def flush(self) -> None:
        """Feed the miniature caches the lookups queued since the last refit.

        A replay ends between refits: without this, the sampled requests of
        its last refit interval never reach the tuner's evidence (on Mooncake's
        synthetic trace at 5 %, whose reuse climbs to 96 % at the end, the
        last 5 s held 572 sampled lookups, 550 of them LRU hits: LRU's recorded
        rate over the evaluation half read 12.46 % instead of 13.11 %).
        """
        c = self.controller
        if c is not None:
            c.process(c.sink.drain())

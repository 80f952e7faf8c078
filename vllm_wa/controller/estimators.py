"""Per-class reuse estimators, river-style (``update`` / ``get``).

Each finest class (tag x outcome x depth bucket x reuse bucket) keeps binned,
exponentially forgotten censored observations (:class:`SurvivalData`).  A
river ``ADWIN`` detector watches the log reuse gaps; when it fires the class's
memory is shortened, so a shift in traffic is forgotten in minutes instead of
the configured memory.  A river ``EWMean`` of the log gap and ``Count`` of
observations are kept for reporting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from river import drift, stats

from vllm_wa.controller.survival import SurvivalData, fit_exponential, fit_hyperexponential
from vllm_wa.params import ReuseModel


@dataclass
class ReuseEstimator:
    """Reuse statistics of one class, with forgetting and drift detection."""

    memory_s: float = 1800.0
    drift_delta: float = 0.002
    drift_forget: float = 0.25
    data: SurvivalData = field(default_factory=SurvivalData)
    drifts: int = 0

    def __post_init__(self) -> None:
        self._adwin = drift.ADWIN(delta=self.drift_delta)
        self._log_gap = stats.EWMean(fading_factor=0.02)
        self._observed = stats.Count()

    def update(self, gap: float | None = None, exposure: float | None = None) -> bool:
        """One observation: a reuse after ``gap`` s, or none after ``exposure`` s.

        Returns True when the drift detector fired (memory was shortened).
        """
        self._observed.update()
        if gap is not None:
            self.data.add_event(gap)
            lg = math.log1p(max(0.0, gap))
            self._log_gap.update(lg)
            self._adwin.update(lg)
            if self._adwin.drift_detected:
                self.drifts += 1
                self.data.decay(self.drift_forget)
                return True
        elif exposure is not None:
            self.data.add_censored(exposure)
        return False

    def forget(self, elapsed_s: float) -> None:
        """Age the statistics by ``elapsed_s`` seconds of the configured memory."""
        if elapsed_s > 0:
            self.data.decay(math.exp(-elapsed_s / self.memory_s))

    def get(self, family: str = "hyperexponential") -> ReuseModel | None:
        return fit_model(self.data, family)

    @property
    def typical_gap_s(self) -> float | None:
        v = self._log_gap.get()
        return math.expm1(v) if self._observed.get() and v else None

    @property
    def observations(self) -> int:
        return int(self._observed.get())


@dataclass
class FitState:
    """Warm start for the next fit of one class (the data moves slowly between refits)."""

    exponential: tuple[float, float] | None = None
    hyper: np.ndarray | None = None


def fit_model(data: SurvivalData, family: str, state: FitState | None = None) -> ReuseModel | None:
    """The class's reuse model under ``family``; None without any reuse seen."""
    if family == "exponential":
        p, a = fit_exponential(data, init=state.exponential if state else None)
        if p <= 0 or a <= 0 or not (math.isfinite(p) and math.isfinite(a)):
            return None
        if state is not None:
            state.exponential = (p, a)
        return ReuseModel.exponential(min(1.0, p), a)
    if family == "hyperexponential":
        model, w = fit_hyperexponential(data, init=state.hyper if state else None)
        if state is not None and w is not None:
            state.hyper = w
        return model
    raise ValueError(f"unknown model family {family!r}")

"""Censored reuse-gap data and the maximum-likelihood fits of the reuse models.

A freed block either comes back after some gap (an *event*) or we stop
watching it before it does (*censored* at its exposure time): in a finite
cache most blocks are evicted before they would be reused, so fitting only
the observed gaps (``1 / mean(gap)``) overstates the reuse rate.  Both kinds
of observation are kept as exponentially forgotten counts in log-spaced gap
bins, and the models are fitted by EM on the bins:

* ``fit_exponential``: the PR's model, reused with probability ``p`` after an
  ``Exp(a)`` delay, else never.
* ``fit_hyperexponential``: weights of a mixture of exponentials on a fixed
  grid of rates plus a "never" mass: a censoring-aware, nonparametric-ish
  survival curve that follows heavy tails.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.stats import chi2

from vllm_wa.params import ReuseModel

# Gap bins: [0, 0.05 s), then log-spaced up to ~2.3 days, then overflow.
GAP_EDGES = np.concatenate(([0.0], np.geomspace(0.05, 2.0e5, 97)))
_MIDS = np.concatenate(([0.025], np.sqrt(GAP_EDGES[1:-1] * GAP_EDGES[2:]), [GAP_EDGES[-1] * 1.5]))
NUM_BINS = len(_MIDS)
# Time scales (seconds) of the hyperexponential's components.
HYPER_SCALES = np.geomspace(1.0, 3.0e4, 10)
# EM steps taken between convergence tests (see _em_weights).
_EM_CHUNK = 16


_EDGE_LIST = GAP_EDGES.tolist()
_HYPER_RATES = 1.0 / HYPER_SCALES
# Likelihood of one observation per bin under each component, the never mass
# last: a reuse's density (never: 0), a censored exposure's survival (never: 1).
_E_LIK = np.hstack((_HYPER_RATES[None, :] * np.exp(-np.outer(_MIDS, _HYPER_RATES)), np.zeros((NUM_BINS, 1))))
_C_LIK = np.hstack((np.exp(-np.outer(_MIDS, _HYPER_RATES)), np.ones((NUM_BINS, 1))))


def gap_bin(gap: float) -> int:
    if gap < _EDGE_LIST[1]:
        return 0
    return min(NUM_BINS - 1, bisect_right(_EDGE_LIST, gap) - 1)


def bin_exposures(exposures: np.ndarray) -> np.ndarray:
    """Bin indices of many gaps or exposures at once."""
    idx = np.searchsorted(GAP_EDGES, np.maximum(exposures, 0.0), side="right") - 1
    return np.clip(idx, 0, NUM_BINS - 1)


@dataclass
class SurvivalData:
    """Binned counts of reuse events and censored exposures of one class.

    ``groups`` counts the prompt lookups that brought the events back: the
    blocks of one prompt are freed and reused together, so a lookup, not a
    block, is one independent observation (see :func:`separates`).
    """

    events: np.ndarray = field(default_factory=lambda: np.zeros(NUM_BINS))
    censored: np.ndarray = field(default_factory=lambda: np.zeros(NUM_BINS))
    groups: float = 0.0

    def add_event(self, gap: float, weight: float = 1.0) -> None:
        if not math.isnan(gap):  # a gap that is not a number is no observation (max() would bin it as 0)
            self.events[gap_bin(max(0.0, gap))] += weight

    def add_censored(self, exposure: float, weight: float = 1.0) -> None:
        if not math.isnan(exposure):
            self.censored[gap_bin(max(0.0, exposure))] += weight

    def decay(self, factor: float) -> None:
        self.events *= factor
        self.censored *= factor
        self.groups *= factor

    def __iadd__(self, other: SurvivalData) -> SurvivalData:
        self.events += other.events
        self.censored += other.censored
        self.groups += other.groups
        return self

    def copy(self) -> SurvivalData:
        return SurvivalData(self.events.copy(), self.censored.copy(), self.groups)

    @property
    def n_events(self) -> float:
        return float(self.events.sum())

    @property
    def n(self) -> float:
        return float(self.events.sum() + self.censored.sum())

    def state(self) -> dict[str, Any]:
        return {"events": self.events.tolist(), "censored": self.censored.tolist(), "groups": self.groups}


def fit_exponential(
    data: SurvivalData, iters: int = 200, tol: float = 1e-7, init: tuple[float, float] | None = None
) -> tuple[float, float]:
    """MLE of ``(p, a)`` under censoring, by EM; ``(0, 0)`` without events.

    ``init`` warm-starts EM from the previous fit (the controller refits every
    few seconds on slowly changing data).
    """
    p, a, _ = exponential_em(data, iters, tol, init)
    return p, a


def exponential_em(
    data: SurvivalData, iters: int = 200, tol: float = 1e-7, init: tuple[float, float] | None = None
) -> tuple[float, float, bool]:
    """:func:`fit_exponential`, and whether EM converged within ``iters`` steps.

    Under heavy censoring EM creeps: 20 reuses at 300 s beside 2,000 watches
    cut at 5 s read p = 0.648 after 200 steps, against the maximum-likelihood
    p = 1 (about 2,000 steps).  A caller continues from the answer.
    """
    ev, ce = data.events, data.censored
    n_e = float(ev.sum())
    n_c = float(ce.sum())
    if n_e <= 0:
        return 0.0, 0.0, True
    rows = np.flatnonzero(ce)
    ce_r, x_c = ce[rows], _MIDS[rows]
    g = float(ev @ _MIDS)
    if init is not None and 0 < init[0] <= 1 and init[1] > 0:
        p, a = init
    else:
        a = n_e / max(g, 1e-9)
        p = n_e / (n_e + n_c)
    done = False
    for _ in range(iters):
        surv = p * np.exp(-a * x_c)
        q = surv / np.maximum(1.0 - p + surv, 1e-300)  # P(a reuser | censored at x)
        cq = ce_r * q
        reusers = n_e + float(cq.sum())
        p_new = min(1.0, reusers / (n_e + n_c))
        a_new = reusers / max(g + float(cq @ (x_c + 1.0 / a)), 1e-9)
        done = abs(p_new - p) < tol and abs(a_new - a) < tol * max(a, 1e-12)
        p, a = p_new, a_new
        if done:
            break
    return min(1.0, p), a, done


def _em_weights(lik: np.ndarray, share: np.ndarray, w: np.ndarray, iters: int, tol: float) -> tuple[np.ndarray, bool]:
    """EM steps ``w <- w * ((share / (lik @ w)) @ lik)`` until no weight moves
    by ``tol``; the weights and whether that happened within ``iters`` steps.

    A fit takes about 140 steps of two small products, so each step's numpy
    calls are most of its cost: the steps of a chunk write into a history
    without testing, into preallocated buffers, and one vectorised test per
    chunk finds the first step that converged. The steps past it are wasted
    (at most a chunk), and the result is exactly the step-by-step loop's.
    """
    dot, maximum, divide, multiply = np.dot, np.maximum, np.divide, np.multiply
    a = np.empty(lik.shape[0])
    g = np.empty(lik.shape[1])
    hist = np.empty((_EM_CHUNK + 1, lik.shape[1]))
    hist[0] = w
    done = 0
    while done < iters:
        steps = min(_EM_CHUNK, iters - done)
        for i in range(steps):
            dot(lik, hist[i], out=a)
            maximum(a, 1e-300, out=a)
            divide(share, a, out=a)
            dot(a, lik, out=g)
            multiply(hist[i], g, out=hist[i + 1])
        converged = np.abs(hist[1 : steps + 1] - hist[:steps]).max(axis=1) < tol
        if converged.any():
            return hist[int(converged.argmax()) + 1].copy(), True
        done += steps
        hist[0] = hist[steps]
    return hist[0].copy(), False


def fit_hyperexponential(
    data: SurvivalData, iters: int = 400, tol: float = 1e-6, init: np.ndarray | None = None
) -> tuple[ReuseModel | None, np.ndarray | None]:
    """Weights of Exp(1/scale) components (:data:`HYPER_SCALES`) plus a never
    mass, by EM on the occupied bins; the model is None without events.

    Returns the model and the full weight vector (never mass last), which
    warm-starts the next fit as ``init``.
    """
    model, w, _ = hyperexponential_em(data, iters, tol, init)
    return model, w


def hyperexponential_em(
    data: SurvivalData, iters: int = 400, tol: float = 1e-6, init: np.ndarray | None = None
) -> tuple[ReuseModel | None, np.ndarray | None, bool]:
    """:func:`fit_hyperexponential`, and whether EM converged within ``iters`` steps."""
    ev, ce = data.events, data.censored
    n = float(ev.sum() + ce.sum())
    if ev.sum() <= 0 or n <= 0:
        return None, None, True
    k = len(_HYPER_RATES)
    re, rc = np.flatnonzero(ev), np.flatnonzero(ce)
    # Events and censored exposures as one set of occupied bins: one product
    # per EM step (the steps are most of the time a refit spends fitting).
    lik = np.vstack((_E_LIK[re], _C_LIK[rc]))
    share = np.concatenate((ev[re], ce[rc])) / n
    if init is not None and init.shape == (k + 1,) and np.isfinite(init).all() and init.min() > 0:
        w = init
    else:
        w = np.full(k + 1, 1.0 / (k + 1))
    w, converged = _em_weights(lik, share, w, iters, tol)
    keep = w[:k] > 1e-6
    if not keep.any():
        return None, None, converged
    ws = w[:k][keep]
    total = float(ws.sum())
    if total > 1.0:
        ws = ws / total
    model = ReuseModel(tuple(float(v) for v in ws), tuple(float(r) for r in _HYPER_RATES[keep]))
    return model, np.maximum(w, 1e-12), converged


def naive_exponential(data: SurvivalData, freed: float) -> tuple[float, float]:
    """What ignoring censoring gives: ``p = reuses / frees``, ``a = 1 / mean(observed gap)``."""
    n_e = float(data.events.sum())
    if n_e <= 0 or freed <= 0:
        return 0.0, 0.0
    return min(1.0, n_e / freed), n_e / max(float((data.events * _MIDS).sum()), 1e-9)


def reuse_within(data: SurvivalData, horizon_s: float) -> float:
    """Kaplan-Meier estimate of P(reused within ``horizon_s``) from the binned data.

    Censored observations leave the risk set at their bin; a bin's events and
    censorings are treated as events first (the usual tie convention).  No
    model is fitted, so it is cheap enough to rank hundreds of cells.
    """
    last = gap_bin(max(0.0, horizon_s))
    ev, ce = data.events[: last + 1], data.censored[: last + 1]
    at_risk = data.n - np.concatenate(([0.0], np.cumsum(ev + ce)[:-1]))
    with np.errstate(divide="ignore", invalid="ignore"):
        hazard = np.where(at_risk > 0, ev / at_risk, 0.0)
    return float(1.0 - np.prod(1.0 - np.clip(hazard, 0.0, 1.0)))


def log_likelihood(model: ReuseModel, data: SurvivalData) -> float:
    """Log-likelihood of the binned observations under ``model`` (up to the
    bin widths, which cancel in a likelihood ratio)."""
    w = np.asarray(model.weights)
    r = np.asarray(model.rates)
    ev, ce = np.flatnonzero(data.events), np.flatnonzero(data.censored)
    dens = np.exp(-np.outer(_MIDS[ev], r)) @ (w * r)
    surv = (1.0 - model.p) + np.exp(-np.outer(_MIDS[ce], r)) @ w
    return float(
        data.events[ev] @ np.log(np.maximum(dens, 1e-300)) + data.censored[ce] @ np.log(np.maximum(surv, 1e-300))
    )


def free_parameters(family: str) -> int:
    """Free parameters of a fit of ``family`` (the hyperexponential's weights
    and never mass sum to one)."""
    return 2 if family == "exponential" else len(HYPER_SCALES)


def separation_threshold(confidence: float, family: str) -> float:
    """The likelihood-ratio statistic :func:`separates` needs (0: no test)."""
    return float(chi2.ppf(confidence, free_parameters(family))) if confidence > 0 else 0.0


def separates(own: ReuseModel, pooled_model: ReuseModel, data: SurvivalData, threshold: float) -> bool:
    """Do a class's observations reject the pooled model in favour of its own fit?

    A likelihood-ratio test, with the statistic scaled by lookups per reused
    block: a prompt's blocks come back (or not) together, so counting each
    block as independent would make any two classes look different. Classes
    that fail the test are scored by the pooled model, which keeps their
    blocks in LRU order among themselves; two noisy fits of the same law
    would instead put one class's fresh blocks behind the other's stale ones.
    """
    if threshold <= 0:
        return True
    stat = 2.0 * (log_likelihood(own, data) - log_likelihood(pooled_model, data))
    n_events = data.n_events
    if data.groups > 0 and n_events > 0:
        stat *= min(1.0, data.groups / n_events)
    return stat > threshold

"""Immutable, versioned parameters of the workload-aware eviction policy.

A class's reuse model is a mixture of exponentials: with probability ``w_k``
a free block is reused after an ``Exp(a_k)`` delay, and with probability
``1 - sum(w)`` never.  One component is the model of vLLM PR #22236 and of the
"KVCache Cache in the Wild" paper (``p`` = reuse probability, ``a`` = reuse
rate); several components fit the heavy-tailed gaps of real traffic.

The queue ranks a free block that has been idle for ``D`` seconds by

* ``pr``:        ``S(D) - S(D + L)``, the PR's score, the unconditional
                 probability that the block is reused in the next ``L`` s;
* ``posterior``: ``(S(D) - S(D + L)) / S(D)``, the same probability given that
                 the block has not been reused for ``D`` seconds,
* ``density``:   ``(S(D) - S(D + L)) / integral_0^L S(D + t) dt``, the hit
                 density of LHD (Beckmann et al., NSDI '18): the chance of a
                 reuse within ``L`` per second of cache space the block holds
                 until then,
* ``ttl``:       ``(tau - D) / L``, a time-to-live per class: ``tau`` maximizes
                 ``F(tau) - tau / L``, the chance of a reuse within ``tau``
                 less the cost of holding the block that long, with ``L`` the
                 break-even hold time (Continuum's rule, arXiv 2511.02230,
                 applied to every class's fitted delay law ``F = 1 - S``
                 instead of tool calls alone).  Blocks are evicted in order of
                 ``stamp + tau``: LRU with each class's block kept ``tau``
                 seconds longer; a class with ``tau = 0`` is plain LRU,

where ``S`` is the survival function of the reuse delay.  All four are
non-increasing in ``D`` for any mixture of exponentials, so within one class an
older block never outranks a newer one and the queue may keep one FIFO list per
class and compare only the list heads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from vllm_wa.fileio import read_bytes
from vllm_wa.validation import check_number, short_repr
from vllm_wa.workload_classes import MAX_CLASS_NAME_LENGTH, is_valid_class_name

SCORE_MODES = ("pr", "posterior", "density", "ttl")
# What a free block's idle time counts from: its release ("free", vLLM's
# LRU) or the prefix lookup of the request that released it ("lookup").
STAMPS = ("free", "lookup")
# Keys of the PR JSON format, with this project's extensions (see to_pr_json).
_PR_JSON_KEYS = frozenset({"a", "p", "L", "mode", "mixture", "default", "version", "stamp"})
DEFAULT_HORIZON_S = 5.0
# Parameter versions fit a signed 64-bit integer: vLLM's msgpack channel
# between engine and API server carries nothing larger.
MAX_VERSION = 2**63 - 1
# Components of one reuse model: a fitted mixture has at most 10 (plus the
# never-reused mass); every free-list head's score sums over them on the
# engine thread, so a pin or a file cannot make one class cost more.
MAX_MIXTURE_COMPONENTS = 16
_NEG_INF = float("-inf")
# Upper bound of the idle-time search when inverting a score (about 30 years).
_MAX_IDLE_S = 1e9


class ParamsError(ValueError):
    """Raised for parameters that must not reach the queue."""


def _check_number(name: str, value: Any, *, hi: float = math.inf) -> float:
    """A finite number in ``[0, hi]``, or ``ParamsError`` naming it."""
    return check_number(name, value, ge=0.0, le=hi, error=ParamsError)


def _logsumexp(terms: list[float]) -> float:
    m = max(terms)
    if m == _NEG_INF:
        return _NEG_INF
    # A list, not a generator: the queue's run search calls this millions of times a replay.
    return m + math.log(math.fsum([math.exp(t - m) for t in terms]))


@dataclass(frozen=True)
class ReuseModel:
    """Reuse-delay model of one workload class (a mixture of exponentials)."""

    weights: tuple[float, ...]
    rates: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.weights) != len(self.rates) or not self.weights:
            raise ParamsError("a reuse model needs as many weights as rates, at least one")
        if len(self.weights) > MAX_MIXTURE_COMPONENTS:
            raise ParamsError(f"a reuse model has at most {MAX_MIXTURE_COMPONENTS} components, got {len(self.weights)}")
        # Stored as floats, whatever numbers came in (see WAParams.horizon).
        object.__setattr__(self, "weights", tuple(_check_number("reuse probability", w, hi=1.0) for w in self.weights))
        object.__setattr__(self, "rates", tuple(_check_number("reuse rate", a) for a in self.rates))
        total = math.fsum(self.weights)
        if total > 1.0 + 1e-9:
            raise ParamsError(f"reuse probabilities sum to {total} > 1")

    @classmethod
    def exponential(cls, p: float, a: float) -> ReuseModel:
        """The PR's model: reused with probability ``p`` after an Exp(``a``) delay."""
        return cls((float(_check_number("p", p, hi=1.0)),), (float(_check_number("a", a)),))

    @property
    def p(self) -> float:
        """Probability that a block is reused at all."""
        return min(1.0, math.fsum(self.weights))

    @property
    def a(self) -> float:
        """Effective reuse rate: the inverse of the mean delay of reused blocks."""
        p = self.p
        if p <= 0.0:
            return 0.0
        if any(r == 0 and w > 0 for w, r in zip(self.weights, self.rates)):
            return 0.0
        try:
            mean = math.fsum(w / r for w, r in zip(self.weights, self.rates) if r > 0)
        except OverflowError:  # a mean delay past the float range: as good as never
            return 0.0
        if mean <= 0:
            return 0.0
        a = p / mean
        # Rates near the float range: a subnormal mean overflows the ratio;
        # the fastest component's rate bounds it (exact for one component).
        return a if math.isfinite(a) else max(r for w, r in zip(self.weights, self.rates) if w > 0)

    def survival(self, idle_s: float) -> float:
        """P(not reused within ``idle_s`` seconds of being freed)."""
        return (1.0 - self.p) + math.fsum(
            w * math.exp(-r * idle_s) for w, r in zip(self.weights, self.rates)
        )

    def to_json(self) -> Any:
        return [[w, r] for w, r in zip(self.weights, self.rates)]


@dataclass(frozen=True)
class ClassScorer:
    """A reuse model compiled for one horizon and score mode.

    ``log_score(D)`` is the log of the block score; ``idle_below(s)``
    inverts it: the smallest idle time whose log score is ``< s``.
    """

    model: ReuseModel
    horizon: float
    mode: str
    # log(w_k * (1 - exp(-a_k * L))) per component with a positive score.
    _window_terms: tuple[tuple[float, float], ...] = field(init=False, repr=False)
    # log(w_k), a_k for the survival function (never-reused mass has rate 0).
    _survival_terms: tuple[tuple[float, float], ...] = field(init=False, repr=False)
    # log(w_k * (1 - exp(-a_k * L)) / a_k), a_k: the expected occupancy within L.
    _occupancy_terms: tuple[tuple[float, float], ...] = field(init=False, repr=False)
    # The class's time to live (mode "ttl"; 0 otherwise).
    ttl: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        window: list[tuple[float, float]] = []
        survival: list[tuple[float, float]] = []
        occupancy: list[tuple[float, float]] = []
        if self.mode == "ttl":  # scored by its time to live alone: no terms to build
            for name in ("_window_terms", "_survival_terms", "_occupancy_terms"):
                object.__setattr__(self, name, ())
            object.__setattr__(self, "ttl", time_to_live(self.model, self.horizon))
            return
        for w, r in zip(self.model.weights, self.model.rates):
            if w > 0.0:
                survival.append((math.log(w), r))
                mass = -math.expm1(-r * self.horizon)
                if mass > 0.0:
                    window.append((math.log(w) + math.log(mass), r))
                    occupancy.append((math.log(w) + math.log(mass / r), r))
                elif r == 0.0:
                    occupancy.append((math.log(w) + math.log(self.horizon), 0.0))
        never = 1.0 - self.model.p
        if never > 0.0:
            survival.append((math.log(never), 0.0))
            occupancy.append((math.log(never) + math.log(self.horizon), 0.0))
        if self.mode in ("posterior", "density") and window:
            # A ratio of two sums of exp(c - r D): both lose exp(-r0 D), r0 the
            # slowest rate, exactly. Left in, it cancels only to within the
            # rounding of r0 D (past 1e7 that exceeds the queue's tie width,
            # and a memoryless class stops scoring flat) and overflows to NaN.
            below = survival if self.mode == "posterior" else occupancy
            r0 = min(r for _, r in (*window, *below))
            if r0 > 0.0:
                window = [(c, r - r0) for c, r in window]
                below[:] = [(c, r - r0) for c, r in below]
        object.__setattr__(self, "_window_terms", tuple(window))
        object.__setattr__(self, "_survival_terms", tuple(survival))
        object.__setattr__(self, "_occupancy_terms", tuple(occupancy))
        object.__setattr__(self, "ttl", 0.0)

    def log_score(self, idle_s: float) -> float:
        if self.mode == "ttl":
            return (self.ttl - idle_s) / self.horizon
        terms = self._window_terms
        if not terms:
            return _NEG_INF
        if len(terms) == 1:
            c, r = terms[0]
            log_window = c - r * idle_s
        else:
            log_window = _logsumexp([c - r * idle_s for c, r in terms])
        if self.mode == "pr":
            return log_window
        surv = self._survival_terms if self.mode == "posterior" else self._occupancy_terms
        if len(surv) == 1:
            c, r = surv[0]
            return log_window - (c - r * idle_s)
        return log_window - _logsumexp([c - r * idle_s for c, r in surv])

    def idle_below(self, target: float) -> float:
        """Smallest idle time ``D >= 0`` with ``log_score(D) < target`` (strict).

        Returns ``inf`` when the score does not fall below ``target`` within
        ``_MAX_IDLE_S``.  The queue uses it to take a run of victims from one
        class without scoring each.
        """
        f_lo = self.log_score(0.0) - target
        if f_lo < 0.0:
            return 0.0
        if target == _NEG_INF:
            return math.inf
        if self.mode == "ttl":
            return self.ttl - target * self.horizon
        terms = self._window_terms
        if self.mode == "pr" and len(terms) == 1 and terms[0][1] > 0.0:
            c, r = terms[0]
            return max(0.0, (c - target) / r)
        # Bracket the crossing by powers of 64, then close in by regula falsi
        # with the Illinois step (Dowell & Jarratt 1971): a handful of scores
        # instead of bisection's thirty.  ``hi`` always scores below target.
        lo = 0.0
        hi = 1.0
        while True:
            f_hi = self.log_score(hi) - target
            if f_hi < 0.0:
                break
            if hi >= _MAX_IDLE_S:
                return math.inf
            lo, f_lo = hi, f_hi
            hi = min(hi * 64.0, _MAX_IDLE_S)
        side = 0
        for _ in range(64):
            if hi - lo <= 1e-9 * max(1.0, hi):
                break
            mid = hi - f_hi * (hi - lo) / (f_hi - f_lo)
            if not lo < mid < hi:
                mid = 0.5 * (lo + hi)
            f_mid = self.log_score(mid) - target
            if f_mid < 0.0:
                hi, f_hi = mid, f_mid
                if side < 0:
                    f_lo *= 0.5
                side = -1
            else:
                lo, f_lo = mid, f_mid
                if side > 0:
                    f_hi *= 0.5
                side = 1
        return hi


def time_to_live(model: ReuseModel, break_even_s: float) -> float:
    """``argmax_tau F(tau) - tau / B`` for the model's delay law ``F = 1 - S``.

    ``F``'s density ``sum_k w_k a_k exp(-a_k tau)`` only falls, so the
    maximum is where it crosses ``1 / B`` (0 when it starts below): found by
    bisection on the log of the density.
    """
    # log(w) + log(r), not log(w * r): the product of two tiny positive numbers rounds to 0.
    terms = [(math.log(w) + math.log(r), r) for w, r in zip(model.weights, model.rates) if w > 0.0 and r > 0.0]
    target = -math.log(break_even_s)
    if not terms or _logsumexp([c for c, _ in terms]) <= target:
        return 0.0
    lo, hi = 0.0, 1.0
    while _logsumexp([c - r * hi for c, r in terms]) > target:
        lo, hi = hi, hi * 4.0
        if hi > _MAX_IDLE_S:
            return _MAX_IDLE_S
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _logsumexp([c - r * mid for c, r in terms]) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-6 * hi:
            break
    return hi


# The prior: one model shared by every class, which makes the queue order
# exactly like vLLM's LRU queue.
LRU_MODEL = ReuseModel.exponential(p=1.0, a=1.0 / 60.0)


@dataclass(frozen=True)
class WAParams:
    """Everything the queue needs to rank free blocks; never mutated.

    ``models`` maps a class name to its reuse model; classes without an entry
    use ``default``.  When every class resolves to the same model the queue
    orders by stamp alone: exactly like LRU when ``stamp`` is "free".
    """

    models: Mapping[str, ReuseModel] = field(default_factory=dict)
    default: ReuseModel = LRU_MODEL
    horizon: float = DEFAULT_HORIZON_S
    mode: str = "pr"
    version: int = 0
    source: str = "prior"
    stamp: str = "free"
    # Scorers by class name, built once by :meth:`compile` (or on first use).
    _scorers: dict[str, ClassScorer] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.models, Mapping):
            raise ParamsError("models must be a mapping of class name to ReuseModel")
        for name, model in self.models.items():
            if not isinstance(name, str) or not name:
                raise ParamsError(f"class names must be non-empty strings, got {name!r}")
            if not isinstance(model, ReuseModel):
                raise ParamsError(f"model of class {name!r} is not a ReuseModel")
        if not isinstance(self.default, ReuseModel):
            raise ParamsError("default must be a ReuseModel")
        # A float, whatever number came in: an int past 2**64 would not cross
        # vLLM's msgpack channel (the snapshot that carries it kills the
        # engine's output thread).
        object.__setattr__(self, "horizon", _check_number("L (horizon)", self.horizon))
        if self.horizon <= 0:
            raise ParamsError(f"L (horizon) must be positive, got {self.horizon}")
        if self.mode not in SCORE_MODES:
            raise ParamsError(f"mode must be one of {SCORE_MODES}, got {self.mode!r}")
        if self.stamp not in STAMPS:
            raise ParamsError(f"stamp must be one of {STAMPS}, got {self.stamp!r}")
        if (
            isinstance(self.version, bool)
            or not isinstance(self.version, int)
            or not 0 <= self.version <= MAX_VERSION
        ):
            raise ParamsError(f"version must be an integer in [0, {MAX_VERSION}], got {short_repr(self.version)}")
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))

    @classmethod
    def lru(cls, *, version: int = 0, source: str = "prior") -> WAParams:
        """Parameters under which the queue is exactly LRU."""
        return cls(version=version, source=source)

    @property
    def is_uniform(self) -> bool:
        """True when every class has the same model (the queue is then LRU)."""
        return all(m == self.default for m in self.models.values())

    def model_for(self, class_name: str) -> ReuseModel:
        return self.models.get(class_name, self.default)

    def scorer_for(self, class_name: str) -> ClassScorer:
        """The compiled scorer of a class (the default's for unnamed classes)."""
        s = self._scorers.get(class_name)
        if s is None:
            s = self._scorers.get("") if class_name not in self.models else None
            if s is None:
                s = ClassScorer(self.model_for(class_name), self.horizon, self.mode)
                self._scorers["" if class_name not in self.models else class_name] = s
        return s

    def compile(self) -> WAParams:
        """Build every class's scorer now (the controller does it off the engine thread)."""
        self.scorer_for("")
        for name in self.models:
            self.scorer_for(name)
        return self

    def evolve(self, **changes: Any) -> WAParams:
        """A copy with some fields replaced (validated like a new object)."""
        return replace(self, **changes)

    # ---- the PR's JSON format -------------------------------------------------

    @classmethod
    def from_pr_json(
        cls, data: Mapping[str, Any] | str, *, max_classes: int | None = None, **overrides: Any
    ) -> WAParams:
        """Read the PR #22236 format ``{"a": {cls: rate}, "p": {cls: prob}}``.

        Optional keys written by :meth:`to_pr_json`: ``L``, ``mode``,
        ``mixture`` (``{cls: [[w, a], ...]}``), ``default`` and ``stamp``.
        ``max_classes``: the class cap of the queue they are for; more classes
        than it is an error, found before any class is read (a queue never
        uses the extra ones, and the engine would copy them into every state
        snapshot).
        """
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except RecursionError:
                raise ParamsError("params JSON is nested too deeply") from None
            except ValueError as e:  # JSONDecodeError, or an integer past Python's digit limit
                raise ParamsError(f"params JSON does not parse: {e}") from e
        if not isinstance(data, Mapping):
            raise ParamsError("params JSON must be an object with keys 'a' and 'p'")
        unknown = set(data) - _PR_JSON_KEYS
        if unknown:
            raise ParamsError(f"unknown key(s) {sorted(map(str, unknown))[:5]}; expected some of {sorted(_PR_JSON_KEYS)}")
        rates, probs = data.get("a"), data.get("p")
        if not isinstance(rates, Mapping) or not isinstance(probs, Mapping):
            raise ParamsError("params JSON needs objects 'a' (class -> rate) and 'p' (class -> prob)")
        if max_classes is not None and len(rates) > max_classes:
            raise ParamsError(f"params name {len(rates)} classes, more than the class cap ({max_classes})")
        if set(rates) != set(probs):
            diff = sorted(set(rates) ^ set(probs))
            raise ParamsError(f"classes {diff} appear in only one of 'a' and 'p'")
        mixtures = data.get("mixture") or {}
        if not isinstance(mixtures, Mapping):
            raise ParamsError("'mixture' must be an object of class -> [[w, a], ...]")
        stray = set(mixtures) - set(rates)
        if stray:
            raise ParamsError(f"'mixture' names classes {sorted(stray)[:5]} that 'a' and 'p' do not")
        models: dict[str, ReuseModel] = {}
        for name in rates:
            if not is_valid_class_name(name):
                raise ParamsError(
                    f"class name {str(name)[:80]!r} is not a valid class name "
                    f"(1-{MAX_CLASS_NAME_LENGTH} characters of A-Z a-z 0-9 _ . : -)"
                )
            try:
                # 'a' and 'p' are checked even where a mixture replaces them
                # (to_pr_json writes the mixture's own p and a there).
                exponential = ReuseModel.exponential(probs[name], rates[name])
                models[name] = _model_from_json(mixtures[name]) if name in mixtures else exponential
            except ParamsError as e:
                raise ParamsError(f"class {name!r}: {e}") from None
        kwargs: dict[str, Any] = {"models": models, "source": "pr-json"}
        if "default" in data:
            kwargs["default"] = _model_from_json(data["default"])
        elif models:
            kwargs["default"] = pooled_model(models.values())
        if "L" in data:
            kwargs["horizon"] = data["L"]
        if "mode" in data:
            kwargs["mode"] = data["mode"]
        if "version" in data:
            kwargs["version"] = data["version"]
        if "stamp" in data:
            kwargs["stamp"] = data["stamp"]
        kwargs.update(overrides)
        params = cls(**kwargs)
        try:
            # Build every scorer now: numbers that pass each check one by one can
            # still fail together (a pin, a params file or a checkpoint must be
            # refused here, not break the controller's next swap).
            params.compile()
        except (ArithmeticError, ValueError) as e:
            raise ParamsError(f"parameters cannot be compiled into scores: {e}") from None
        return params

    @classmethod
    def load(cls, path: str, *, max_classes: int | None = None, **overrides: Any) -> WAParams:
        """Read a params file (:meth:`from_pr_json`)."""
        return cls.parse(read_params_bytes(path), path, max_classes=max_classes, **overrides)

    @classmethod
    def parse(cls, data: bytes, source: str, *, max_classes: int | None = None, **overrides: Any) -> WAParams:
        """A params file's content; ``source`` (its path) names it in errors."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ParamsError(f"cannot read params file {source}: {e}") from e
        try:
            return cls.from_pr_json(text, max_classes=max_classes, **overrides)
        except ParamsError as e:
            raise ParamsError(f"{source}: {e}") from None

    def to_pr_json(self) -> dict[str, Any]:
        """The PR's format, plus the extension keys this project reads back."""
        out: dict[str, Any] = {
            "a": {c: m.a for c, m in self.models.items()},
            "p": {c: m.p for c, m in self.models.items()},
            "L": self.horizon,
            "mode": self.mode,
            "version": self.version,
            "default": self.default.to_json(),
        }
        if self.stamp != "free":
            out["stamp"] = self.stamp
        mixtures = {c: m.to_json() for c, m in self.models.items() if len(m.weights) > 1}
        if mixtures:
            out["mixture"] = mixtures
        return out


def read_params_bytes(path: str) -> bytes:
    """A params file's bytes, read once (a pipe gives them only once)."""
    return read_bytes(path, ParamsError, "params file")


def _model_from_json(obj: Any) -> ReuseModel:
    if isinstance(obj, Mapping):
        if set(obj) != {"p", "a"}:
            raise ParamsError(f"an exponential model is an object with exactly 'p' and 'a', got keys {short_repr(sorted(map(str, obj)))}")
        return ReuseModel.exponential(obj["p"], obj["a"])
    if not isinstance(obj, (list, tuple)) or not obj:
        raise ParamsError(f"a mixture must be a non-empty list of [w, a] pairs, got {short_repr(obj)}")
    pairs = []
    for pair in obj:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ParamsError(f"mixture components must be [w, a] pairs, got {short_repr(pair)}")
        pairs.append(pair)
    return ReuseModel(
        tuple(_check_number("w", w, hi=1.0) for w, _ in pairs),
        tuple(_check_number("a", a) for _, a in pairs),
    )


def _relative_change(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def models_differ(a: ReuseModel, b: ReuseModel, tolerance: float) -> bool:
    """Whether two reuse models differ by more than ``tolerance`` (relative) in any parameter."""
    if len(a.weights) != len(b.weights):
        return True
    pairs = zip(a.weights + a.rates, b.weights + b.rates)
    return any(_relative_change(x, y) > tolerance for x, y in pairs)


def params_changed(old: WAParams, new: WAParams, tolerance: float) -> bool:
    """Whether swapping ``new`` in for ``old`` changes how the queue ranks blocks.

    A different score mode, stamp or horizon, a different set of classes, or
    any model parameter that moved by more than ``tolerance`` (relative).
    """
    if old.mode != new.mode or old.stamp != new.stamp or _relative_change(old.horizon, new.horizon) > tolerance:
        return True
    if set(old.models) != set(new.models) or models_differ(old.default, new.default, tolerance):
        return True
    return any(models_differ(m, new.models[c], tolerance) for c, m in old.models.items())


def pooled_model(models: Any) -> ReuseModel:
    """A neutral model for classes the params do not name: the classes' mean."""
    models = list(models)
    p = math.fsum(m.p for m in models) / len(models)
    try:
        a = math.fsum(m.a for m in models) / len(models)
    except OverflowError:  # rates near the float range: their mean without the sum
        a = math.fsum(m.a / len(models) for m in models)
    return ReuseModel.exponential(p, a)

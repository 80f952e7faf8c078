"""The controller's configuration, read from TOML and validated at start-up.

Every knob is documented in ``configs/controller.toml``; an unknown key or a
bad value is an error that names the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from vllm_wa.controller.estimators import FAMILIES
from vllm_wa.controller.features import BLOCK_FEATURES, FEATURES, FeatureKey
from vllm_wa.controller.learned_key import MAX_LEARNED_CLASSES
from vllm_wa.controller.tuner import TunerSettings
from vllm_wa.fileio import TOMLDecodeError, parse_toml, read_bytes
from vllm_wa.params import SCORE_MODES, STAMPS
from vllm_wa.validation import check_number
from vllm_wa.workload_classes import DEFAULT_MAX_CLASSES, MAX_CLASS_CAP

# What the miniature caches see: hash-sampled blocks of every prompt, or the
# whole chains of hash-sampled conversations.
SHADOW_SAMPLING = ("block", "chain")
# The ghost table's largest size, in sampled caches.
MAX_GHOST_FACTOR = 100.0
# The engine's event buffer drops events past ``event_capacity`` (a stalled
# refit must not grow it without bound): 32 times the default at most.
MAX_EVENT_CAPACITY = 1 << 22


class ConfigError(ValueError):
    """A bad controller configuration; the message names the key."""


@dataclass(frozen=True)
class CandidateSpec:
    """One configuration the tuner may run: class features, model family, score."""

    features: tuple[str, ...] = ("tag", "outcome")
    family: str = "hyperexponential"
    mode: str = "posterior"
    horizon: float = 10.0
    lru: bool = False
    # 0: one class per combination of the features' buckets.  K > 0: those
    # combinations are merged into K classes learned from the data (see
    # controller/learned_key.py), ranked by their chance of a reuse within
    # ``split_s`` seconds.
    classes: int = 0
    split_s: float = 60.0
    # What a free block's idle time counts from: "free" (its release, as
    # vLLM's LRU) or "lookup" (the start of its last use: the releasing
    # request's prefix lookup; see WorkloadAwareFreeQueue.stamp_at_lookup).
    stamp: str = "free"

    @property
    def name(self) -> str:
        if self.lru:
            return "lru"
        feats = "+".join(self.features) or "none"
        fam = "exp" if self.family == "exponential" else "hyper"
        learned = f"/K{self.classes}" if self.classes else ""
        stamp = "/lookup" if self.stamp == "lookup" else ""
        return f"{feats}/{fam}/{self.mode}/L{self.horizon:g}{learned}{stamp}"


LRU_CANDIDATE = CandidateSpec(lru=True)


# Every feature known per request (no per-block ones): the widest default key.
ALL_REQUEST_FEATURES = ("tag", "outcome", "think", "reply", "growth", "turn")


def _default_candidates() -> tuple[CandidateSpec, ...]:
    return (
        CandidateSpec(("tag", "outcome"), "hyperexponential", "posterior", 10.0),
        CandidateSpec(("tag", "outcome"), "hyperexponential", "posterior", 120.0),
        CandidateSpec(("tag", "outcome"), "exponential", "pr", 5.0),
        CandidateSpec(("outcome",), "hyperexponential", "posterior", 10.0),
        CandidateSpec(("tag",), "hyperexponential", "posterior", 10.0),
        # How often the block was reused and how much the prompt grew since the
        # previous turn, each class one exponential law: on the Mooncake trace
        # (no tags, no outcomes) at 15 % of unique blocks it reads 28.99 run
        # alone, the hyperexponential reuse-count key 28.43 (docs/results.md, "Mooncake").
        CandidateSpec(("tag", "outcome", "reuse", "growth"), "exponential", "posterior", 10.0),
        # When the conversation comes back: the engine's think time before the
        # turn that freed the block (a tool result returns in seconds, a person
        # in minutes); see engine_patch/conversations.py.
        CandidateSpec(("tag", "outcome", "think"), "hyperexponential", "posterior", 10.0),
        # Idle time from the start of the block's last use (its request's
        # lookup), not its release: a request that ran long ranks by when it
        # started (measured on the agentic split at 5 % and 11 %: ahead of the
        # release-stamped keys and of SGLang's FIFO; README, "When idle time starts").
        CandidateSpec(("tag", "outcome", "think"), "hyperexponential", "posterior", 10.0, stamp="lookup"),
        CandidateSpec(ALL_REQUEST_FEATURES, "hyperexponential", "posterior", 10.0, stamp="lookup"),
        # How often the block was reused, each class a hyperexponential law:
        # frequency is what SLRU and LFU rank by, and where long templates are
        # shared by many single-turn requests it leads (a to-B-like synthetic
        # trace without outcomes at 5 %: tag+reuse run alone 44.98 against
        # SLRU's 44.09, where the other candidates left wa-online at 43.54;
        # docs/results.md, "Frequency").
        CandidateSpec(("tag", "outcome", "reuse"), "hyperexponential", "posterior", 10.0),
    )


@dataclass(frozen=True)
class ControllerConfig:
    """See ``configs/controller.toml`` for what each knob does."""

    refit_interval_s: float = 5.0
    fit_interval_s: float = 30.0
    memory_s: float = 1800.0
    min_samples: float = 30.0
    class_confidence: float = 0.999
    sample_rate: float | None = None
    sample_salt: int = 0
    shadow_blocks: int = 4096
    shadow_sampling: str = "block"
    ghost_factor: float = 4.0
    max_watch_s: float = 7200.0
    drift_delta: float = 0.002
    drift_forget: float = 0.25
    # Weigh each observation by its block's free time (unbiased under
    # forgetting; also makes drift cuts forget by free time). Opt-in: see
    # configs/controller.toml for what it changes in the measured hit rates.
    weigh_by_free_time: bool = False
    # Events the sink holds (and 8 block hashes per event: EventSink.hash_capacity).
    event_capacity: int = 1 << 17
    max_classes: int = DEFAULT_MAX_CLASSES
    class_retire_s: float = 1800.0
    checkpoint_path: str = ""
    checkpoint_interval_s: float = 60.0
    seed_params: str = ""
    swap_tolerance: float = 0.01
    tuner_enabled: bool = True
    tuner_window_s: float = 900.0
    tuner_demote_window_s: float = 300.0
    tuner_batch_s: float = 30.0
    tuner_margin: float = 0.003
    tuner_min_requests: int = 200
    tuner_min_batches: int = 6
    tuner_confidence: float = 0.95
    tuner_full_window_confidence: float = 0.99
    tuner_full_window_min_requests: int = 900
    tuner_full_window_margin: float = 0.001
    tuner_short_window_s: float = 450.0
    tuner_short_window_confidence: float = 0.999
    tuner_demote_confidence: float = 0.95
    tuner_replace_confidence: float = 0.95
    tuner_replace_gate_confidence: float = 0.95
    tuner_real_check: bool = True
    tuner_real_check_turnover: float = 1.0
    initial: str = "lru"
    candidates: tuple[CandidateSpec, ...] = field(default_factory=_default_candidates)

    def __post_init__(self) -> None:
        positive = (
            "refit_interval_s", "fit_interval_s", "memory_s", "ghost_factor", "max_watch_s",
            "drift_delta", "checkpoint_interval_s", "tuner_window_s", "class_retire_s",
            "tuner_demote_window_s", "tuner_batch_s",
        )
        for name in positive:
            check_number(name, getattr(self, name), gt=0, error=ConfigError)
        # The engine's refit job runs on this interval (apscheduler): a day at most,
        # and not so short that refits run back to back.
        check_number("refit_interval_s", self.refit_interval_s, ge=0.05, le=86400.0, error=ConfigError)
        for name in ("shadow_blocks", "event_capacity", "tuner_min_batches"):
            check_number(name, getattr(self, name), gt=0, integer=True, error=ConfigError)
        for name in ("min_samples", "tuner_margin", "tuner_full_window_margin", "swap_tolerance"):
            check_number(name, getattr(self, name), ge=0, error=ConfigError)
        for name in ("tuner_min_requests", "tuner_full_window_min_requests"):
            check_number(name, getattr(self, name), ge=0, integer=True, error=ConfigError)
        check_number("class_confidence", self.class_confidence, ge=0, le=0.999999, error=ConfigError)
        confidences = ("confidence", "full_window_confidence", "short_window_confidence", "demote_confidence")
        for name in (f"tuner_{c}" for c in confidences):
            check_number(name, getattr(self, name), ge=0.5, le=0.999999, error=ConfigError)
        for name in ("tuner_replace_confidence", "tuner_replace_gate_confidence"):  # 0 turns it off
            if getattr(self, name) != 0:
                check_number(name, getattr(self, name), ge=0.5, le=0.999999, error=ConfigError)
        if self.tuner_batch_s * 2 > self.tuner_demote_window_s:
            raise ConfigError("tuner_demote_window_s must hold at least two batches (2 x tuner_batch_s)")
        # A promotion needs tuner_min_batches batches inside its window: a shorter window never promotes.
        if self.tuner_window_s < self.tuner_min_batches * self.tuner_batch_s:
            raise ConfigError("tuner_window_s must hold tuner_min_batches batches (tuner_min_batches x tuner_batch_s)")
        # 0, or a window not shorter than the promotion window, turns the short look off.
        check_number("tuner_short_window_s", self.tuner_short_window_s, ge=0, error=ConfigError)
        if 0 < self.tuner_short_window_s < min(self.tuner_window_s, self.tuner_min_batches * self.tuner_batch_s):
            raise ConfigError(
                "tuner_short_window_s must be 0 (off) or hold tuner_min_batches batches (tuner_min_batches x tuner_batch_s)"
            )
        check_number("drift_forget", self.drift_forget, gt=0, le=1, error=ConfigError)
        check_number("event_capacity", self.event_capacity, le=MAX_EVENT_CAPACITY, error=ConfigError)
        # The ghost table holds ghost_factor sampled caches: bounded memory.
        check_number("ghost_factor", self.ghost_factor, gt=0, le=MAX_GHOST_FACTOR, error=ConfigError)
        check_number("tuner_real_check_turnover", self.tuner_real_check_turnover, ge=0, le=100, error=ConfigError)
        if self.sample_rate is not None:
            check_number("sample_rate", self.sample_rate, gt=0, le=1, error=ConfigError)
        check_number("sample_salt", self.sample_salt, ge=0, le=(1 << 64) - 1, integer=True, error=ConfigError)
        check_number("max_classes", self.max_classes, ge=3, le=MAX_CLASS_CAP, integer=True, error=ConfigError)
        # Counts spelled as integral floats (4096.0) are accepted, and kept as ints.
        for name in (
            "shadow_blocks", "event_capacity", "tuner_min_batches", "tuner_min_requests",
            "tuner_full_window_min_requests", "max_classes", "sample_salt",
        ):
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.shadow_sampling not in SHADOW_SAMPLING:
            raise ConfigError(f"shadow_sampling must be one of {SHADOW_SAMPLING}, got {self.shadow_sampling!r}")
        for i, c in enumerate(self.candidates):
            where = f"candidates[{i}]"
            if not isinstance(c, CandidateSpec):
                raise ConfigError(f"{where} must be a candidate table")
            bad = [f for f in c.features if f not in FEATURES]
            if bad:
                raise ConfigError(f"{where}.features has unknown features {bad}; expected some of {FEATURES}")
            try:  # the key's own rules (distinct names), here rather than in the engine's set-up
                FeatureKey(tuple(c.features))
            except ValueError as e:
                raise ConfigError(f"{where}.features: {e}") from None
            if not isinstance(c.lru, bool):  # a truthy string would silently make it LRU
                raise ConfigError(f"{where}.lru must be true or false, got {c.lru!r}")
            if c.family not in FAMILIES:
                raise ConfigError(f"{where}.family must be one of {FAMILIES}, got {c.family!r}")
            if c.mode not in SCORE_MODES:
                raise ConfigError(f"{where}.mode must be one of {SCORE_MODES}, got {c.mode!r}")
            check_number(f"{where}.horizon", c.horizon, gt=0, error=ConfigError)
            check_number(f"{where}.classes", c.classes, ge=0, le=MAX_LEARNED_CLASSES, integer=True, error=ConfigError)
            check_number(f"{where}.split_s", c.split_s, gt=0, error=ConfigError)
            if c.stamp not in STAMPS:
                raise ConfigError(f"{where}.stamp must be one of {STAMPS}, got {c.stamp!r}")
            if c.lru and c.stamp != "free":
                raise ConfigError(f"{where}: the LRU candidate stamps at the release (stamp = \"free\")")
            per_block = [f for f in c.features if f in BLOCK_FEATURES]
            if c.classes and per_block:
                raise ConfigError(f"{where}: a learned key (classes > 0) takes request features only, not {per_block}")
        object.__setattr__(self, "candidates", tuple(replace(c, classes=int(c.classes)) for c in self.candidates))
        if sum(1 for c in self.candidates if c.classes) > 1:
            raise ConfigError("at most one candidate may have learned classes (classes > 0): their class names would collide")
        names = [c.name for c in self.all_candidates]
        if len(set(names)) != len(names):
            raise ConfigError(f"candidates must differ; got duplicates in {names}")
        if self.initial not in names:
            raise ConfigError(f"initial must name a candidate ({names}), got {self.initial!r}")

    @property
    def tuner_settings(self) -> TunerSettings:
        return TunerSettings(
            margin=self.tuner_margin,
            window_s=self.tuner_window_s,
            demote_window_s=self.tuner_demote_window_s,
            batch_s=self.tuner_batch_s,
            min_requests=self.tuner_min_requests,
            min_batches=self.tuner_min_batches,
            confidence=self.tuner_confidence,
            full_window_confidence=self.tuner_full_window_confidence,
            full_window_min_requests=self.tuner_full_window_min_requests,
            full_window_margin=self.tuner_full_window_margin,
            short_window_s=self.tuner_short_window_s,
            short_window_confidence=self.tuner_short_window_confidence,
            demote_confidence=self.tuner_demote_confidence,
            replace_confidence=self.tuner_replace_confidence,
            replace_gate_confidence=self.tuner_replace_gate_confidence,
            real_check=self.tuner_real_check,
            real_check_turnover=self.tuner_real_check_turnover,
        )

    @property
    def all_candidates(self) -> tuple[CandidateSpec, ...]:
        """The configured candidates, with LRU always among them."""
        if any(c.lru for c in self.candidates):
            return self.candidates
        return (LRU_CANDIDATE, *self.candidates)

    # ---- loading ---------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ControllerConfig:
        if not isinstance(data, dict):
            raise ConfigError("the controller config must be a table")
        flat: dict[str, Any] = {}
        known = {f.name for f in fields(cls)}
        for section, prefix in (("controller", ""), ("tuner", "tuner_")):
            table = data.get(section, {})
            if not isinstance(table, dict):
                raise ConfigError(f"[{section}] must be a table")
            for k, v in table.items():
                key = prefix + k if section == "tuner" and k not in ("candidates", "initial") else k
                if key not in known:
                    raise ConfigError(f"unknown key {section}.{k}")
                flat[key] = v
        extra = set(data) - {"controller", "tuner"}
        if extra:
            raise ConfigError(f"unknown section(s) {sorted(extra)}; expected [controller] and [tuner]")
        if "candidates" in flat:
            raw = flat["candidates"]
            if not isinstance(raw, list):
                raise ConfigError("tuner.candidates must be an array of tables")
            cands = []
            allowed = {f.name for f in fields(CandidateSpec)}
            for i, c in enumerate(raw):
                if not isinstance(c, dict):
                    raise ConfigError(f"tuner.candidates[{i}] must be a table")
                unknown = set(c) - allowed
                if unknown:
                    raise ConfigError(f"unknown key tuner.candidates[{i}].{sorted(unknown)[0]}")
                c = dict(c)
                if "features" in c:
                    if not isinstance(c["features"], list) or not all(isinstance(x, str) for x in c["features"]):
                        raise ConfigError(f"tuner.candidates[{i}].features must be a list of strings")
                    c["features"] = tuple(c["features"])
                cands.append(CandidateSpec(**c))
            flat["candidates"] = tuple(cands)
        for k, v in flat.items():
            default = next(f for f in fields(cls) if f.name == k).default
            if k == "candidates" or default is None:
                continue
            if isinstance(default, bool) != isinstance(v, bool) or (
                isinstance(default, str) and not isinstance(v, str)
            ):
                raise ConfigError(f"{k} has the wrong type: {v!r}")
        try:
            return cls(**flat)
        except TypeError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def load(cls, path: str) -> ControllerConfig:
        return cls.parse(read_config_bytes(path), path)

    @classmethod
    def parse(cls, data: bytes, source: str) -> ControllerConfig:
        """A config file's content; ``source`` (its path) names it in errors."""
        try:
            parsed = parse_toml(data)
        except (TOMLDecodeError, ValueError) as e:  # ValueError: an integer past Python's digit limit
            raise ConfigError(f"{source}: not valid TOML: {e}") from e
        try:
            return cls.from_dict(parsed)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


def read_config_bytes(path: str) -> bytes:
    """A config file's bytes, read once (a pipe gives them only once)."""
    return read_bytes(path, ConfigError, "controller config")

"""The controller config for a time-compressed replay.

A benchmark that plays a trace ``1/scale`` times faster also shortens every
reuse gap by ``scale``; for the controller to see the trace as it would at
trace speed, its time constants (refit interval, memories, tuner windows and
batches, candidate horizons and learned-class splits) shrink by the same factor.  Counts (samples,
requests, batches) stay as they are.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from typing import Any

from vllm_wa.controller.config import CandidateSpec, ControllerConfig


def time_scaled(cfg: ControllerConfig, scale: float, min_refit_s: float = 1.0) -> ControllerConfig:
    """``cfg`` with every ``*_s`` setting and candidate horizon multiplied by ``scale``.

    The refit interval stays at least ``min_refit_s`` (refits cost CPU that the
    server under test also needs).
    """
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    changes: dict[str, Any] = {}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if f.name.endswith("_s") and isinstance(v, (int, float)) and not isinstance(v, bool):
            changes[f.name] = v * scale
    changes["refit_interval_s"] = max(min_refit_s, changes["refit_interval_s"])
    cands = tuple(
        c if c.lru else replace(c, horizon=c.horizon * scale, split_s=c.split_s * scale) for c in cfg.candidates
    )
    renamed = {c.name: s.name for c, s in zip(cfg.candidates, cands)}
    changes["candidates"] = cands
    changes["initial"] = renamed.get(cfg.initial, cfg.initial)
    return replace(cfg, **changes)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def to_toml(cfg: ControllerConfig) -> str:
    """The TOML that ``ControllerConfig.load`` reads back as ``cfg``."""
    controller, tuner = [], []
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if f.name == "candidates" or v is None:
            continue
        if f.name.startswith("tuner_"):
            tuner.append(f"{f.name[len('tuner_'):]} = {_value(v)}")
        elif f.name == "initial":
            tuner.append(f"initial = {_value(v)}")
        else:
            controller.append(f"{f.name} = {_value(v)}")
    lines = ["[controller]", *controller, "", "[tuner]", *tuner]
    for c in cfg.candidates:
        lines += ["", "[[tuner.candidates]]"]
        lines += [f"{f.name} = {_value(getattr(c, f.name))}" for f in fields(CandidateSpec)]
    return "\n".join(lines) + "\n"

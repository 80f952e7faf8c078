"""``vllm-wa check``: what ``vllm serve --wa-online`` will read, checked before a deploy.

The server refuses to start on a bad controller config or parameters file,
but a bad checkpoint only gives a warning in the engine's log and a cold
start (an engine must never fail over one).  This runs the parsers the
server runs, ahead of time, and says what each file holds or why it is
refused; for a checkpoint with a config, also which of its real-cache-check
findings a restart would apply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_wa.controller.checkpoint import CheckpointError, read_checkpoint
from vllm_wa.controller.config import ConfigError, ControllerConfig
from vllm_wa.controller.controller import CHECKPOINT_MAX_CLASSES
from vllm_wa.controller.tuner import LRU
from vllm_wa.params import ParamsError, WAParams


@dataclass(frozen=True)
class Finding:
    """One file: whether the server would use it, and what it holds or why not."""

    what: str
    path: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"{'ok' if self.ok else 'REFUSED'}  {self.what} {self.path}: {self.detail}"


def _params(what: str, path: str, config: ControllerConfig | None) -> Finding:
    try:
        p = WAParams.load(path, max_classes=(config or ControllerConfig()).max_classes)
    except ParamsError as e:  # unreadable files too (WAParams.load says so)
        return Finding(what, path, False, f"the server would not start: {e}")
    return Finding(what, path, True, f"{len(p.models)} classes, mode {p.mode}, L = {p.horizon:g} s")


def _checkpoint(path: str, config: ControllerConfig | None) -> Finding:
    what = "checkpoint"
    if not os.path.exists(path):
        return Finding(what, path, True, "absent: the engine starts from its prior and writes one")
    try:
        ckpt = read_checkpoint(path, max_classes=CHECKPOINT_MAX_CLASSES)
    except CheckpointError as e:
        return Finding(what, path, False, f"the engine would warn and start from its prior: {e}")
    assert ckpt is not None
    detail = f"{len(ckpt.classes)} finest classes, parameter version {ckpt.params.version}"
    if ckpt.overstated:
        names = [n for n, _ in ckpt.overstated]
        detail += f", real-cache-check findings for {len(names)} candidate(s)"
        if config is not None:
            configured = {c.name for c in config.all_candidates} - {LRU}
            applied = [n for n in names if n in configured] if config.tuner_real_check else []
            detail += f" ({len(applied)} would apply with this config)"
    return Finding(what, path, True, detail)


def preflight(
    config_path: str | None = None, params_path: str | None = None, checkpoint_path: str | None = None
) -> list[Finding]:
    """Check each given file (and those the config names) as the server would read it."""
    out: list[Finding] = []
    config: ControllerConfig | None = None
    if config_path:
        try:
            config = ControllerConfig.load(config_path)
        except ConfigError as e:  # unreadable files too (ControllerConfig.load says so)
            out.append(Finding("controller config", config_path, False, f"the server would not start: {e}"))
        else:
            n = len(config.all_candidates)
            out.append(Finding(
                "controller config", config_path, True,
                f"{n} candidates (LRU included), starts on {config.initial}, tuner {'on' if config.tuner_enabled else 'off'}, "
                f"real-cache check {'on' if config.tuner_real_check else 'off'}",
            ))
            if config.seed_params:
                out.append(_params("seed params", config.seed_params, config))
            if config.checkpoint_path and not checkpoint_path:
                out.append(_checkpoint(config.checkpoint_path, config))
    if params_path:
        out.append(_params("params", params_path, config))
    if checkpoint_path:
        out.append(_checkpoint(checkpoint_path, config))
    return out

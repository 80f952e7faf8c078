"""How ``--wa-*`` flags reach every vLLM process.

The API server parses the flags; the engine core runs in a spawned process
that re-imports everything.  The flags travel as environment variables, which
spawned children inherit (and which an operator can set for a headless
engine).  ``additional_config`` is deliberately not used: it is part of
vLLM's compile-cache key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_wa.controller.config import ControllerConfig

ENV_ONLINE = "VLLM_WA_ONLINE"
ENV_CONFIG = "VLLM_WA_CONFIG"
ENV_PARAMS = "VLLM_WA_PARAMS"
ENV_SEED_PARAMS = "VLLM_WA_SEED_PARAMS"
ENV_ALLOW_PIN = "VLLM_WA_ALLOW_PIN"
ENV_METRICS_INTERVAL = "VLLM_WA_METRICS_INTERVAL"
ENV_BENCH_OUTCOME_HINTS = "VLLM_WA_BENCH_OUTCOME_HINTS"
ENV_PUBLIC_PARAMS = "VLLM_WA_PUBLIC_PARAMS"

# The API server polls the engines' state this often (seconds): each poll is a
# call into every engine core.
METRICS_INTERVAL_RANGE_S = (0.1, 3600.0)

# Outcome reports one utility call carries from the API server to an engine
# core (the engine applies no more from one call; the API server sends no more).
MAX_OUTCOME_REPORTS_PER_CALL = 10_000


@dataclass(frozen=True)
class ServingSettings:
    online: bool = False
    config_path: str | None = None
    params_path: str | None = None
    # The checked copy of the config's ``seed_params`` file, run in its place.
    seed_params_path: str | None = None
    allow_pin: bool = False
    metrics_interval_s: float = 5.0
    bench_outcome_hints: bool = False
    # GET /wa/params without the API key even when the server has one.
    public_params: bool = False

    @classmethod
    def from_env(cls) -> ServingSettings:
        """The settings the environment holds; :class:`SettingsError` names a value it cannot use.

        Off (``VLLM_WA_ONLINE`` unset or 0), the other variables are not read:
        an installed vllm-wa then changes nothing, whatever they hold.
        """
        if not _flag(ENV_ONLINE):
            return cls()
        return cls(
            online=True,
            config_path=os.environ.get(ENV_CONFIG) or None,
            params_path=os.environ.get(ENV_PARAMS) or None,
            seed_params_path=os.environ.get(ENV_SEED_PARAMS) or None,
            allow_pin=_flag(ENV_ALLOW_PIN),
            metrics_interval_s=metrics_interval_from_env(),
            bench_outcome_hints=_flag(ENV_BENCH_OUTCOME_HINTS),
            public_params=_flag(ENV_PUBLIC_PARAMS),
        )

    def controller_config(self) -> ControllerConfig:
        """The controller config the engine cores run (validated at start-up),
        its ``seed_params`` the copy the API server checked."""
        from vllm_wa.controller.config import ControllerConfig

        config = ControllerConfig.load(self.config_path) if self.config_path else ControllerConfig()
        if self.seed_params_path and config.seed_params:
            config = replace(config, seed_params=self.seed_params_path)
        return config

    @property
    def snapshot_max_age_s(self) -> float:
        """How old the API server's copy of the engines' state may get: one poll
        interval, and never more than one refit interval."""
        return min(self.metrics_interval_s, self.controller_config().refit_interval_s)

    def export(self) -> None:
        """Publish to this process's environment (inherited by the engine core)."""
        os.environ[ENV_ONLINE] = "1" if self.online else "0"
        for key, value in (
            (ENV_CONFIG, self.config_path), (ENV_PARAMS, self.params_path), (ENV_SEED_PARAMS, self.seed_params_path)
        ):
            if value:
                os.environ[key] = os.path.abspath(value)
            else:
                os.environ.pop(key, None)
        os.environ[ENV_ALLOW_PIN] = "1" if self.allow_pin else "0"
        os.environ[ENV_METRICS_INTERVAL] = str(self.metrics_interval_s)
        os.environ[ENV_BENCH_OUTCOME_HINTS] = "1" if self.bench_outcome_hints else "0"
        os.environ[ENV_PUBLIC_PARAMS] = "1" if self.public_params else "0"


class SettingsError(ValueError):
    """A ``VLLM_WA_*`` variable holds a value vllm-wa cannot use."""


def _flag(name: str) -> bool:
    """A switch: 1 (on), 0 or unset (off); anything else is a mistake to report, not off."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise SettingsError(f"{name}={value!r}: set it to 1 (on) or 0 (off)")
    return value == "1"


def metrics_interval_from_env() -> float:
    """``VLLM_WA_METRICS_INTERVAL`` in seconds (5 when unset)."""
    raw = os.environ.get(ENV_METRICS_INTERVAL, "")
    if not raw:
        return 5.0
    lo, hi = METRICS_INTERVAL_RANGE_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not lo <= value <= hi:  # NaN fails too
        raise SettingsError(f"{ENV_METRICS_INTERVAL}={raw!r}: a poll interval in seconds from {lo:g} to {hi:g}")
    return value

"""Fault injection for soak tests; off unless its environment variable is set.

``VLLM_WA_FAULT_REFIT_EVERY=N`` (N > 0) makes every N-th controller refit in
each engine core raise :class:`InjectedFault` once it has applied the
engine's events, as a bug in the learning code would: the refit is counted in
``errors`` / ``vllm_wa_controller_errors_total``, the last good parameters
stay, and the engine keeps serving.  ``make bench-soak`` uses it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)
ENV_FAULT_REFIT_EVERY = "VLLM_WA_FAULT_REFIT_EVERY"


class InjectedFault(RuntimeError):
    """Raised on purpose by :func:`inject_refit_faults`."""


def inject_refit_faults(controller: Any, every: int) -> None:
    """Make every ``every``-th refit of ``controller`` fail (wraps its event processing)."""
    process = controller.process
    calls = 0

    def failing_process(events: Any) -> None:
        nonlocal calls
        calls += 1
        process(events)
        if calls % every == 0:
            raise InjectedFault(f"injected refit fault ({ENV_FAULT_REFIT_EVERY}={every}, refit {calls})")

    controller.process = failing_process


def install_from_env(controller: Any) -> None:
    """Inject the faults the environment asks for (none by default)."""
    raw = os.environ.get(ENV_FAULT_REFIT_EVERY, "")
    if not raw:
        return
    try:
        every = int(raw)
    except ValueError:
        every = 0
    if every <= 0:
        logger.warning("vllm-wa: ignoring %s=%r (expected a positive integer)", ENV_FAULT_REFIT_EVERY, raw)
        return
    logger.warning("vllm-wa: fault injection on: every %d-th refit fails (%s)", every, ENV_FAULT_REFIT_EVERY)
    inject_refit_faults(controller, every)

"""What a ``PUT /wa/params`` body may hold, checked the same way in the API server and the engine.

The API server refuses a bad body before it reaches an engine core (413 for
a body over :data:`MAX_PIN_BODY_BYTES`, 400 for one that is not JSON or is
nested deeper than any valid body, 422 with the reason for the rest); each
engine core checks again, against its own class cap, before it pins.
"""

from __future__ import annotations

from typing import Any

from vllm_wa.controller.features import FEATURES
from vllm_wa.params import ParamsError, WAParams
from vllm_wa.workload_classes import DEFAULT_MAX_CLASSES

# A pin of the default cap's 64 classes, each with a ten-component mixture,
# takes under 64 KiB.
MAX_PIN_BODY_BYTES = 256 * 1024
# ``{"params": {"mixture": {cls: [[w, a]]}}}`` is 5 levels deep.
MAX_PIN_BODY_DEPTH = 8


class PinRequestError(ValueError):
    """A body that must not pin anything; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def json_depth(obj: Any, limit: int = MAX_PIN_BODY_DEPTH) -> int:
    """Nesting depth of decoded JSON, counted without recursion and only up to ``limit + 1``."""
    depth = 0
    level = [obj]
    while level and depth <= limit:
        nxt: list[Any] = []
        for x in level:
            if isinstance(x, dict):
                nxt.extend(x.values())
            elif isinstance(x, list):
                nxt.extend(x)
        if not nxt and not any(isinstance(x, (dict, list)) for x in level):
            break
        depth += 1
        level = nxt
    return depth


def parse_pin_request(body: Any, *, max_classes: int = DEFAULT_MAX_CLASSES) -> tuple[WAParams | None, tuple[str, ...] | None]:
    """``(params, features)`` to pin, or ``(None, None)`` for ``{"mode": "auto"}``.

    Raises :class:`PinRequestError` with the reason (and ``ParamsError`` for
    bad parameter values, also a 422).
    """
    if json_depth(body) > MAX_PIN_BODY_DEPTH:
        raise PinRequestError(f"the body is nested deeper than {MAX_PIN_BODY_DEPTH} levels", status=400)
    if not isinstance(body, dict):
        raise PinRequestError("the body must be a JSON object")
    unknown = set(body) - {"params", "features", "mode"}
    if unknown:
        raise PinRequestError(f"unknown field(s) {sorted(unknown)[:5]}; expected params, features or mode")
    mode = body.get("mode", "pinned" if "params" in body else None)
    if mode == "auto":
        if "params" in body or "features" in body:
            raise PinRequestError("mode 'auto' takes no params and no features")
        return None, None
    if mode != "pinned":
        raise PinRequestError("send {'params': {...}} to pin, or {'mode': 'auto'} to return to automatic mode")
    try:
        params = WAParams.from_pr_json(body.get("params"), max_classes=max_classes)
    except ParamsError as e:
        raise PinRequestError(str(e)) from None
    features = body.get("features", ["tag"])
    if (
        not isinstance(features, list)
        or not all(isinstance(f, str) and f in FEATURES for f in features)
        or len(set(features)) != len(features)
    ):
        raise PinRequestError(f"features must be a list of distinct names from {list(FEATURES)}")
    return params, tuple(features)

"""The one check for numbers that come from outside (configs, params, traces, checkpoints).

Every loader raises its own error type (``ParamsError``, ``ConfigError``,
``ValueError``...), so the caller passes it; the message always names the
value (``where``) and says what was expected.
"""

from __future__ import annotations

import math
from typing import Any


def check_number(
    where: str,
    value: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    integer: bool = False,
    error: type[Exception] = ValueError,
) -> float:
    """``value`` (a float; an int with ``integer``) once it is a finite number within the bounds.

    Booleans are not numbers here (``True`` is an ``int`` in Python).  With
    ``integer``, integral floats (``3.0``, as JSON may spell them) pass and
    others fail.  ``ge`` and ``le`` together read as the interval
    ``[ge, le]`` (``le`` may be ``inf``).
    """
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{where} must be {kind}, got {short_repr(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise error(f"{where} must be finite, got {short_repr(value)}")
    if integer and value != int(value):
        raise error(f"{where} must be {kind}, got {value!r}")
    if ge is not None and le is not None:
        if not ge <= value <= le:
            raise error(f"{where} must be in [{ge}, {le}], got {value!r}")
    elif ge is not None and not value >= ge:
        raise error(f"{where} must be >= {ge:g}, got {value!r}")
    elif le is not None and not value <= le:
        raise error(f"{where} must be <= {le:g}, got {value!r}")
    if gt is not None and not value > gt:
        raise error(f"{where} must be > {gt:g}, got {value!r}")
    return int(value) if integer else float(value)


def short_repr(value: Any) -> str:
    """``repr`` cut to a readable length (values may be megabytes of untrusted input)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 80 else text[:77] + "..."


def parse_int_range(where: str, spec: str) -> list[int]:
    """Non-negative integers spelled ``"0-4"`` (both ends included) or ``"0,3,7"``.

    Raises ValueError naming ``where`` for anything else (a negative number,
    an empty or reversed range).
    """
    try:
        if "-" in spec:
            lo, hi = spec.split("-", 1)
            values = list(range(int(lo), int(hi) + 1))
        else:
            values = [int(s) for s in spec.split(",")]
    except ValueError:
        raise ValueError(f"{where} takes 0-4 or 0,3,7, got {short_repr(spec)}") from None
    if not values or min(values) < 0:
        raise ValueError(f"{where} needs non-negative integers, got {short_repr(spec)}")
    return values

"""The checks a trace record's fields pass, whichever loader reads it.

Every format (Bailian and Mooncake JSON lines, agentic conversations,
bench-serve results) reads its numbers and block ids through these, so a bad
value gets the same message wherever it comes from: ``ValueError`` naming the
field, which the loader turns into an error naming the file and record (or a
skipped, counted record with ``--skip-bad``).
"""

from __future__ import annotations

import math
from array import array
from typing import Any

from vllm_wa.validation import check_number

# A prompt's or a reply's length in tokens: no model's context or reply comes
# near it, and a larger one would be allocated (``--engine vllm`` builds the
# prompt's token ids) before anything else failed.
MAX_TOKENS = 1 << 31
# Agentic conversations' hash ids live in namespaces of 2**40 ids each.
NAMESPACE = 1 << 40


def int_field(rec: dict, key: str, *, lo: int = 0, hi: int | None = None) -> int:
    """An integer field (integral floats pass, booleans do not) in ``[lo, hi]``."""
    return int(check_number(f"field {key!r}", rec.get(key), ge=lo, le=hi, integer=True))


def token_field(rec: dict, key: str, *, lo: int = 0) -> int:
    """A length in tokens: an integer in ``[lo, MAX_TOKENS]``."""
    return int_field(rec, key, lo=lo, hi=MAX_TOKENS)


def float_field(rec: dict, key: str) -> float:
    """A finite, non-negative number (a time)."""
    return check_number(f"field {key!r}", rec.get(key), ge=0)


def str_field(rec: dict, key: str) -> str | None:
    """A string field, or None when absent or null."""
    v = rec.get(key)
    if v is not None and not isinstance(v, str):
        raise ValueError(f"field {key!r} must be a string")
    return v


def hash_ids(rec: dict, key: str = "hash_ids", offset: int = 0, blocks_for: tuple[int, int] | None = None) -> array:
    """The record's block ids; ``blocks_for`` = (input tokens, block size): there
    must be one id per block.  ``offset`` (a conversation's namespace) is
    or-ed into each id, which must then be below :data:`NAMESPACE`."""
    v: Any = rec.get(key)
    if not isinstance(v, list) or not v:
        raise ValueError(f"field {key!r} must be a non-empty list of integers")
    try:
        out = array("q", v)
    except TypeError as e:
        raise ValueError(f"field {key!r} must hold integers: {e}") from None
    except OverflowError:
        raise ValueError(f"field {key!r} holds an id outside the 64-bit range (block ids must be below 2**63)") from None
    if any(x is True or x is False for x in v):  # array("q") takes booleans as 1 and 0
        raise ValueError(f"field {key!r} must hold integers, not booleans")
    if min(out) < 0:
        raise ValueError(f"field {key!r} holds a negative id")
    if blocks_for is not None:
        n_in, block = blocks_for
        if len(out) != math.ceil(n_in / block):
            raise ValueError(f"len({key})={len(out)} but ceil(input_length/{block})={math.ceil(n_in / block)}")
    if offset:
        if max(out) >= NAMESPACE:
            raise ValueError(f"field {key!r} holds an id of 2**40 or more (ids are namespaced per conversation above it)")
        out = array("q", [offset | h for h in out])
    return out

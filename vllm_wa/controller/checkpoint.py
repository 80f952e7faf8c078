"""Controller checkpoints: what a restarted engine warm-starts from.

A checkpoint is untrusted input: the engine core reads it at start-up, so a
crafted or damaged file must never stop the engine.  :func:`parse_checkpoint`
checks every field's type, size and range before anything is applied and
raises :class:`CheckpointError` otherwise; the controller then warns and keeps
its prior.  Files are written with :func:`vllm_wa.fileio.atomic_write`, and
write failures are counted and warned about once per distinct cause
(:class:`CheckpointFailures`).

Format (JSON)::

    {"version": 2, "active": "<candidate>", "params": <PR JSON, with "version">,
     "classes": [{"components": [tag, outcome, depth, reuse, think, reply, growth, turn],
                  "data": {"events": [...], "censored": [...]}}, ...],
     "overstated": {"<candidate>": <hit-rate points as a fraction>, ...},
     "drift_cuts": [{"key": [feature, ...], "class": "<class name>",
                     "data": {"events": [...], "censored": [...]}}, ...]}

(components are the finest class's bucketed features, ``"u"`` for an
unknown timing feature, ``"*"`` for a feature no candidate uses).
``overstated`` (optional, and left out while empty, so a build from before
it still reads the file) is what the real-cache check found each demoted
candidate's miniature cache to overstate (``Tuner.overstated``): a restart
keeps it, so the candidate is not promoted again on the same overstated
lead.  It does not fade with time; a later real-check demotion of the same
candidate replaces it.  ``drift_cuts`` (optional, left out while empty) is
what each key's drift detections forgot of its classes
(:class:`~.class_drift.ClassDrift`): the finest classes' data is never cut,
so without it a restart would bring back what a drift forgot.  A build
from before this field refuses a file that has it (unknown key) and starts
from the prior.

``params`` is what ran when the file was written, as the running candidate
(or pin) has it, without the other keys' classes the live queue also holds.
A restart does not apply it (the tuner starts on LRU); the parameter version
lives in ``params.version``, and a restart continues from it.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_wa.controller.cause_log import CauseLog
from vllm_wa.controller.features import FEATURES, FINEST, FOLDED, TIMING_FEATURES, UNKNOWN
from vllm_wa.controller.survival import NUM_BINS, SurvivalData
from vllm_wa.engine_patch.block_tagger import OUTCOMES
from vllm_wa.fileio import atomic_write
from vllm_wa.params import MAX_VERSION, ParamsError, WAParams
from vllm_wa.validation import check_number
from vllm_wa.workload_classes import RESERVED_CLASSES, is_valid_tag

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 2
# Far above what MAX_FINE_CLASSES classes take (about 4 KiB each); a larger
# file is refused before it is read.
MAX_CHECKPOINT_BYTES = 32 << 20
# Half the version range: a swap a second would take 10^11 years to use the rest.
MAX_RESTORED_VERSION = MAX_VERSION // 2
# A class's forgotten count in one bin stays far below this (a million blocks
# a second over the default 1,800-s memory is about 2.6e9); larger counts are
# a damaged file, and sums of counts near the float limit overflow to inf,
# which no JSON answer (/wa/params) can carry.
MAX_BIN_COUNT = 1e12
# Far above any candidate set (the defaults are ten); a longer map is a damaged file.
MAX_OVERSTATED = 256
MAX_CANDIDATE_NAME = 256
# A key's class name: a tag and a bucket per further feature (about 100 characters at most).
MAX_KEY_CLASS_NAME = 512
_KEYS = {"version", "active", "params", "classes", "overstated", "drift_cuts"}
_OUTCOMES = (*OUTCOMES, "unknown")
Components = tuple[Any, ...]


class CheckpointError(ValueError):
    """A checkpoint that must not be applied; the message says why."""


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint: the active candidate, parameters, per-class data."""

    active: str | None
    params: WAParams
    classes: tuple[tuple[Components, SurvivalData], ...]
    # (candidate, overstatement) pairs: see the module doc.
    overstated: tuple[tuple[str, float], ...] = ()
    # (key features, class name, what its drifts forgot) triples: see the module doc.
    drift_cuts: tuple[tuple[tuple[str, ...], str, SurvivalData], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "version": CHECKPOINT_VERSION,
            "active": self.active,
            "params": self.params.to_pr_json(),
            "classes": [{"components": list(comps), "data": data.state()} for comps, data in self.classes],
            **({"overstated": dict(self.overstated[:MAX_OVERSTATED])} if self.overstated else {}),
            **(
                {
                    "drift_cuts": [
                        {"key": list(key), "class": name, "data": data.state()} for key, name, data in self.drift_cuts
                    ]
                }
                if self.drift_cuts
                else {}
            ),
        }


def _components(raw: Any, where: str) -> Components:
    """A finest class: one bucketed value per feature, ``*`` where folded."""
    if not isinstance(raw, list) or len(raw) != len(FEATURES):
        raise CheckpointError(f"{where}.components must be a list of {len(FEATURES)} items")
    out: list[Any] = []
    for i, (name, value) in enumerate(zip(FEATURES, raw)):
        at = f"{where}.components[{i}]"
        if value == FOLDED:
            out.append(value)
        elif name == "tag":
            if not (isinstance(value, str) and (is_valid_tag(value) or value in RESERVED_CLASSES)):
                raise CheckpointError(f"{at} is not a valid tag")
            out.append(value)
        elif name == "outcome":
            if not isinstance(value, str) or value not in _OUTCOMES:
                raise CheckpointError(f"{at} must be one of {_OUTCOMES}")
            out.append(value)
        elif value == UNKNOWN and name in TIMING_FEATURES:
            out.append(value)
        else:
            edges = FINEST.edges(name)
            out.append(int(check_number(at, value, ge=0, le=len(edges), integer=True, error=CheckpointError)))
    return tuple(out)


def _survival(raw: Any, where: str) -> SurvivalData:
    if not isinstance(raw, dict) or not {"events", "censored"} <= set(raw) <= {"events", "censored", "groups"}:
        raise CheckpointError(f"{where}.data must be an object with 'events', 'censored' and optionally 'groups'")
    arrays = []
    for key in ("events", "censored"):
        values = raw[key]
        if not isinstance(values, list) or len(values) != NUM_BINS:
            raise CheckpointError(f"{where}.data.{key} must be a list of {NUM_BINS} numbers")
        for v in values:
            check_number(f"{where}.data.{key}", v, ge=0, le=MAX_BIN_COUNT, error=CheckpointError)
        arrays.append(np.asarray(values, dtype=float))
    # Written before lookups were counted: every reused block counts as an observation.
    groups = raw.get("groups", 0.0)
    check_number(f"{where}.data.groups", groups, ge=0, le=NUM_BINS * 2 * MAX_BIN_COUNT, error=CheckpointError)
    return SurvivalData(arrays[0], arrays[1], float(groups))


def _overstated(raw: Any) -> tuple[tuple[str, float], ...]:
    """Candidate names and their overstatements, a fraction in [0, 1] each."""
    if not isinstance(raw, dict):
        raise CheckpointError("'overstated' must be an object of candidate names to numbers")
    if len(raw) > MAX_OVERSTATED:
        raise CheckpointError(f"'overstated' has {len(raw)} entries; at most {MAX_OVERSTATED}")
    out = []
    for name, value in raw.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_CANDIDATE_NAME:
            raise CheckpointError(f"'overstated' names must be 1-{MAX_CANDIDATE_NAME} characters")
        out.append((name, float(check_number(f"overstated[{name[:64]!r}]", value, ge=0, le=1, error=CheckpointError))))
    return tuple(out)


def _drift_cuts(raw: Any, max_cuts: int) -> tuple[tuple[tuple[str, ...], str, SurvivalData], ...]:
    """Keys (distinct feature names), class names and the counts their drifts
    forgot: at most ``max_cuts`` per key (a key's classes are unions of finest
    classes; the keys are subsets of the features, and the file's size bounds
    the whole)."""
    if not isinstance(raw, list):
        raise CheckpointError("'drift_cuts' must be a list")
    out = []
    seen: set[tuple[tuple[str, ...], str]] = set()
    per_key: dict[tuple[str, ...], int] = {}
    for i, entry in enumerate(raw):
        where = f"drift_cuts[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"key", "class", "data"}:
            raise CheckpointError(f"{where} must be an object with 'key', 'class' and 'data'")
        key = entry["key"]
        if (
            not isinstance(key, list)
            or not all(isinstance(f, str) and f in FEATURES for f in key)
            or len(set(key)) != len(key)
        ):
            raise CheckpointError(f"{where}.key must be a list of distinct names from {FEATURES}")
        name = entry["class"]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_KEY_CLASS_NAME:
            raise CheckpointError(f"{where}.class must be a name of 1-{MAX_KEY_CLASS_NAME} characters")
        if (tuple(key), name) in seen:
            raise CheckpointError(f"{where} repeats a key's class")
        seen.add((tuple(key), name))
        per_key[tuple(key)] = n = per_key.get(tuple(key), 0) + 1
        if n > max_cuts:
            raise CheckpointError(f"'drift_cuts' has more than {max_cuts} entries for the key {key}")
        out.append((tuple(key), name, _survival(entry["data"], where)))
    return tuple(out)


def parse_checkpoint(data: Any, *, max_classes: int) -> Checkpoint:
    """Validate a decoded checkpoint completely; raises :class:`CheckpointError`."""
    if not isinstance(data, dict):
        raise CheckpointError("a checkpoint must be a JSON object")
    if data.get("version") != CHECKPOINT_VERSION:
        version = data.get("version")
        raise CheckpointError(f"unsupported checkpoint version {version if isinstance(version, int) else '?'}")
    unknown = set(data) - _KEYS
    if unknown:
        raise CheckpointError(f"unknown key(s) {sorted(unknown)[:5]}")
    active = data.get("active")
    if active is not None and not isinstance(active, str):
        raise CheckpointError("'active' must be a candidate name")
    raw_classes = data.get("classes")
    if not isinstance(raw_classes, list):
        raise CheckpointError("'classes' must be a list")
    if len(raw_classes) > max_classes:
        raise CheckpointError(f"{len(raw_classes)} classes; at most {max_classes} are kept")
    classes: list[tuple[Components, SurvivalData]] = []
    seen: set[Components] = set()
    for i, entry in enumerate(raw_classes):
        where = f"classes[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"components", "data"}:
            raise CheckpointError(f"{where} must be an object with 'components' and 'data'")
        comps = _components(entry["components"], where)
        if comps in seen:
            raise CheckpointError(f"{where} repeats a class")
        seen.add(comps)
        classes.append((comps, _survival(entry["data"], where)))
    try:
        params = WAParams.from_pr_json(data.get("params"), max_classes=max_classes)
    except ParamsError as e:
        raise CheckpointError(f"params: {e}") from None
    if params.version > MAX_RESTORED_VERSION:
        # A restart continues from it: it must leave room for the swaps to come.
        raise CheckpointError(f"params.version {params.version} leaves no room for new versions (at most {MAX_RESTORED_VERSION})")
    overstated = _overstated(data["overstated"]) if "overstated" in data else ()
    cuts = _drift_cuts(data["drift_cuts"], max_classes) if "drift_cuts" in data else ()
    return Checkpoint(active, params, tuple(classes), overstated, cuts)


def read_checkpoint(path: str, *, max_classes: int) -> Checkpoint | None:
    """The checkpoint at ``path``; None when there is none; :class:`CheckpointError` when unusable."""
    try:
        # Non-blocking, and a regular file only: a FIFO (or a device) at the
        # path would block the engine's start in open() or read().
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError("not a regular file")
            if st.st_size > MAX_CHECKPOINT_BYTES:
                raise CheckpointError(f"{st.st_size} bytes; a checkpoint is at most {MAX_CHECKPOINT_BYTES} bytes")
            f = open(fd, encoding="utf-8")  # noqa: SIM115 - closes the descriptor from here on
        except BaseException:
            os.close(fd)
            raise
        with f:
            text = f.read(MAX_CHECKPOINT_BYTES + 1)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read: {e}") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise CheckpointError("JSON nested too deeply") from None
    except ValueError as e:
        raise CheckpointError(f"not valid JSON: {e}") from None
    return parse_checkpoint(data, max_classes=max_classes)


def write_checkpoint(path: str, checkpoint: Checkpoint) -> int:
    """Write atomically, within what :func:`read_checkpoint` accepts; returns
    how many entries were left out to fit (0 almost always).

    A state over ``MAX_CHECKPOINT_BYTES`` (a full finest-class table with thousands
    of drift cuts reached 110 MB) would be written and then refused by the
    next start: the smallest drift cuts are left out first, then the
    smallest classes (a restart starts those from the prior), so the file
    stays one the reader takes.  Raises ``OSError`` when the file cannot be
    written, ``ValueError`` when even the parameters alone do not fit.

    Encoded piece by piece in Python (``iterencode``), so the engine's thread
    gets the GIL between pieces, then written at once: ``json.dumps`` is one
    C call that holds the GIL throughout (a 14-MB checkpoint, 4,320 finest
    classes, held an engine thread off for 346 ms every
    ``checkpoint_interval_s``), and ``json.dump``'s many small writes to a
    text file held it for over 100 ms at the end.
    """
    limit = MAX_CHECKPOINT_BYTES
    doc = checkpoint.to_json()
    # Each class and cut encoded once, on its own: a state over the cap is
    # trimmed by leaving pieces out, not by encoding it again.
    classes = [_encode(c) for c in doc.pop("classes")]
    cuts = [_encode(c) for c in doc.pop("drift_cuts", ())]
    head = _encode(doc)
    text = _joined(head, classes, cuts)
    dropped = 0
    if len(text) > limit:  # ASCII (the encoder escapes the rest): one character is one byte
        text, dropped = _fitted(head, classes, cuts, checkpoint, limit, excess=len(text) - limit)
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(text)
    return dropped


def _fitted(
    head: str, classes: list[str], cuts: list[str], checkpoint: Checkpoint, limit: int, *, excess: int
) -> tuple[str, int]:
    """The JSON without its smallest drift cuts, then its smallest classes,
    within ``limit`` bytes (``excess`` over it whole), and how many entries
    it left out.

    Each entry left out sheds its text and a separator; once that is enough
    the kept entries are joined and measured (the last entry of a list has
    no separator, so one more may have to go)."""
    kept_classes, kept_cuts = [True] * len(classes), [True] * len(cuts)
    order = [(kept_cuts, cuts, i) for i in sorted(range(len(cuts)), key=lambda i: checkpoint.drift_cuts[i][2].n)]
    order += [(kept_classes, classes, i) for i in sorted(range(len(classes)), key=lambda i: checkpoint.classes[i][1].n)]
    for dropped, (kept, pieces, i) in enumerate(order, 1):
        kept[i] = False
        excess -= len(pieces[i]) + len(_ENCODER.item_separator)
        if excess <= 0:
            text = _joined(
                head, [c for c, k in zip(classes, kept_classes) if k], [c for c, k in zip(cuts, kept_cuts) if k]
            )
            if len(text) <= limit:
                return text, dropped
    size = len(_joined(head, [], []))
    raise ValueError(f"a checkpoint of {size} bytes even without its classes and cuts; at most {limit}")


def _encode(obj: Any) -> str:
    return "".join(_ENCODER.iterencode(obj))


def _joined(head: str, classes: list[str], cuts: list[str]) -> str:
    """The checkpoint's JSON from its encoded head (every other key) and entries."""
    sep = _ENCODER.item_separator
    tail = f'{sep}"classes": [{sep.join(classes)}]'
    if cuts:
        tail += f'{sep}"drift_cuts": [{sep.join(cuts)}]'
    return head[:-1] + tail + "}"


# json.dumps's defaults; ``iterencode`` without ``_one_shot`` runs the Python encoder.
_ENCODER = json.JSONEncoder()


@dataclass
class CheckpointFailures:
    """Checkpoint writes that failed: counted, the last one kept, warned once per cause."""

    count: int = 0
    last_error: str = ""
    trims: int = 0  # writes that left entries out to fit the reader's cap
    _warned: CauseLog = field(default_factory=CauseLog, repr=False)

    def trimmed(self, path: str, dropped: int) -> None:
        """A write that left ``dropped`` entries out to fit the reader's cap: counted, warned once."""
        self.trims += 1
        if self.trims > 1:
            logger.debug("vllm-wa: checkpoint %s left out %d entries to fit", path, dropped)
            return
        logger.warning(
            "vllm-wa: checkpoint %s left out its %d smallest drift cuts and classes to stay within %d bytes "
            "(a restart starts those from the prior; counted in checkpoint_trims, not logged again)",
            path, dropped, MAX_CHECKPOINT_BYTES,
        )

    def record(self, path: str, error: BaseException) -> None:
        self.count += 1
        self.last_error = f"{type(error).__name__}: {error}"
        if not self._warned.first((type(error).__name__, getattr(error, "errno", None))):
            logger.debug("vllm-wa: cannot write checkpoint %s (%d failures): %s", path, self.count, error)
            return
        logger.warning(
            "vllm-wa: cannot write checkpoint %s: %s (counted in checkpoint_errors; "
            "further failures of this kind are not logged)", path, error,
        )

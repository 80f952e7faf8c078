"""Trace loaders: Bailian JSON lines, Mooncake JSON lines, agentic-coding conversations.

Malformed input raises :class:`TraceFormatError` naming the file and line (or
conversation), unless ``skip_bad`` is set, in which case bad records are
skipped and counted in ``Trace.skipped_lines``.  A partial result is never
returned silently.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import stat
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import IO, Any

from vllm_wa.fileio import READ_ERRORS, read_head, reader_for
from vllm_wa.replay.block_chains import chain_block_ids
from vllm_wa.replay.records import NAMESPACE, float_field, hash_ids, int_field, token_field
from vllm_wa.replay.served import is_served_result, load_served
from vllm_wa.replay.trace import Trace, TraceRequest
from vllm_wa.validation import check_number, short_repr
from vllm_wa.workload_classes import MAX_TAG_LENGTH, NOT_IN_TAG

FORMATS = ("bailian", "mooncake", "agentic", "served")
BAILIAN_BLOCK = 16
MOONCAKE_BLOCK = 512
# Bailian turns are bucketed so classes stay bounded: 1, 2, 3, then "4" = 4+.
BAILIAN_MAX_TURN = 4
# Room for "_<turn>" in a tag's MAX_TAG_LENGTH characters.
_MAX_TYPE_LENGTH = MAX_TAG_LENGTH - 16
_OUTCOMES = {"tool_use": "tool", "end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}


SKIP_BAD_HINT = "--skip-bad skips and counts such records"


class TraceFormatError(ValueError):
    """A trace record that cannot be read; says where."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where

    @classmethod
    def record(cls, where: str, message: str) -> TraceFormatError:
        """One bad record: ``--skip-bad`` would read past it, and the message says so
        (a real trace with a few odd records should not look like a dead end)."""
        return cls(where, f"{message} ({SKIP_BAD_HINT})")


@dataclass
class AgenticOptions:
    """How conversations become one server trace."""

    window: float = 3600.0  # start offsets uniform in [0, window]
    cut: float = 7200.0  # drop requests arriving after this
    max_conversations: int | None = None
    seed: int = 0


# Archives of agentic conversations (tarfile reads each compression).
_ARCHIVES = (".tar", ".tar.xz", ".txz", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2")
# The longest JSON-lines record read (a Bailian or Mooncake record is a few
# kB; a 128k-token prompt's ids at 16 tokens a block, about 60 kB).
MAX_RECORD_BYTES = 16 << 20
# The largest agentic conversation file read (the development split's largest is
# a few MB); an archive's members are all read before any is parsed.
MAX_CONVERSATION_BYTES = 256 << 20


# Zstandard's frame magic (RFC 8878): traces are often shipped as .zst.
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _open_binary(path: str) -> IO[bytes]:
    """The file's bytes, decompressed as its name says, or else as its first bytes say."""
    head = b"" if os.path.isdir(path) else read_head(path, 6)
    if head.startswith(ZSTD_MAGIC):
        try:
            import zstandard  # optional: not a dependency of vllm-wa
        except ImportError:
            raise TraceFormatError(
                path, "zstd-compressed: decompress it first (zstd -d), or pip install zstandard"
            ) from None
        return zstandard.open(path, "rb")
    return reader_for(path, head)(path, "rb")


def check_trace_path(path: str) -> None:
    """Refuse a path that is not a regular file or a directory: a pipe (bash's
    ``<(zcat trace.gz)``) can be read once only, and detecting the format
    reads it before loading does, so the loader would miss its first records."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise TraceFormatError(path, f"cannot read: {e}") from e
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise TraceFormatError(path, "not a regular file (a pipe or a device): save the trace to a file first")


def detect_format(path: str) -> str:
    """Guess a trace's format from its name and first record."""
    if is_served_result(path):
        return "served"
    if os.path.isdir(path) or path.endswith(_ARCHIVES):
        return "agentic"
    try:
        with _open_binary(path) as f:
            # The first line alone, as bytes: a bad byte further on is that record's problem.
            first = f.readline(MAX_RECORD_BYTES).decode("utf-8-sig", errors="replace").strip()
            if path.endswith(".json") and not first.endswith("}"):
                return "agentic"
    except READ_ERRORS as e:
        raise TraceFormatError(path, f"cannot read: {e}") from e
    if not first:
        raise TraceFormatError(path, "the file starts with no record (empty, or a blank first line); pass --format")
    try:
        rec = json.loads(first)
    except (ValueError, RecursionError) as e:  # ValueError: a JSON error, or an integer past Python's digit limit
        if path.endswith(".json"):
            return "agentic"
        raise TraceFormatError(path, f"line 1 is not a JSON record ({e}); pass --format (with --skip-bad to read past it)") from None
    if isinstance(rec, dict):
        if "requests" in rec:
            return "agentic"
        if "chat_id" in rec:
            return "bailian"
        if "hash_ids" in rec and "timestamp" in rec:
            return "mooncake"
    raise TraceFormatError(path, "unrecognized trace format; pass --format")


def load_trace(
    path: str,
    fmt: str | None = None,
    *,
    skip_bad: bool = False,
    agentic: AgenticOptions | None = None,
    cut: float | None = None,
) -> Trace:
    """Load a trace of any format; ``cut`` drops requests arriving ``cut`` s or
    more after its origin (agentic: the start of the offset window, where it
    overrides ``agentic.cut``; JSON lines: the first request)."""
    check_trace_path(path)
    fmt = fmt or detect_format(path)
    if cut is not None:
        check_number("cut (seconds)", cut, gt=0)
    if fmt == "agentic":
        opts = agentic or AgenticOptions()
        if cut is not None:
            opts = replace(opts, cut=cut)
        return load_agentic(path, opts, skip_bad=skip_bad)
    if fmt == "bailian":
        trace = load_bailian(path, skip_bad=skip_bad)
    elif fmt == "mooncake":
        trace = load_mooncake(path, skip_bad=skip_bad)
    elif fmt == "served":
        try:
            trace = load_served(path, skip_bad=skip_bad)
        except (*READ_ERRORS, ValueError, RecursionError) as e:
            raise TraceFormatError(path, f"not a readable bench-serve result: {e}") from None
        note_chained_ids(trace)
    else:
        raise TraceFormatError(path, f"unknown format {fmt!r}; expected one of {FORMATS}")
    return cut_trace(trace, cut) if cut is not None else trace


def cut_trace(trace: Trace, cut: float) -> Trace:
    """The requests arriving less than ``cut`` s after the trace's first one."""
    limit = trace.start + cut
    kept = [r for r in trace.requests if r.arrival < limit]
    if not kept:  # a cut below the float resolution of the trace's start time
        raise TraceFormatError(trace.name, f"no request arrives within {cut:g} s of the first one")
    out = trace.with_requests(kept)
    out.notes.append(f"cut at {cut:g} s after the first request ({len(kept)} of {len(trace.requests)} requests)")
    return out


# ---- JSON lines ----------------------------------------------------------------------------


def _json_lines(path: str) -> Iterator[tuple[int, bytes | None]]:
    """Non-blank lines as bytes: ``json.loads`` decodes each one, so a line
    that is not UTF-8 is one bad record (skipped with ``--skip-bad``).  A line
    longer than :data:`MAX_RECORD_BYTES` comes as None, read past in chunks:
    one line of a compressed file could otherwise take gigabytes."""
    try:
        with _open_binary(path) as f:
            lineno = 0
            while line := f.readline(MAX_RECORD_BYTES + 1):
                lineno += 1
                if len(line) > MAX_RECORD_BYTES and not line.endswith(b"\n"):
                    while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                        pass
                    yield lineno, None
                elif line.strip():
                    yield lineno, line
    except READ_ERRORS as e:
        raise TraceFormatError(path, f"cannot read: {e}") from e


def _json_record(line: bytes | None) -> dict:
    """One JSON-lines record (an object), or ValueError saying why not."""
    if line is None:
        raise ValueError(f"the line is longer than {MAX_RECORD_BYTES >> 20} MiB")
    rec = json.loads(line)
    if not isinstance(rec, dict):
        raise ValueError("record is not an object")  # noqa: TRY004 - a bad record is a ValueError
    return rec


def _finish(name: str, block_size: int, fmt: str, reqs: list[TraceRequest], skipped: int, path: str) -> Trace:
    if not reqs:
        raise TraceFormatError(path, "no usable requests")
    reqs.sort(key=lambda r: r.arrival)
    trace = Trace(name, block_size, reqs, fmt, skipped_lines=skipped)
    note_chained_ids(trace)
    return trace


def note_chained_ids(trace: Trace) -> None:
    """Chain the trace's block ids (:func:`chain_block_ids`), noting how many requests that renamed."""
    if changed := chain_block_ids(trace.requests):
        trace.notes.append(
            f"{changed} requests list a block id after another prefix than its first appearance "
            "(ids hashed per block, as in Bailian traces): read as other blocks, as vLLM's chained hashes are"
        )


def _conversation_roots(parent_of: dict[int, int]) -> dict[int, int]:
    """Each chat's conversation: its first ancestor along ``parent_chat_id``
    (a parent missing from the trace stands for its own, unseen, root), in
    whatever order the lines come."""
    roots: dict[int, int] = {}
    for chat in parent_of:
        path: list[int] = []
        on_path: set[int] = set()
        node = chat
        while node not in roots:
            parent = parent_of[node]
            if parent < 0 or parent in on_path or parent == node:
                roots[node] = node  # a root (or a cycle, cut here)
            elif parent not in parent_of:
                roots[node] = parent  # the parent's request is not in the trace
            else:
                path.append(node)
                on_path.add(node)
                node = parent
        for n in path:
            roots[n] = roots[node]
    return roots


def bailian_type(typ: str) -> str:
    """A record's ``type`` as a tag's first part: characters a tag does not
    take become ``_``, and it is cut to leave room for the turn.  (A type
    such as ``image/url`` or ``text chat`` would otherwise make an invalid
    tag, and every such type would share the one ``invalid`` class.)"""
    return NOT_IN_TAG.sub("_", typ)[:_MAX_TYPE_LENGTH]


def _synthetic_flag(rec: dict) -> bool:
    """A record ``vllm-wa synth`` wrote says so (``"synthetic": true``)."""
    flag = rec.get("synthetic", False)
    if not isinstance(flag, bool):
        raise ValueError(f"field 'synthetic' must be true or false, got {short_repr(flag)}")  # noqa: TRY004 - a bad record is a ValueError
    return flag


def load_bailian(path: str, *, skip_bad: bool = False) -> Trace:
    """Aliyun Bailian traces (``alibaba-edu/qwen-bailian-usagetraces-anon``).

    Class tag ``f"{type}_{turn}"`` as in PR #22236, turns 4 and above folded
    into ``_4``.  Conversations are followed through ``parent_chat_id``.
    """
    reqs: list[TraceRequest] = []
    skipped = 0
    parent_of: dict[int, int] = {}
    seen: set[int] = set()
    synthetic = False
    for lineno, line in _json_lines(path):
        try:
            rec = _json_record(line)
            chat = int_field(rec, "chat_id", lo=0)
            parent = int_field(rec, "parent_chat_id", lo=-1)
            ts = float_field(rec, "timestamp")
            n_in = token_field(rec, "input_length", lo=1)
            n_out = token_field(rec, "output_length")
            typ = rec.get("type")
            if not isinstance(typ, str) or not typ:
                raise ValueError(f"field 'type' must be a non-empty string, got {typ!r}")
            turn = int_field(rec, "turn", lo=0)
            hashes = hash_ids(rec, blocks_for=(n_in, BAILIAN_BLOCK))
            if chat in seen:
                raise ValueError(f"chat_id {chat} appears twice (it names one request)")
            flag = _synthetic_flag(rec)
        except (ValueError, RecursionError) as e:
            if skip_bad:
                skipped += 1
                continue
            raise TraceFormatError.record(f"{path}:{lineno}", str(e)) from None
        seen.add(chat)
        synthetic = synthetic or flag
        parent_of[chat] = parent
        reqs.append(
            TraceRequest(
                request_id=f"{chat}",
                arrival=ts,
                hash_ids=hashes,
                input_tokens=n_in,
                output_tokens=n_out,
                tag=f"{bailian_type(typ)}_{min(max(turn, 1), BAILIAN_MAX_TURN)}",
            )
        )
    roots = _conversation_roots(parent_of)
    for r in reqs:
        r.conversation = roots[int(r.request_id)]
    trace = _finish(os.path.basename(path), BAILIAN_BLOCK, "bailian", reqs, skipped, path)
    trace.synthetic = synthetic
    trace.conversations = True
    return trace


def load_mooncake(path: str, *, skip_bad: bool = False) -> Trace:
    """Mooncake traces: ``timestamp`` in ms, 512-token blocks, one class."""
    reqs: list[TraceRequest] = []
    skipped = 0
    synthetic = False
    for lineno, line in _json_lines(path):
        try:
            rec = _json_record(line)
            if "chat_id" in rec or "parent_chat_id" in rec:
                raise ValueError("a Bailian record (chat_id, parent_chat_id): pass --format bailian")
            ts = float_field(rec, "timestamp") / 1000.0
            n_in = token_field(rec, "input_length", lo=1)
            n_out = token_field(rec, "output_length")
            hashes = hash_ids(rec, blocks_for=(n_in, MOONCAKE_BLOCK))
            flag = _synthetic_flag(rec)
        except (ValueError, RecursionError) as e:
            if skip_bad:
                skipped += 1
                continue
            raise TraceFormatError.record(f"{path}:{lineno}", str(e)) from None
        synthetic = synthetic or flag
        reqs.append(
            TraceRequest(
                request_id=str(lineno),
                arrival=ts,
                hash_ids=hashes,
                input_tokens=n_in,
                output_tokens=n_out,
            )
        )
    trace = _finish(os.path.basename(path), MOONCAKE_BLOCK, "mooncake", reqs, skipped, path)
    trace.synthetic = synthetic
    return trace


# ---- agentic-coding conversations -----------------------------------------------------------


def _is_conversation(name: str) -> bool:
    """A ``trace_*.json`` member (not a metadata file or a ``._`` resource fork copy)."""
    base = os.path.basename(name)
    return base.startswith("trace_") and base.endswith(".json")


def _conversation_files(path: str) -> Iterator[tuple[str, bytes]]:
    """(name, raw JSON) of every ``trace_*.json`` in a directory, archive or file."""
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            # Regular files only: a device or a FIFO under a trace's name reads forever.
            if _is_conversation(name) and os.path.isfile(full):
                with open(full, "rb") as f:
                    yield full, _read_conversation(full, f, os.fstat(f.fileno()).st_size)
        return
    try:
        is_tar = tarfile.is_tarfile(path)
    except READ_ERRORS as e:  # a truncated .tar.gz header raises here
        raise TraceFormatError(path, f"cannot read archive: {e}") from e
    if is_tar:
        try:
            # Read in the archive's order, then sort: extracting members in name
            # order seeks backwards through a compressed stream whenever the two
            # orders differ, and each such seek decompresses from the start (71 s
            # instead of 20 s for the agentic development split).
            found: list[tuple[str, bytes]] = []
            with tarfile.open(path, "r:*") as tar:
                for m in tar:
                    # A hard-linked file is stored as a link entry (size 0), read through its target.
                    if (m.isfile() or m.islnk()) and _is_conversation(m.name):
                        f = tar.extractfile(m)
                        if f is not None:
                            found.append((m.name, _read_conversation(f"{path}:{m.name}", f, m.size)))
        except (tarfile.TarError, KeyError, *READ_ERRORS) as e:  # KeyError: a link to a missing member
            raise TraceFormatError(path, f"cannot read archive: {e}") from e
        # A name stored twice (an appended archive) is the later copy, as tar extracts it.
        for name, raw in sorted(dict(found).items()):
            yield f"{path}:{name}", raw
        return
    if path.endswith(_ARCHIVES):
        raise TraceFormatError(path, _not_a_tar(path))
    with open(path, "rb") as f:
        yield path, _read_conversation(path, f, os.fstat(f.fileno()).st_size)


def _not_a_tar(path: str) -> str:
    """Why a file named like an archive is not one: damaged, empty, or another file."""
    try:
        with _open_binary(path) as f:
            head = f.read(512)
    except READ_ERRORS as e:
        return f"cannot read archive (truncated or damaged?): {e}"
    if not head:
        return "not a tar archive: the file is empty"
    if head[257:262] == b"ustar":  # a tar header's magic: the archive is cut short or damaged further on
        return "cannot read archive (truncated or damaged?)"
    if head.lstrip()[:1] in (b"{", b"["):
        return "not a tar archive, though named like one (a JSON-lines trace? pass --format)"
    return "not a tar archive, though named like one"


def _read_conversation(where: str, f: IO[bytes], size: int) -> bytes:
    """A conversation file's bytes, refused past :data:`MAX_CONVERSATION_BYTES`
    (the archive's members are read before any is parsed)."""
    if size <= MAX_CONVERSATION_BYTES:
        raw = f.read(MAX_CONVERSATION_BYTES + 1)
        size = len(raw)
    if size > MAX_CONVERSATION_BYTES:
        raise TraceFormatError(where, f"a conversation file of {size >> 20} MiB (at most {MAX_CONVERSATION_BYTES >> 20})")
    return raw


def _agentic_tag(req: dict) -> str:
    kinds = req.get("input_types") or ()
    if not isinstance(kinds, list):
        raise ValueError(f"field 'input_types' must be a list, got {short_repr(kinds)}")
    if "text" in kinds:
        return "human"
    if "tool_result" in kinds:
        return "tool"
    return "misc"  # not "other": that name is reserved for the class-cap overflow


def _agentic_requests(
    reqs: Any,
    where: str,
    conv: int,
    offset: float,
    namespace: int,
    opts: AgenticOptions,
    out: list[TraceRequest],
    sub_ids: Iterator[int],
) -> None:
    if not isinstance(reqs, list):
        raise ValueError("'requests' must be a list")
    for i, r in enumerate(reqs):
        if not isinstance(r, dict):
            raise ValueError(f"request {i} is not an object")
        if r.get("type") == "subagent":
            # A nested sub-agent run: a conversation of its own (as upstream's
            # replayer runs it, one user per sub-agent), in its parent's hash
            # namespace, whose requests' ``t`` count from the sub-agent's start,
            # the ``t`` of this entry in the parent.
            start = offset + float_field(r, "t")
            sub = r.get("requests")
            _agentic_requests(sub, f"{where}/sub{i}", next(sub_ids), start, namespace, opts, out, sub_ids)
            continue
        t = float_field(r, "t")
        arrival = offset + t
        if arrival >= opts.cut:
            continue
        hashes = hash_ids(r, offset=namespace)
        # The request's own service time where the trace has one (else the throughput model's).
        api = r.get("api_time")
        service = None if api is None else float_field(r, "api_time")
        stop = r.get("stop")
        if stop is not None and not isinstance(stop, str):
            raise ValueError(f"field 'stop' must be a string, got {short_repr(stop)}")
        out.append(
            TraceRequest(
                request_id=f"{where}#{i}",
                arrival=arrival,
                hash_ids=hashes,
                input_tokens=token_field(r, "in", lo=1),
                output_tokens=token_field(r, "out"),
                tag=_agentic_tag(r),
                conversation=conv,
                outcome=_OUTCOMES.get(stop, "stop" if stop else None),
                service_time=service,
            )
        )


def _request_id_stems(wheres: list[str]) -> list[str]:
    """Each conversation file's prefix of its request ids: its base name, or,
    for a base name that two folders of an archive share, its whole path
    (request ids key the blocks each request holds)."""
    names = [os.path.basename(w) for w in wheres]
    repeated = {n for n, c in Counter(names).items() if c > 1}
    return [w if n in repeated else n for w, n in zip(wheres, names)]


def load_agentic(path: str, opts: AgenticOptions | None = None, *, skip_bad: bool = False) -> Trace:
    """Agentic-coding conversations (``callanjfox/kv-cache-tester`` traces).

    Each conversation gets a seeded start offset uniform in ``[0, window]``;
    request time = offset + ``t``; requests at or after ``cut`` are dropped.
    A sub-agent run is a conversation of its own that starts at its entry's
    ``t`` in the parent (its requests' ``t`` count from there). Hash ids are
    namespaced per conversation file, sub-agents included.
    """
    opts = opts or AgenticOptions()
    check_number("agentic window (seconds)", opts.window, ge=0)
    check_number("agentic cut (seconds)", opts.cut, gt=0)
    if opts.max_conversations is not None:
        check_number("conversations", opts.max_conversations, ge=1, integer=True)
    files = list(_conversation_files(path))
    if not files:
        raise TraceFormatError(path, "no trace_*.json conversations found")
    rng = random.Random(opts.seed)
    if opts.max_conversations is not None and opts.max_conversations < len(files):
        files = sorted(rng.sample(files, opts.max_conversations))
    offsets = [rng.uniform(0.0, opts.window) for _ in files]
    reqs: list[TraceRequest] = []
    skipped = 0
    block_size = None
    sub_ids = itertools.count(len(files))  # sub-agents' conversation ids, after the files'
    names = _request_id_stems([where for where, _ in files])
    for conv, ((where, raw), offset, name) in enumerate(zip(files, offsets, names)):
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or "requests" not in doc:
                raise ValueError("not a conversation object with 'requests'")
            bs = int_field(doc, "block_size", lo=1) if "block_size" in doc else 64
            if block_size is not None and bs != block_size:
                raise ValueError(f"block_size {bs} differs from earlier conversations' {block_size}")
            part: list[TraceRequest] = []
            _agentic_requests(doc["requests"], name, conv, offset, (conv + 1) * NAMESPACE, opts, part, sub_ids)
        except (ValueError, RecursionError) as e:
            if skip_bad:
                skipped += 1
                continue
            raise TraceFormatError.record(where, str(e)) from None
        block_size = bs  # set by a conversation that was kept, not by a skipped one
        reqs.extend(part)
    trace = _finish(os.path.basename(path.rstrip("/")), block_size or 64, "agentic", reqs, skipped, path)
    trace.conversations = True
    kept = len({r.conversation for r in trace.requests})
    trace.notes.append(
        f"{len(files)} conversation files ({kept} conversations with requests before the cut, sub-agents counted), "
        f"offsets uniform in [0, {opts.window:g}] s (seed {opts.seed}), cut at {opts.cut:g} s"
    )
    if opts.window > opts.cut:
        trace.notes.append(
            f"warning: the offset window ({opts.window:g} s) is longer than the cut ({opts.cut:g} s): "
            "conversations that start after the cut are dropped whole"
        )
    return trace

"""Repeat a short Mooncake-format trace end to end, to see what a tuner does with more time.

The tuner promotes a candidate only on evidence: six 30-s batches at least,
a 900-s window for its usual bar.  A trace of three minutes (the bundled
1,000 requests of Mooncake's arXiv trace) ends before any promotion, so there
``wa-online`` is LRU by construction and says nothing about the same traffic
served for an hour.  This writes the trace ``--copies`` times in a row, each
copy shifted by the trace's span (plus ``--gap-ms``), with every block id
that fewer than ``--shared-share`` of its requests hold renamed per copy: a
system prompt stays shared across copies, as it would be in a longer trace,
while each copy's documents are new content.  The result is stationary
traffic of the trace's own mix, not a longer real trace: it shows whether
the tuner catches up with the policies that lead on the short one, given
time, nothing more.

    python benchmarks/tile_trace.py vllm_wa/data/mooncake-arxiv-sample.jsonl.xz --copies 20 --out tiled.jsonl
    vllm-wa replay tiled.jsonl --policies lru,arc,slru,lfu,fifo,wa-online --cache-blocks 244,610,1221,2441

The input is Mooncake's format (``timestamp`` in ms, ``hash_ids``); other
fields are copied unchanged.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass

from vllm_wa.fileio import atomic_write, opener_for
from vllm_wa.replay.records import float_field, hash_ids


@dataclass(frozen=True)
class Tiling:
    requests: int  # per copy
    copies: int
    span_ms: int  # time between the starts of two copies
    shared_ids: int  # block ids every copy keeps


def read_records(path: str) -> list[dict]:
    """The trace's records, in file order; ValueError naming the line that is not one."""
    records = []
    with opener_for(path)(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: not a JSON object")  # noqa: TRY004 - a bad record is a ValueError
            try:  # the replay's own checks of these fields
                float_field(rec, "timestamp")
                hash_ids(rec)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def tile(records: list[dict], copies: int, shared_share: float, gap_ms: int) -> tuple[list[dict], Tiling]:
    """``copies`` copies of ``records`` in a row; ids held by fewer than
    ``shared_share`` of the requests get a new name in every copy but the first."""
    if copies < 1:
        raise ValueError("copies must be at least 1")
    if not 0.0 < shared_share <= 1.0:
        raise ValueError("shared_share must be in (0, 1]")
    if gap_ms < 0:
        raise ValueError("gap_ms must be non-negative")
    holders = Counter(h for r in records for h in set(r["hash_ids"]))
    shared = {h for h, n in holders.items() if n >= shared_share * len(records)}
    start = min(r["timestamp"] for r in records)
    span = int(max(r["timestamp"] for r in records) - start) + gap_ms
    stride = max(holders) + 1  # copy k's private ids are shifted past every id in use
    out = []
    for k in range(copies):
        for r in records:
            ids = r["hash_ids"] if k == 0 else [h if h in shared else h + k * stride for h in r["hash_ids"]]
            out.append({**r, "timestamp": r["timestamp"] + k * span, "hash_ids": ids})
    return out, Tiling(len(records), copies, span, len(shared))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="Mooncake-format JSON lines (.jsonl, .gz, .xz)")
    p.add_argument("--copies", type=int, default=20)
    p.add_argument(
        "--shared-share", type=float, default=0.05, help="ids held by at least this share of requests stay shared"
    )
    p.add_argument("--gap-ms", type=int, default=1000, help="pause between two copies (ms)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        tiled, info = tile(read_records(args.trace), args.copies, args.shared_share, args.gap_ms)
    except (OSError, ValueError) as e:
        raise SystemExit(f"tile_trace: {e}") from None
    with atomic_write(args.out, "wt", opener=opener_for(args.out), encoding="utf-8", durable=False) as f:
        for r in tiled:
            f.write(json.dumps(r) + "\n")
    print(
        f"{args.out}: {info.copies} copies of {info.requests} requests, {info.span_ms / 1000:.0f} s apart, "
        f"{info.shared_ids} shared block ids"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

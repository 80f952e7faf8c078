"""Pack the agentic conversations the development split does not hold.

The development split (``agentic-coding-dev.tar.xz``) is 530 of the
conversations published in ``callanjfox/kv-cache-tester`` (``traces/``).
Every hit-rate figure is tuned on it, so the conversations it leaves out are
the check that a setting generalizes: this writes them as one tar that
``vllm-wa replay`` reads like the split itself.

    python benchmarks/heldout_split.py KV_CACHE_TESTER/traces agentic-coding-dev.tar.xz --out held.tar.xz

Files of the folder that are missing or empty (a checkout without its large
files) are skipped and counted, so the report says how much was held out.
"""

from __future__ import annotations

import argparse
import os
import tarfile
from dataclasses import dataclass


@dataclass(frozen=True)
class HeldOut:
    written: list[str]
    skipped_empty: list[str]
    in_split: int


def split_names(split_tar: str) -> set[str]:
    """Base names of the conversation files in the development split."""
    with tarfile.open(split_tar) as tar:
        return {os.path.basename(m.name) for m in tar.getmembers() if m.isfile() and m.name.endswith(".json")}


def write_heldout(traces_dir: str, split_tar: str, out: str) -> HeldOut:
    """Write every ``*.json`` of ``traces_dir`` that the split lacks to the tar ``out``."""
    in_split = split_names(split_tar)
    names = sorted(n for n in os.listdir(traces_dir) if n.endswith(".json"))
    written, empty = [], []
    with tarfile.open(out, "w:xz") as tar:
        for name in names:
            if name in in_split:
                continue
            path = os.path.join(traces_dir, name)
            if not os.path.isfile(path) or os.path.getsize(path) == 0:
                empty.append(name)
                continue
            tar.add(path, arcname=name)
            written.append(name)
    return HeldOut(written, empty, len(in_split))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces_dir", help="kv-cache-tester's traces/ folder")
    ap.add_argument("split", help="the development split's tar")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    held = write_heldout(args.traces_dir, args.split, args.out)
    print(
        f"{args.out}: {len(held.written)} conversations held out "
        f"({held.in_split} in the split, {len(held.skipped_empty)} missing or empty and skipped)"
    )


if __name__ == "__main__":
    main()

"""Tables, JSON records and plots of replay results."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vllm_wa.fileio import atomic_write
from vllm_wa.replay.peers import PEERS
from vllm_wa.replay.runner import RunResult


def gap_closed(results: Sequence[RunResult], r: RunResult) -> float | None:
    """``(policy - lru) / (opt - lru)`` in token hit rate, at the same cache size."""
    by = {(x.policy, x.cache_blocks): x for x in results if x.trace == r.trace}
    lru = by.get(("lru", r.cache_blocks))
    opt = by.get(("opt", r.cache_blocks))
    if lru is None or opt is None or r.policy in ("infinite",):
        return None
    span = opt.token_hit_rate - lru.token_hit_rate
    if span <= 1e-12:
        return None
    return (r.token_hit_rate - lru.token_hit_rate) / span


def records(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    out = []
    for r in results:
        d = r.to_json()
        d["gap_closed"] = gap_closed(results, r)
        out.append(d)
    return out


def _peer_notes(rs: Sequence[RunResult], choices: dict[str, Any] | None) -> list[str]:
    """Which peers read client hints, and the knob setting each ran at."""
    lines = []
    hinted = {r.policy: r.extra for r in rs if r.extra.get("client_hints")}
    if hinted:
        parts = []
        for p, x in hinted.items():
            missing = x.get("client_hints_missing") or []
            text = f"{p} reads {', '.join(x['client_hints'])}"
            if missing:
                text += f" (this trace has no {' and no '.join(missing)}: it ran without)"
            parts.append(text)
        lines.append("* client hints from the trace: " + "; ".join(parts) + "; no other policy uses any")
    for p in dict.fromkeys(r.policy for r in rs if r.extra.get("knob")):
        r = next(x for x in rs if x.policy == p)
        c = (choices or {}).get(p)
        text = f"  {p}: {r.extra['knob']}={r.extra['setting']:g}"
        if c is None:  # not tuned: fixed by --peer-settings, or no profile half to tune on
            text += " (default)" if r.extra["setting"] == PEERS[p].knob.default else " (fixed)"
        else:
            text += f"{c.unit}, chosen on the profile half at {c.cache_blocks} blocks"
            if c.hindsight_best is not None:
                best = c.hindsight_best
                gain = 100 * (c.hindsight[best] - c.hindsight[c.chosen])
                text += f"; hindsight best on the evaluated half: {best:g}{c.unit} (+{gain:.2f} points there)"
        lines.append(text)
    return lines


def format_table(
    results: Sequence[RunResult],
    unique_blocks: dict[str, int] | None = None,
    choices: dict[str, dict[str, Any]] | None = None,
) -> str:
    lines = []
    for trace in dict.fromkeys(r.trace for r in results):
        rs = [r for r in results if r.trace == trace]
        sizes = sorted({r.cache_blocks for r in rs if r.policy != "infinite"})
        policies = list(dict.fromkeys(r.policy for r in rs))
        lines.append(f"trace {trace}: token hit rate % (block hit rate %) [share of the LRU->OPT gap closed]")
        uniq = (unique_blocks or {}).get(trace)
        head = f"{'policy':<12}" + "".join(
            f"{(f'{n} blk' + (f' ({100 * n / uniq:.0f}%)' if uniq else '')):>26}" for n in sizes
        ) + f"{'mean gap closed':>17}"
        lines.append(head)
        by = {(r.policy, r.cache_blocks): r for r in rs}
        for p in policies:
            if p == "infinite":
                inf = next(r for r in rs if r.policy == "infinite")
                lines.append(
                    f"{p:<12}{f'{100 * inf.token_hit_rate:.2f} ({100 * inf.block_hit_rate:.2f}) at any size':>26}"
                )
                continue
            cells = []
            gaps = []
            for n in sizes:
                r = by.get((p, n))
                if r is None:
                    cells.append(f"{'-':>26}")
                    continue
                g = gap_closed(results, r)
                gs = f" [{100 * g:+.1f}%]" if g is not None and p not in ("lru", "opt") else ""
                if gs:
                    gaps.append(g)
                cells.append(f"{f'{100 * r.token_hit_rate:.2f} ({100 * r.block_hit_rate:.2f}){gs}':>26}")
            cells.append(f"{f'{100 * sum(gaps) / len(gaps):+.1f}%':>17}" if gaps else "")
            hinted = any(r.extra.get("client_hints") for r in rs if r.policy == p)
            lines.append(f"{p + ('*' if hinted else ''):<12}" + "".join(cells))
        over = {r.cache_blocks: r.overflow for r in rs if r.policy == "lru"}
        if any(over.values()):
            lines.append(
                "overflow (requests whose pinned blocks did not fit, counted as misses): "
                + ", ".join(f"{n} blk: {o}" for n, o in sorted(over.items()))
            )
        lines.extend(_peer_notes(rs, (choices or {}).get(trace)))
        lines.extend(_calibration_notes(rs))
        lines.append("")
    return "\n".join(lines)


def _calibration_notes(rs: Sequence[RunResult]) -> list[str]:
    """Per ``wa-online`` run: each candidate that ran, its real-cache hit rate on
    the sampled blocks against its miniature cache's prediction (the tuner's
    real-cache check), over the whole run."""
    lines = []
    for r in sorted(rs, key=lambda r: r.cache_blocks):
        cal = r.extra.get("calibration")
        if r.policy != "wa-online" or not cal:
            continue
        parts = [
            f"{name} {100 * c['real_hit_rate']:.2f} vs {100 * c['predicted_hit_rate']:.2f}"
            for name, c in cal.items()
            if c.get("lookups")
        ]
        checks = sum(1 for sw in r.extra.get("switches", ()) if sw.get("reason") == "real-check")
        lines.append(
            f"  wa-online at {r.cache_blocks} blk, real cache vs prediction on the sampled blocks (%): "
            + "; ".join(parts)
            + (f"; {checks} real-check demotion(s)" if checks else "")
        )
    return lines


def write_json(results: Sequence[RunResult], path: str, meta: dict[str, Any] | None = None) -> None:
    with atomic_write(path, encoding="utf-8") as f:  # an interrupted write leaves the old file
        json.dump({"meta": meta or {}, "results": records(results)}, f, indent=1)


def _style(policy: str) -> dict[str, Any]:
    """LRU, the baseline, dashed black and drawn on top: a policy that equals it
    at some size would otherwise hide it."""
    if policy == "lru":
        return {"color": "black", "linestyle": "--", "marker": "x", "zorder": 3}
    return {"marker": "o"}


def plot(results: Sequence[RunResult], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r.trace for r in results))
    windows = any(r.windows for r in results)
    rows = 2 if windows else 1
    fig, axes = plt.subplots(rows, len(traces), figsize=(6 * len(traces), 4.2 * rows), squeeze=False)
    for col, trace in enumerate(traces):
        ax = axes[0][col]
        rs = [r for r in results if r.trace == trace]
        for p in dict.fromkeys(r.policy for r in rs):
            pts = sorted((r.cache_blocks, 100 * r.token_hit_rate) for r in rs if r.policy == p)
            if p == "infinite":
                ax.axhline(pts[0][1], color="gray", linestyle=":", label="infinite")
                continue
            ax.plot([x for x, _ in pts], [y for _, y in pts], label=p, **_style(p))
        ax.set_xlabel("cache size (blocks)")
        ax.set_ylabel("token hit rate (%)")
        ax.set_title(title or trace)
        ax.grid(alpha=0.3)
        ax.legend()
        if windows:
            ax2 = axes[1][col]
            sized = [r.cache_blocks for r in rs if r.windows and r.policy != "infinite"]
            if not sized:  # only the infinite cache has windows: nothing to compare over time
                continue
            size = min(sized)
            for r in rs:
                if r.windows and r.cache_blocks == size:
                    ax2.plot(
                        [w["start"] for w in r.windows],
                        [100 * w["token_hit_rate"] for w in r.windows],
                        label=r.policy,
                        **{k: v for k, v in _style(r.policy).items() if k != "marker"},
                    )
            ax2.set_xlabel("trace time (s)")
            ax2.set_ylabel(f"windowed token hit rate (%), {size} blocks")
            ax2.grid(alpha=0.3)
            ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""The freshest copy of each engine's metrics, across several API servers.

With ``--api-server-count`` > 1 (or data parallelism) every API-server
process polls the engine cores on its own schedule and keeps its own copy,
and each scrape of ``/metrics`` lands on one of them.  Rendered from the
answering process's copy, a counter could read lower than the scrape before
(a copy up to one poll older), which Prometheus takes for a reset.  So each
process publishes its copy's metrics in vLLM's ``PROMETHEUS_MULTIPROC_DIR``
(one small file per process, replaced atomically at every poll), and a
scrape renders, per engine, the freshest copy any process has: the one with
the latest engine start, then the highest snapshot number.  A counter then
never goes back between scrapes, whichever process answers them.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any

from vllm_wa.fileio import atomic_write

logger = logging.getLogger(__name__)

_PREFIX = "vllm_wa_metrics_"


def freshness(metrics: dict[str, Any]) -> tuple[float, int]:
    """How fresh an engine's metrics are: ``(engine start, snapshot number)``; older copies sort lower."""
    f = metrics.get("freshness")
    if isinstance(f, list) and len(f) == 2 and all(isinstance(x, (int, float)) for x in f):
        return float(f[0]), int(f[1])
    return (-1.0, -1)


class SharedCopies:
    """This process's copy of the engines' metrics, published beside the other API servers'."""

    def __init__(self, folder: str, pid: int | None = None) -> None:
        self.folder = folder
        self.path = os.path.join(folder, f"{_PREFIX}{pid if pid is not None else os.getpid()}.json")
        self.write_errors = 0

    def publish(self, engines: list[dict[str, Any]] | None) -> None:
        """Replace this process's file with the metrics of ``engines`` (a poll's result)."""
        metrics = [e["metrics"] for e in engines or () if isinstance(e, dict) and e.get("enabled")]
        try:
            # Renamed into place, not synced to disk: this runs on the API
            # server's event loop at every poll, and a copy lost in a crash is
            # replaced at the next poll.
            with atomic_write(self.path, "w", encoding="utf-8", durable=False) as f:
                json.dump(metrics, f)
        except (OSError, ValueError) as e:
            self.write_errors += 1
            if self.write_errors == 1:
                logger.warning("vllm-wa: cannot share metrics in %s (%s); scrapes use this process's copy", self.folder, e)

    def freshest(self, own: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """Per engine, the freshest metrics of this process's copy and every published one,
        as snapshots (``{"enabled": True, "metrics": ...}``) in engine order."""
        best: dict[Any, dict[str, Any]] = {}

        def offer(m: Any) -> None:
            if isinstance(m, dict):
                key = m.get("engine")
                if key not in best or freshness(m) > freshness(best[key]):
                    best[key] = m

        for e in own or ():
            if isinstance(e, dict) and e.get("enabled"):
                offer(e.get("metrics"))
        for path in glob.glob(os.path.join(glob.escape(self.folder), f"{_PREFIX}*.json")):
            if path == self.path:
                continue  # this process's copy, offered above from memory
            try:
                with open(path, encoding="utf-8") as f:
                    copies = json.load(f)
            except (OSError, ValueError):
                continue  # being replaced, or not ours to read: the others still count
            for m in copies if isinstance(copies, list) else ():
                offer(m)
        order = sorted(best, key=lambda k: (not isinstance(k, int), k if isinstance(k, int) else str(k)))
        return [{"enabled": True, "metrics": best[k]} for k in order]

"""Progress bars for long replays: one line per running run, redrawn in place.

A sweep's runs execute in worker processes; each reports how many requests it
has replayed through a queue, and a thread in the parent draws the bars on
stderr. Nothing is drawn (and no queue or thread exists) unless the stream is
a terminal, so logs and pipes stay clean.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

# Report at most this often from a run (requests), and redraw at most this often (s).
REPORT_EVERY = 256
REDRAW_S = 0.25


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


@dataclass
class _Bar:
    label: str
    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)

    def render(self, width: int = 24) -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * width)
        elapsed = time.monotonic() - self.started
        eta = elapsed / self.done * (self.total - self.done) if self.done else None
        eta_s = _clock(eta) if eta is not None else "?"
        return (
            f"{self.label:<28} |{'#' * filled}{'.' * (width - filled)}| {self.done:>7}/{self.total} requests"
            f"  {_clock(elapsed)} elapsed, ~{eta_s} left"
        )


class ProgressBoard:
    """Draws one bar per active run; ``write`` prints a line above them.

    Args:
        stream: where to draw (default stderr).
        enabled: draw at all (default: when ``stream`` is a terminal).
    """

    def __init__(self, stream: IO[str] | None = None, enabled: bool | None = None) -> None:
        self._stream = stream
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self._bars: dict[Any, _Bar] = {}
        self._drawn = 0
        self._last_draw = 0.0
        self._lock = threading.Lock()
        self._queue: Any = None
        self._thread: threading.Thread | None = None

    @property
    def stream(self) -> IO[str]:
        """Where lines go: the given stream, else the process's stderr of the moment."""
        return self._stream if self._stream is not None else sys.stderr

    # ---- events (from this process or, through the queue, from workers) ------------------------

    def start(self, run: Any, label: str, total: int) -> None:
        with self._lock:
            self._bars[run] = _Bar(label, total)
            self._draw(force=True)

    def step(self, run: Any, done: int) -> None:
        with self._lock:
            bar = self._bars.get(run)
            if bar is not None:
                bar.done = done
                self._draw()

    def restart(self, run: Any, label: str) -> None:
        """The run replays the trace again (another pass): its bar starts over under ``label``."""
        with self._lock:
            bar = self._bars.get(run)
            if bar is not None:
                self._bars[run] = _Bar(label, bar.total)
                self._draw(force=True)

    def end(self, run: Any) -> None:
        with self._lock:
            self._bars.pop(run, None)
            self._draw(force=True)

    def write(self, line: str) -> None:
        """A permanent line, printed above the bars (always, even when bars are off)."""
        with self._lock:
            self._clear()
            print(line, file=self.stream, flush=True)
            self._draw(force=True)

    # ---- worker processes ------------------------------------------------------------------

    def open_queue(self, ctx: Any) -> Any:
        """A queue worker processes post events to (None when off); create it before forking."""
        if not self.enabled:
            return None
        self._queue = ctx.Queue()
        return self._queue

    def drain_in_background(self) -> None:
        """Draw what the queue brings, from a thread (start it after forking the workers)."""
        if self._queue is not None and self._thread is None:
            self._thread = threading.Thread(target=self._drain, name="replay-progress", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop draining and erase the bars (the board can be used again)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
        self._queue = None
        with self._lock:
            self._bars.clear()
            self._clear()

    def _drain(self) -> None:
        while True:
            msg = self._queue.get()
            if msg is None:
                return
            kind, run, *args = msg
            getattr(self, kind)(run, *args)

    # ---- drawing -----------------------------------------------------------------------------

    def _clear(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < REDRAW_S:
            return
        self._last_draw = now
        self._clear()
        lines = [bar.render() for bar in self._bars.values()]
        if lines:
            self.stream.write("\n".join(lines) + "\n")
            self._drawn = len(lines)
        self.stream.flush()


class RunReporter:
    """A run's side: counts replayed requests and posts them to a board or a queue."""

    def __init__(self, sink: Any, run: Any, label: str, total: int) -> None:
        self.sink, self.run, self.label, self.done = sink, run, label, 0
        self._post("start", label, total)

    def _post(self, kind: str, *args: Any) -> None:
        if isinstance(self.sink, ProgressBoard):
            getattr(self.sink, kind)(self.run, *args)
        else:
            self.sink.put((kind, self.run, *args))

    def __call__(self, n: int) -> None:
        self.done += n
        self._post("step", self.done)

    def new_pass(self, what: str) -> None:
        """The run starts another pass over the trace (``what`` names it): the bar starts over."""
        self.done = 0
        self._post("restart", f"{self.label} ({what})")

    def close(self) -> None:
        self._post("end")

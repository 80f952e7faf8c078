"""What one benchmark run measured: a record per request, and the server's counters.

Written as JSON (``RunResult.write``) even when the run fails or is
interrupted, so nothing measured is lost.  ``vllm_wa.replay.served`` reads the
same file to replay exactly the requests the server saw; the field names below
are that interface.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from vllm_wa.served_format import FORMAT, VERSION


@dataclass
class RequestRecord:
    """One request as sent and as answered.  Times: seconds since the run started (client clock)."""

    index: int
    request_id: str
    conversation: int
    tag: str
    outcome_hint: str | None
    hash_ids: list[int]
    input_tokens: int
    max_tokens: int
    planned: float  # when the closed loop let it go: the trace's arrival, or the reply before plus the think time
    sent: float | None = None
    first_token: float | None = None
    done: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    server_ttft_ms: float | None = None  # scheduling -> first token (vLLM's per-request metrics)
    server_queue_ms: float | None = None  # arrival at the engine -> scheduling
    server_generation_ms: float | None = None  # first -> last token
    error: str | None = None
    scheduled: float | None = None  # the trace's arrival x the time scale (None in files from before it was kept)

    @property
    def ok(self) -> bool:
        return self.error is None and self.done is not None

    @property
    def client_ttft_s(self) -> float | None:
        if self.sent is None or self.first_token is None:
            return None
        return self.first_token - self.sent

    @property
    def e2e_s(self) -> float | None:
        if self.sent is None or self.done is None:
            return None
        return self.done - self.sent

    @property
    def behind_schedule_s(self) -> float | None:
        """How much later than the trace's arrival it was sent (client seconds): the server's lag, carried by the closed loop."""
        if self.sent is None or self.scheduled is None:
            return None
        return max(0.0, self.sent - self.scheduled)

    @property
    def qttft_ms(self) -> float | None:
        if self.server_ttft_ms is None or self.server_queue_ms is None:
            return None
        return self.server_ttft_ms + self.server_queue_ms


@dataclass
class RunResult:
    """One run of the client against one server."""

    label: str
    url: str
    trace: str
    block_size: int
    time_scale: float
    max_output_tokens: int
    slice_notes: list[str] = field(default_factory=list)
    server: dict[str, Any] = field(default_factory=dict)
    unique_blocks: int = 0
    excluded_too_long: int = 0
    started_unix: float = 0.0
    wall_s: float = 0.0
    interrupted: bool = False
    stop_reason: str = ""
    outcome_hints: bool = True
    metrics_before: dict[str, Any] = field(default_factory=dict)
    metrics_after: dict[str, Any] = field(default_factory=dict)
    wa_before: list[dict[str, Any]] | None = None
    wa_after: list[dict[str, Any]] | None = None
    requests: list[RequestRecord] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = {"format": FORMAT, "version": VERSION}
        d.update({f.name: getattr(self, f.name) for f in fields(self) if f.name != "requests"})
        d["requests"] = [asdict(r) for r in self.requests]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunResult:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} result (no 'format': {FORMAT!r})")
        if d.get("version") != VERSION:
            raise ValueError(f"unsupported {FORMAT} version {d.get('version')!r}; expected {VERSION}")
        names = {f.name for f in fields(cls)} - {"requests"}
        out = cls(**{k: v for k, v in d.items() if k in names})
        rnames = {f.name for f in fields(RequestRecord)}
        out.requests = [RequestRecord(**{k: v for k, v in r.items() if k in rnames}) for r in d.get("requests", [])]
        return out

    def write(self, path: str) -> None:
        """Atomic: a reader sees the old file or the new one."""
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, separators=(",", ":"))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: str) -> RunResult:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))

"""The asynchronous streaming client of ``vllm-wa bench-serve``.

Every conversation of the workload is one task that sends its turns in
order, closed-loop (see :mod:`vllm_wa.bench.workload`), to ``/v1/completions``
with the prompt as token ids, ``ignore_eos`` (both servers generate the same
number of tokens), ``stream_options.include_usage`` (cached prompt tokens and
vLLM's per-request metrics ride on the last chunk), the workload tag in
``vllm_xargs.type_info`` and, as a benchmark hook, the trace's reply outcome
in ``vllm_xargs.wa_outcome``.

A failed request is recorded and counted; its conversation goes on.  When the
run is cancelled (Ctrl-C, SIGTERM) the records so far are kept and the
server's counters are read once more, so the caller can write them.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from vllm_wa.bench.results import RequestRecord, RunResult
from vllm_wa.bench.server_info import BenchError, check_block_size, probe, scrape, wa_state
from vllm_wa.bench.workload import BenchRequest, Workload, build_workload
from vllm_wa.replay.trace import Trace
from vllm_wa.sim.token_ids import prompt_token_ids

HINT_KEY = "wa_outcome"  # vllm_xargs field read by vllm_wa.serving.outcome_hints
TAG_KEY = "type_info"


@dataclass(frozen=True)
class ClientConfig:
    url: str
    api_key: str | None = None
    model: str | None = None
    time_scale: float = 1.0
    max_output_tokens: int = 16
    outcome_hints: bool = True
    request_timeout_s: float = 600.0
    label: str = "run"
    progress: bool | None = None  # None: when stderr is a terminal
    # Stop the run after this many requests in a row could not reach the server.
    max_consecutive_unreachable: int = 20

    def __post_init__(self) -> None:
        if not 0 < self.time_scale < math.inf:
            raise ValueError(f"time scale must be a positive number, got {self.time_scale}")
        if not 0 < self.request_timeout_s < math.inf:
            raise ValueError(f"request timeout must be a positive number of seconds, got {self.request_timeout_s}")
        if self.max_output_tokens < 1:
            raise ValueError(f"max output tokens must be at least 1, got {self.max_output_tokens}")


class _Progress:
    """A tqdm bar on a terminal, nothing otherwise."""

    def __init__(self, total: int, label: str, enabled: bool | None) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"bench-serve {label}", unit="req", file=sys.stderr, dynamic_ncols=True)
        self.failed = 0
        self.cached = 0
        self.prompt = 0

    def update(self, rec: RequestRecord) -> None:
        if rec.error is not None:
            self.failed += 1
        else:
            self.cached += rec.cached_tokens or 0
            self.prompt += rec.prompt_tokens or 0
        if self.bar is not None:
            hit = 100.0 * self.cached / self.prompt if self.prompt else 0.0
            self.bar.set_postfix(hit=f"{hit:.1f}%", failed=self.failed, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class BenchClient:
    """Runs one workload against one server; ``result`` holds what was measured so far."""

    def __init__(self, cfg: ClientConfig, trace: Trace, slice_notes: list[str] | None = None) -> None:
        self.cfg = cfg
        self.trace = trace
        self.base = cfg.url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.run_id = uuid.uuid4().hex[:8]
        self.result = RunResult(
            label=cfg.label,
            url=self.base,
            trace=trace.name,
            block_size=trace.block_size,
            time_scale=cfg.time_scale,
            max_output_tokens=cfg.max_output_tokens,
            slice_notes=list(slice_notes if slice_notes is not None else trace.notes),
            outcome_hints=cfg.outcome_hints,
        )
        self.workload: Workload | None = None
        self._unreachable = 0
        self._stop: asyncio.Event | None = None
        self._t0 = 0.0

    def _client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        timeout = httpx.Timeout(self.cfg.request_timeout_s, connect=10.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        return httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits)

    async def prepare(self, client: httpx.AsyncClient) -> Workload:
        """Probe the server and build the workload it can serve (raises :class:`BenchError`)."""
        info = await probe(client, self.base, self.cfg.model)
        check_block_size(info, self.trace.block_size)
        try:
            w = build_workload(self.trace, self.cfg.max_output_tokens, info.max_model_len)
        except ValueError as e:
            raise BenchError(str(e)) from None
        self.result.server = info.to_json()
        self.result.unique_blocks = w.unique_blocks()
        self.result.excluded_too_long = w.excluded_too_long
        self.result.slice_notes = list(w.notes)
        self.workload = w
        return w

    async def run(self, on_record: Callable[[RequestRecord], None] | None = None) -> RunResult:
        """Probe, scrape, replay every conversation, scrape again.

        Cancellation (Ctrl-C) ends the replay early with ``result.interrupted``
        set; the counters are still read afterwards, then the cancellation
        propagates.
        """
        res = self.result
        async with self._client() as client:
            w = await self.prepare(client)
            model = res.server["model"]
            res.metrics_before = (await scrape(client, self.base)).to_json()
            res.wa_before = await wa_state(client, self.base)
            res.started_unix = time.time()
            loop = asyncio.get_running_loop()
            self._t0 = loop.time()
            self._stop = asyncio.Event()
            progress = _Progress(len(w.requests), self.cfg.label, self.cfg.progress)

            def record(rec: RequestRecord) -> None:
                progress.update(rec)
                if on_record is not None:
                    on_record(rec)

            tasks = [
                asyncio.create_task(self._conversation(client, model, [w.requests[i] for i in idx], record))
                for idx in w.conversations.values()
            ]
            cancelled = False
            all_done = asyncio.gather(*tasks, return_exceptions=True)
            stop_wait = asyncio.ensure_future(self._stop.wait())
            try:
                await asyncio.wait({all_done, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                cancelled = True
                res.interrupted = True
                res.stop_reason = res.stop_reason or "interrupted"
            finally:
                stop_wait.cancel()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(all_done, return_exceptions=True)
                progress.close()
                res.wall_s = loop.time() - self._t0
                res.requests.sort(key=lambda r: r.index)
                try:
                    res.metrics_after = (await asyncio.wait_for(scrape(client, self.base), 30)).to_json()
                    res.wa_after = await asyncio.wait_for(wa_state(client, self.base), 30)
                except (BenchError, TimeoutError) as e:
                    res.stop_reason = (res.stop_reason + "; " if res.stop_reason else "") + f"final scrape failed: {e}"
            for t in tasks:
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # a bug, not a failed request
            if cancelled:
                raise asyncio.CancelledError
            if self._stop.is_set() and not res.interrupted:
                res.interrupted = True
        return res

    async def _conversation(
        self,
        client: httpx.AsyncClient,
        model: str,
        turns: list[BenchRequest],
        record: Callable[[RequestRecord], None],
    ) -> None:
        loop = asyncio.get_running_loop()
        s = self.cfg.time_scale
        prev_end: float | None = None
        for req in turns:
            at = self._t0 + s * req.arrival
            if prev_end is not None:
                at = max(at, prev_end + s * req.think)
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = RequestRecord(
                index=req.index,
                request_id=f"wab-{self.run_id}-{req.index}",
                conversation=req.conversation,
                tag=req.tag,
                outcome_hint=req.outcome if self.cfg.outcome_hints else None,
                hash_ids=list(req.hash_ids),
                input_tokens=req.input_tokens,
                max_tokens=req.max_tokens,
                planned=at - self._t0,
                scheduled=s * req.arrival,
            )
            self.result.requests.append(rec)
            await self._send(client, model, req, rec)
            record(rec)
            prev_end = loop.time()
            if self._stop is not None and self._stop.is_set():
                return

    def _body(self, model: str, req: BenchRequest, rec: RequestRecord) -> dict[str, Any]:
        xargs: dict[str, Any] = {TAG_KEY: req.tag}
        if rec.outcome_hint is not None:
            xargs[HINT_KEY] = rec.outcome_hint
        return {
            "model": model,
            "prompt": prompt_token_ids(req.hash_ids, self.trace.block_size, req.input_tokens),
            "max_tokens": req.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "request_id": rec.request_id,
            "vllm_xargs": xargs,
        }

    async def _send(self, client: httpx.AsyncClient, model: str, req: BenchRequest, rec: RequestRecord) -> None:
        loop = asyncio.get_running_loop()
        try:
            body = self._body(model, req, rec)
        except ValueError as e:  # a prompt its hash ids cannot spell (workload.build_workload fits them)
            rec.error = f"cannot build the prompt: {e}"[:300]
            return
        rec.sent = loop.time() - self._t0
        answered = False
        try:
            # The whole request, stream included, within the timeout: httpx's
            # own limits each read, and a reply that keeps streaming never ends.
            async with asyncio.timeout(self.cfg.request_timeout_s):
                async with client.stream("POST", self.base + "/v1/completions", json=body) as r:
                    answered = True
                    self._unreachable = 0  # the server answered, whatever it said
                    if r.status_code != 200:
                        text = (await r.aread()).decode("utf-8", "replace")
                        rec.error = f"HTTP {r.status_code}: {text[:300]}"
                        return
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        payload = line[6:].strip()
                        if payload == "[DONE]":
                            break
                        self._on_chunk(json.loads(payload), rec, loop.time() - self._t0)
                        if rec.error is not None:
                            return
            if rec.prompt_tokens is None:
                rec.error = "the stream ended without a usage chunk (is stream_options.include_usage honoured?)"
            elif rec.first_token is None:
                rec.error = "the stream ended without a token"
            elif rec.finish_reason == "abort" or (
                rec.completion_tokens is not None and rec.completion_tokens < rec.max_tokens
            ):
                # ignore_eos: a whole reply is max_tokens long; a shorter one was cut off.
                rec.error = (
                    f"the reply ended early: {rec.completion_tokens} of {rec.max_tokens} tokens, "
                    f"finish_reason {rec.finish_reason!r}"
                )
            else:
                rec.done = loop.time() - self._t0
        except TimeoutError:
            rec.error = f"no whole reply within the request timeout ({self.cfg.request_timeout_s:g} s)"
        except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as e:
            rec.error = f"{type(e).__name__}: {e}"[:300]
            if isinstance(e, httpx.TransportError) and not answered:
                # Refused, or accepted and dropped by a server going down: either
                # way no answer came, and a run of them means the server is gone.
                rec.error = f"cannot reach the server: {rec.error}"[:300]
                self._unreachable += 1
                if self._unreachable >= self.cfg.max_consecutive_unreachable and self._stop is not None:
                    self.result.stop_reason = (
                        f"stopped: {self._unreachable} requests in a row could not reach the server"
                    )
                    self._stop.set()

    @staticmethod
    def _on_chunk(d: Any, rec: RequestRecord, now: float) -> None:
        """Read one stream chunk into ``rec``; a chunk of another shape is the request's error."""
        if not isinstance(d, dict):
            rec.error = f"unexpected stream chunk {str(d)[:100]}"
            return
        if "error" in d:
            err = d["error"]
            rec.error = f"server error in the stream: {err.get('message', err) if isinstance(err, dict) else err}"[:300]
            return
        choices = d.get("choices") or []
        usage = d.get("usage")
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        if (
            not isinstance(choices, list)
            or not all(isinstance(c, dict) for c in choices)
            or not (usage is None or isinstance(usage, dict))
            or not (details is None or isinstance(details, dict))
        ):
            rec.error = f"malformed stream chunk {json.dumps(d)[:100]}"
            return
        if choices and rec.first_token is None:
            rec.first_token = now
        for c in choices:
            if c.get("finish_reason"):
                rec.finish_reason = str(c["finish_reason"])[:40]
        if usage:
            counts = (usage.get("prompt_tokens"), usage.get("completion_tokens"), (details or {}).get("cached_tokens"))
            if not all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in counts):
                rec.error = f"malformed usage {json.dumps(usage)[:100]}"
                return
            rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = counts
        m = d.get("metrics")
        if isinstance(m, dict):
            rec.server_ttft_ms = _ms(m.get("time_to_first_token_ms"))
            rec.server_queue_ms = _ms(m.get("queue_time_ms"))
            rec.server_generation_ms = _ms(m.get("generation_time_ms"))


def _ms(v: Any) -> float | None:
    """A finite, non-negative time in ms, or None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and v >= 0 else None

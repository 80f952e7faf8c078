"""The API-server side of ``--wa-online``: ``/wa/params``, metrics, reply outcomes.

* One background task fetches every engine core's state and metrics once per
  interval (:mod:`vllm_wa.serving.snapshots`); ``GET /wa/params``
  (:mod:`vllm_wa.serving.params_api`) and the ``vllm_wa_*`` metrics on
  vLLM's own ``/metrics`` (:mod:`vllm_wa.serving.metrics`) read that copy.
* Chat completions are watched for replies that called a tool; the outcome is
  reported to the engine cores so the request's freed blocks join the right
  class (the engine frees them a moment before the reply is parsed).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
from typing import Any

from vllm_wa.engine_patch.block_tagger import MAX_LATE_FACT_ID
from vllm_wa.serving import metrics
from vllm_wa.serving.api_metrics import api_counters
from vllm_wa.serving.params_api import make_router
from vllm_wa.serving.settings import MAX_OUTCOME_REPORTS_PER_CALL, ServingSettings
from vllm_wa.serving.shared_metrics import SharedCopies
from vllm_wa.serving.snapshots import EngineSnapshots

logger = logging.getLogger(__name__)
# Outcome facts waiting for the next batch, at most (more are counted as dropped).
MAX_PENDING_REPORTS = 100_000
_WRAPPED = "__vllm_wa_wrapped__"


# ---- engine access --------------------------------------------------------------------------


async def call_engines(engine_client: Any, method: str, *args: Any) -> list[Any]:
    """Call a ``wa_*`` utility on every engine core this API server manages."""
    return await engine_client.engine_core.call_utility_all_async(method, *args)


# The engines' state as this API server last fetched it (routes and /metrics read it).
_SNAPSHOTS: EngineSnapshots | None = None


# ---- reply outcomes ------------------------------------------------------------------------------


# Why a report under an over-long id is dropped (in report and send_hints).
_LONG_ID = f"a request id is longer than {MAX_LATE_FACT_ID} characters"


class OutcomeReporter:
    """Batches (external request id, outcome) facts to the engine cores."""

    def __init__(self, engine_client: Any, flush_interval: float = 0.2) -> None:
        self.engine_client = engine_client
        self.flush_interval = flush_interval
        self._pending: list[list[str]] = []
        self.reported = 0
        self.dropped = 0  # facts lost: the buffer was full, or the engines refused a batch

    def report(self, request_id: str, outcome: str) -> None:
        if len(request_id) > MAX_LATE_FACT_ID:
            # The client chose the id's length; no engine remembers a release under it.
            self._drop(1, _LONG_ID)
        elif len(self._pending) < MAX_PENDING_REPORTS:
            self._pending.append([request_id, outcome])
        else:
            self._drop(1, "the report buffer is full")

    def _drop(self, n: int, why: str) -> None:
        if not self.dropped:
            logger.warning("vllm-wa: outcome reports lost (%s); counting further losses silently", why)
        self.dropped += n
        api_counters().reports_dropped.inc(n)

    def _sent(self, n: int) -> None:
        self.reported += n
        api_counters().reports_sent.inc(n)

    async def send_hints(self, items: list[list[str]]) -> int:
        """Send facts about calls not yet made at once, not in the next batch:
        a benchmark outcome hint must reach the engine before its request
        does, and applies to the next call released under its id only
        (``wa_expect_outcomes``; see ``outcome_hints``).  At most
        ``MAX_OUTCOME_REPORTS_PER_CALL`` a call, as the batches (a completion
        of many prompts has a fact for each).  Returns the facts sent."""
        usable = [item for item in items if len(item[0]) <= MAX_LATE_FACT_ID]
        if len(usable) < len(items):
            self._drop(len(items) - len(usable), _LONG_ID)
        items = usable
        for start in range(0, len(items), MAX_OUTCOME_REPORTS_PER_CALL):
            chunk = items[start : start + MAX_OUTCOME_REPORTS_PER_CALL]
            try:
                await call_engines(self.engine_client, "wa_expect_outcomes", chunk)
            except Exception as e:
                self._drop(len(items) - start, f"the engines refused a report: {e}")
                raise
            self._sent(len(chunk))
        return len(items)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            if not self._pending:
                continue
            batch = self._pending[:MAX_OUTCOME_REPORTS_PER_CALL]
            del self._pending[:MAX_OUTCOME_REPORTS_PER_CALL]
            try:
                await call_engines(self.engine_client, "wa_report_outcomes", batch)
                self._sent(len(batch))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                self._drop(len(batch), f"the engines refused a batch: {e}")


_REPORTER: OutcomeReporter | None = None


def api_state() -> dict[str, Any]:
    """This API server's own counters (``GET /wa/params`` shows them beside the engines')."""
    reporter = _REPORTER
    return {
        "outcome_reports_sent": reporter.reported if reporter is not None else 0,
        "outcome_reports_dropped": reporter.dropped if reporter is not None else 0,
    }


def _chat_outcomes(result: Any) -> tuple[str | None, bool]:
    """(response id, whether a reply called a tool) of a non-streaming chat response."""
    rid = getattr(result, "id", None)
    called = any(getattr(getattr(c, "message", None), "tool_calls", None) for c in getattr(result, "choices", ()))
    return rid, called


def _wrap_chat(orig: Any) -> Any:
    @functools.wraps(orig)
    async def create_chat_completion(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = await orig(self, request, *args, **kwargs)
        reporter = _REPORTER
        if reporter is None:
            return result
        if hasattr(result, "__aiter__"):
            return _watch_stream(result, reporter)
        try:
            rid, called = _chat_outcomes(result)
            if rid and called:
                reporter.report(rid, "tool")
        except Exception:  # noqa: BLE001 - never break a reply
            pass
        return result

    setattr(create_chat_completion, _WRAPPED, orig)
    return create_chat_completion


async def _watch_stream(stream: Any, reporter: OutcomeReporter) -> Any:
    """Pass a streamed chat through; report it once it ends if a delta called a tool.

    A chunk is parsed only for the response id (the first) or when it names
    ``"tool_calls"`` (a key: in a string its quotes are escaped), so a long
    plain reply costs a substring search a chunk, not a JSON parse.
    """
    rid, called = None, False
    try:
        async for chunk in stream:
            if (
                not called
                and isinstance(chunk, str)
                and chunk.startswith("data: {")
                and (rid is None or '"tool_calls"' in chunk)
            ):
                try:
                    d = json.loads(chunk[6:])
                    rid = d.get("id", rid)
                    called = any((c.get("delta") or {}).get("tool_calls") for c in d.get("choices", ()))
                except (ValueError, AttributeError):
                    pass
            yield chunk
    finally:
        if rid and called:
            reporter.report(rid, "tool")


# ---- installation --------------------------------------------------------------------------------


def _wrap_attach(orig: Any, settings: ServingSettings, snapshots: EngineSnapshots) -> Any:
    max_classes = settings.controller_config().max_classes

    @functools.wraps(orig)
    def attach_endpoint_plugins(app: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(app, *args, **kwargs)
        app.include_router(make_router(settings, snapshots, max_classes, api_state))
        return out

    setattr(attach_endpoint_plugins, _WRAPPED, orig)
    return attach_endpoint_plugins


def _wrap_init_state(orig: Any, snapshots: EngineSnapshots) -> Any:
    @functools.wraps(orig)
    async def init_endpoint_plugins_state(engine_client: Any, state: Any, args: Any, *a: Any, **kw: Any) -> Any:
        global _REPORTER
        out = await orig(engine_client, state, args, *a, **kw)
        if engine_client is not None:
            _REPORTER = OutcomeReporter(engine_client)
            snapshots.bind(functools.partial(call_engines, engine_client, "wa_get_snapshot"))
            state.vllm_wa_tasks = [
                asyncio.create_task(snapshots.poll()),
                asyncio.create_task(_REPORTER.run()),
            ]
        return out

    setattr(init_endpoint_plugins_state, _WRAPPED, orig)
    return init_endpoint_plugins_state


def install(settings: ServingSettings) -> None:
    """API-server patches (idempotent); only called when ``--wa-online`` is set."""
    global _SNAPSHOTS
    import vllm.entrypoints.launchers.api_server.app_state as app_state
    import vllm.entrypoints.launchers.app as app_mod
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    if _SNAPSHOTS is None:
        api_counters()  # this API server's own series, from zero
        _SNAPSHOTS = EngineSnapshots(settings.snapshot_max_age_s)
        snapshots = _SNAPSHOTS
        folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if folder:
            # Several API servers: each scrape renders the freshest copy any of them has.
            shared = SharedCopies(folder)
            snapshots.on_fetch = shared.publish
            metrics.install(metrics.WACollector(lambda: shared.freshest(snapshots.engines)))
        else:
            metrics.install(metrics.WACollector(lambda: snapshots.engines))
    if getattr(app_mod.attach_endpoint_plugins, _WRAPPED, None) is None:
        app_mod.attach_endpoint_plugins = _wrap_attach(app_mod.attach_endpoint_plugins, settings, _SNAPSHOTS)
    if getattr(app_state.init_endpoint_plugins_state, _WRAPPED, None) is None:
        app_state.init_endpoint_plugins_state = _wrap_init_state(app_state.init_endpoint_plugins_state, _SNAPSHOTS)
    if getattr(OpenAIServingChat.create_chat_completion, _WRAPPED, None) is None:
        OpenAIServingChat.create_chat_completion = _wrap_chat(OpenAIServingChat.create_chat_completion)

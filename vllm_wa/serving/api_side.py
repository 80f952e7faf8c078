"""The API-server side of ``--wa-online``: ``/wa/params``, metrics, reply outcomes.

* ``GET /wa/params`` returns every engine core's controller state;
  ``PUT /wa/params`` pins parameters or returns to automatic mode (refused
  unless ``--wa-allow-pin``; needs vLLM's API key when the server has one).
  Both reach the engine cores through vLLM's utility-call channel.
* A background task polls the engine cores and sets ``vllm_wa_*`` gauges in
  this process, so they appear on vLLM's own ``/metrics``.
* Chat completions are watched for replies that called a tool; the outcome is
  reported to the engine cores so the request's freed blocks join the right
  class (the engine frees them a moment before the reply is parsed).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_wa.serving.settings import ServingSettings

logger = logging.getLogger(__name__)
_WRAPPED = "__vllm_wa_wrapped__"


# ---- engine access --------------------------------------------------------------------------


async def call_engines(engine_client: Any, method: str, *args: Any) -> list[Any]:
    """Call a ``wa_*`` utility on every engine core this API server manages."""
    return await engine_client.engine_core.call_utility_all_async(method, *args)


# ---- /wa/params --------------------------------------------------------------------------------


def _api_key_ok(request: Any) -> bool:
    """The same rule and key source as vLLM's own authentication middleware."""
    from vllm import envs

    args = request.app.state.args
    tokens = [k for k in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if k]
    if not tokens:
        return True
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and any(secrets.compare_digest(token, t) for t in tokens)


def make_router(settings: ServingSettings) -> APIRouter:
    # (FastAPI resolves the handlers' annotations from this module's globals.)
    from vllm_wa.params import ParamsError
    from vllm_wa.serving.engine_side import parse_pin_request

    router = APIRouter()

    @router.get("/wa/params")
    async def get_params(raw_request: Request) -> JSONResponse:
        engines = await call_engines(raw_request.app.state.engine_client, "wa_get_state")
        return JSONResponse({"engines": engines})

    @router.put("/wa/params")
    async def put_params(raw_request: Request) -> JSONResponse:
        if not _api_key_ok(raw_request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        if not settings.allow_pin:
            return JSONResponse(
                {"error": "pinning parameters is disabled; start the server with --wa-allow-pin"},
                status_code=403,
            )
        try:
            body = await raw_request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            return JSONResponse({"error": "the body is not valid JSON"}, status_code=400)
        try:
            parse_pin_request(body)  # validate here: a bad body never reaches an engine
        except (ParamsError, ValueError) as e:
            return JSONResponse({"error": str(e)}, status_code=422)
        results = await call_engines(raw_request.app.state.engine_client, "wa_set_params", body)
        bad = [r for r in results if not r.get("ok")]
        if bad:
            return JSONResponse({"error": bad[0].get("error"), "engines": results}, status_code=bad[0].get("status", 500))
        return JSONResponse({"engines": results})

    return router


# ---- metrics ---------------------------------------------------------------------------------------

CLASS_GAUGES = {
    "reuse_rate": ("vllm_wa_reuse_rate", "Fitted exponential reuse rate of the class (1/s)."),
    "reuse_probability": ("vllm_wa_reuse_probability", "Fitted probability that a freed block of the class is reused."),
    "hit_tokens": ("vllm_wa_prefix_cache_hit_tokens_total", "Prompt tokens that hit the prefix cache, by the request's workload tag."),
    "queried_tokens": ("vllm_wa_prefix_cache_queried_tokens_total", "Prompt tokens looked up in the prefix cache, by the request's workload tag."),
    "evictions": ("vllm_wa_evicted_blocks_total", "Cached blocks of the class evicted from the free queue."),
    "reuses": ("vllm_wa_reused_blocks_total", "Free blocks of the class taken back by a prefix hit."),
    "freed": ("vllm_wa_freed_blocks_total", "Blocks freed into the class."),
}
ENGINE_GAUGES = {
    "params_version": ("vllm_wa_params_version", "Version of the parameters the queue runs."),
    "swaps": ("vllm_wa_param_swaps_total", "Parameter swaps into the live queue."),
    "refits": ("vllm_wa_refits_total", "Controller refits."),
    "errors": ("vllm_wa_controller_errors_total", "Controller refits that failed (last good parameters kept)."),
    "checkpoint_errors": ("vllm_wa_checkpoint_errors_total", "Checkpoint writes that failed."),
    "refit_seconds": ("vllm_wa_refit_duration_seconds", "Wall time of the last controller refit."),
    "events_dropped": ("vllm_wa_events_dropped_total", "Engine events dropped because the event sink was full."),
    "hook_errors": ("vllm_wa_hook_errors_total", "Errors caught in the engine hooks."),
    "tags_invalid": ("vllm_wa_invalid_tags_total", "Requests whose workload tag was invalid."),
    "tags_over_class_cap": ("vllm_wa_tags_over_class_cap_total", "Requests whose new tag exceeded the class cap."),
    "num_classes": ("vllm_wa_classes", "Distinct classes in use."),
}


class WAMetrics:
    """``vllm_wa_*`` gauges in the API server's registry (vLLM's /metrics)."""

    def __init__(self) -> None:
        from prometheus_client import Gauge

        self.poll_failures = 0
        self.per_class = {
            k: Gauge(name, doc, ["engine", "class"], multiprocess_mode="mostrecent")
            for k, (name, doc) in CLASS_GAUGES.items()
        }
        self.per_engine = {
            k: Gauge(name, doc, ["engine"], multiprocess_mode="mostrecent")
            for k, (name, doc) in ENGINE_GAUGES.items()
        }

    def update(self, results: list[dict[str, Any]]) -> None:
        for r in results:
            if not r.get("enabled"):
                continue
            eng = str(r.get("engine", 0))
            for k, g in self.per_engine.items():
                v = r.get(k)
                if isinstance(v, (int, float)):
                    g.labels(engine=eng).set(float(v))
            for cls, vals in r.get("classes", {}).items():
                for k, g in self.per_class.items():
                    v = vals.get(k)
                    if isinstance(v, (int, float)):
                        g.labels(engine=eng, **{"class": cls}).set(float(v))


_METRICS: WAMetrics | None = None


async def _poll_metrics(engine_client: Any, interval: float) -> None:
    global _METRICS
    if _METRICS is None:
        _METRICS = WAMetrics()
    while True:
        try:
            _METRICS.update(await call_engines(engine_client, "wa_get_metrics"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - metrics must not take the server down
            _METRICS.poll_failures += 1
            log = logger.warning if _METRICS.poll_failures == 1 else logger.debug
            log("vllm-wa metrics poll failed (%d so far): %r", _METRICS.poll_failures, e)
        await asyncio.sleep(interval)


# ---- reply outcomes ------------------------------------------------------------------------------


class OutcomeReporter:
    """Batches (external request id, outcome) facts to the engine cores."""

    def __init__(self, engine_client: Any, flush_interval: float = 0.2) -> None:
        self.engine_client = engine_client
        self.flush_interval = flush_interval
        self._pending: list[list[str]] = []
        self.reported = 0

    def report(self, request_id: str, outcome: str) -> None:
        if len(self._pending) < 100_000:
            self._pending.append([request_id, outcome])

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            if not self._pending:
                continue
            batch, self._pending = self._pending, []
            try:
                await call_engines(self.engine_client, "wa_report_outcomes", batch)
                self.reported += len(batch)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                logger.debug("vllm-wa outcome report failed: %s", e)


_REPORTER: OutcomeReporter | None = None


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
    rid, called = None, False
    try:
        async for chunk in stream:
            if not called and isinstance(chunk, str) and chunk.startswith("data: {"):
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


def _wrap_attach(orig: Any, settings: ServingSettings) -> Any:
    @functools.wraps(orig)
    def attach_endpoint_plugins(app: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(app, *args, **kwargs)
        app.include_router(make_router(settings))
        return out

    setattr(attach_endpoint_plugins, _WRAPPED, orig)
    return attach_endpoint_plugins


def _wrap_init_state(orig: Any, settings: ServingSettings) -> Any:
    @functools.wraps(orig)
    async def init_endpoint_plugins_state(engine_client: Any, state: Any, args: Any, *a: Any, **kw: Any) -> Any:
        global _REPORTER
        out = await orig(engine_client, state, args, *a, **kw)
        if engine_client is not None:
            _REPORTER = OutcomeReporter(engine_client)
            state.vllm_wa_tasks = [
                asyncio.create_task(_poll_metrics(engine_client, settings.metrics_interval_s)),
                asyncio.create_task(_REPORTER.run()),
            ]
        return out

    setattr(init_endpoint_plugins_state, _WRAPPED, orig)
    return init_endpoint_plugins_state


def install(settings: ServingSettings) -> None:
    """API-server patches (idempotent); only called when ``--wa-online`` is set."""
    import vllm.entrypoints.launchers.api_server.app_state as app_state
    import vllm.entrypoints.launchers.app as app_mod
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    if getattr(app_mod.attach_endpoint_plugins, _WRAPPED, None) is None:
        app_mod.attach_endpoint_plugins = _wrap_attach(app_mod.attach_endpoint_plugins, settings)
    if getattr(app_state.init_endpoint_plugins_state, _WRAPPED, None) is None:
        app_state.init_endpoint_plugins_state = _wrap_init_state(app_state.init_endpoint_plugins_state, settings)
    if getattr(OpenAIServingChat.create_chat_completion, _WRAPPED, None) is None:
        OpenAIServingChat.create_chat_completion = _wrap_chat(OpenAIServingChat.create_chat_completion)

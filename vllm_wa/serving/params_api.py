"""``GET`` and ``PUT /wa/params`` on the API server.

* ``GET`` answers from the API server's copy of the engines' state (at most
  one poll interval old, never more than one refit interval; see
  :mod:`vllm_wa.serving.snapshots`), so reading it costs the engine loop
  nothing.  It lists every client's tag names, so it needs vLLM's API key
  when the server has one, unless the server runs with ``--wa-public-params``.
* ``PUT`` pins parameters or returns to automatic mode; refused (403) unless
  ``--wa-allow-pin``, and needs the API key when the server has one.  Bodies
  over :data:`MAX_PIN_BODY_BYTES` get 413, bodies that are not JSON (or are
  nested too deeply) 400, and bodies with bad content 422, each with the
  reason; only a valid body reaches the engine cores (vLLM's utility calls).

The API key is checked by vLLM's own ``AuthenticationMiddleware.verify_token``
(SHA-256 of the token, then a constant-time compare), with the keys vLLM
itself uses (``--api-key``, else ``VLLM_API_KEY``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from vllm_wa.params import WAParams
from vllm_wa.serving.pin_request import MAX_PIN_BODY_BYTES, PinRequestError, parse_pin_request
from vllm_wa.serving.settings import ServingSettings
from vllm_wa.serving.snapshots import EngineSnapshots


def api_key_ok(request: Request) -> bool:
    """True when the server has no API key or the request carries one of its keys."""
    from vllm import envs
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    args = getattr(request.app.state, "args", None)
    tokens = [k for k in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if k]
    if not tokens:
        return True
    cached = getattr(request.app.state, "vllm_wa_auth", None)
    if cached is None or cached[0] != tokens:  # hash the keys once, as vLLM's middleware does
        cached = request.app.state.vllm_wa_auth = (tokens, AuthenticationMiddleware(None, tokens))
    return cached[1].verify_token(request.headers)


def _declares_more_than(length: str | None, limit: int) -> bool:
    """Whether a Content-Length header says more than ``limit`` bytes.

    ASCII digits only: ``"²".isdigit()`` is true and ``int("²")`` raises; and
    ``int()`` refuses over 4,300 digits, so leading zeros are dropped and a
    longer number is compared by its length.  Any other header is left to the
    stream's count.
    """
    if length is None or not (length.isascii() and length.isdigit()):
        return False
    digits = length.lstrip("0")
    return len(digits) > len(str(limit)) or int(digits or "0") > limit


async def read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None as soon as it is known to exceed ``limit`` bytes."""
    if _declares_more_than(request.headers.get("content-length"), limit):
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def pin_body(params: WAParams | None, features: tuple[str, ...] | None) -> dict[str, Any]:
    """What the engines get for a checked pin: the parsed body written out again.

    Never the client's own JSON: only what the parser read crosses vLLM's
    msgpack channel, in types it carries (floats, not ints past 2**64; no
    keys the parser ignored).
    """
    if params is None:
        return {"mode": "auto"}
    return {"params": params.to_pr_json(), "features": list(features or ())}


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float as None (JSON has no inf or NaN, and
    Starlette refuses them with an exception instead of an answer)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def render_json(obj: Any) -> bytes:
    """``obj`` as :class:`JSONResponse` renders it, non-finite floats as None."""
    return json.dumps(json_safe(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


@dataclass
class _RenderedEngines:
    """The engines' state as JSON, rendered once per fetch: a GET (public with
    ``--wa-public-params``) then costs a copy, not a walk of every class."""

    engines: list[dict[str, Any]] | None = None
    body: bytes = b"[]"

    def get(self, engines: list[dict[str, Any]]) -> bytes:
        if engines is not self.engines:
            self.body = render_json([e.get("state", e) for e in engines])
            self.engines = engines
        return self.body


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def make_router(
    settings: ServingSettings,
    snapshots: EngineSnapshots,
    max_classes: int,
    api_state: Callable[[], dict[str, Any]] | None = None,
) -> APIRouter:
    """The ``/wa/params`` routes; ``max_classes`` is the engines' class cap (a pin's limit);
    ``api_state``: the answering API server's own counters, shown under ``api_server``."""
    router = APIRouter()
    rendered = _RenderedEngines()

    @router.get("/wa/params")
    async def get_params(raw_request: Request) -> Response:
        if not settings.public_params and not api_key_ok(raw_request):
            return _error(401, "Unauthorized")
        try:
            engines = await snapshots.get()
        except Exception as e:  # noqa: BLE001 - the engines are unreachable: say so
            return _error(503, f"the engine cores did not answer: {type(e).__name__}")
        parts = [b'{"engines":', rendered.get(engines)]
        if api_state is not None:  # this API server's own counters: fresh every time
            parts += [b',"api_server":', render_json(api_state())]
        parts.append(b"}")
        return Response(b"".join(parts), media_type="application/json")

    @router.put("/wa/params")
    async def put_params(raw_request: Request) -> JSONResponse:
        if not api_key_ok(raw_request):
            return _error(401, "Unauthorized")
        if not settings.allow_pin:
            return _error(403, "pinning parameters is disabled; start the server with --wa-allow-pin")
        raw = await read_body(raw_request, MAX_PIN_BODY_BYTES)
        if raw is None:
            return _error(413, f"the body is larger than {MAX_PIN_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except RecursionError:
            return _error(400, "the body is nested too deeply")
        except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return _error(400, "the body is not valid JSON")
        try:
            params, features = parse_pin_request(body, max_classes=max_classes)  # a bad body never reaches an engine
        except PinRequestError as e:
            return _error(e.status, str(e))
        client = raw_request.app.state.engine_client
        try:
            results = await client.engine_core.call_utility_all_async("wa_set_params", pin_body(params, features))
        except Exception as e:  # noqa: BLE001 - an engine core that cannot be reached is not the client's fault
            return _error(503, f"the engine cores did not answer: {type(e).__name__}")
        bad = [r for r in results if not r.get("ok")]
        if bad:
            return _error(bad[0].get("status", 500), bad[0].get("error", "an engine refused"), engines=results)
        try:
            await snapshots.refresh()  # the next GET shows the change
        except Exception:  # noqa: BLE001 - the pin itself succeeded
            pass
        return JSONResponse({"engines": results})

    return router

"""What the client must know about a server before it sends anything.

The probe fails with a :class:`BenchError` that says what to fix: a server
that cannot be reached, one that refuses the API key, one without prefix
caching, or one whose block size differs from the trace's (the synthesized
prompts would then share blocks differently from the trace).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import httpx

from vllm_wa.bench.prom import MetricsSnapshot, parse_metrics


class BenchError(RuntimeError):
    """A benchmark cannot run (or go on); the message says why and what to do."""


@dataclass
class ServerInfo:
    url: str
    model: str
    max_model_len: int | None
    block_size: int | None
    num_gpu_blocks: int | None
    prefix_caching: bool | None
    wa_online: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


async def get_json(client: httpx.AsyncClient, url: str, what: str) -> tuple[int, Any]:
    """``(status, JSON body or None)``; connection problems become a :class:`BenchError`."""
    try:
        r = await client.get(url)
    except httpx.TransportError as e:
        raise BenchError(f"cannot reach the server at {url} ({what}): {type(e).__name__}: {e}") from None
    try:
        body = r.json()
    except ValueError:
        body = None
    return r.status_code, body


async def scrape(client: httpx.AsyncClient, base: str) -> MetricsSnapshot:
    try:
        r = await client.get(base + "/metrics")
    except httpx.TransportError as e:
        raise BenchError(f"cannot reach {base}/metrics: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise BenchError(f"{base}/metrics answered {r.status_code}; the benchmark reads vLLM's counters there")
    try:
        return parse_metrics(r.text)
    except ValueError as e:
        raise BenchError(f"{base}/metrics is not Prometheus text: {e}") from None


async def wa_state(client: httpx.AsyncClient, base: str) -> list[dict[str, Any]] | None:
    """Every engine's ``GET /wa/params`` state, or None on a server without ``--wa-online``."""
    try:
        status, body = await get_json(client, base + "/wa/params", "/wa/params")
    except BenchError:
        return None
    if status != 200 or not isinstance(body, dict) or not isinstance(body.get("engines"), list):
        return None
    return [e for e in body["engines"] if isinstance(e, dict)]


async def probe(client: httpx.AsyncClient, base: str, model: str | None = None) -> ServerInfo:
    """Check the server answers, accepts the key, and read its model and cache configuration."""
    status, body = await get_json(client, base + "/v1/models", "/v1/models")
    if status == 401:
        raise BenchError(f"the server at {base} refused the API key (401 on /v1/models); pass the right --api-key")
    if status != 200 or not isinstance(body, dict) or not body.get("data"):
        raise BenchError(f"{base}/v1/models answered {status}: {str(body)[:200]}; is this a vLLM OpenAI server?")
    models = {m["id"]: m for m in body["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)}
    if not models:
        raise BenchError(f"{base}/v1/models lists no model: {str(body)[:200]}; is this a vLLM OpenAI server?")
    if model is None:
        model = next(iter(models))
    elif model not in models:
        raise BenchError(f"the server does not serve model {model!r}; it serves {sorted(models)}")
    max_len = _int_or_none(models[model].get("max_model_len"))
    snap = await scrape(client, base)
    cc = snap.cache_config
    caching = cc.get("enable_prefix_caching")
    info = ServerInfo(
        url=base,
        model=model,
        max_model_len=max_len,
        block_size=_int_or_none(cc.get("block_size")),
        num_gpu_blocks=_int_or_none(cc.get("num_gpu_blocks")),
        prefix_caching=None if caching is None else caching == "True",
        wa_online=await wa_state(client, base) is not None,
    )
    if info.prefix_caching is False:
        raise BenchError(f"the server at {base} runs without prefix caching; start it with --enable-prefix-caching")
    return info


def check_block_size(info: ServerInfo, trace_block_size: int) -> None:
    """The trace's blocks must be the server's blocks, or prefix sharing would not carry over."""
    if info.block_size is None:
        raise BenchError(
            f"cannot read the server's block size (vllm:cache_config_info on {info.url}/metrics); "
            "the trace's prefix sharing only carries over when both block sizes are equal"
        )
    if info.block_size != trace_block_size:
        raise BenchError(
            f"the trace has {trace_block_size}-token blocks but the server at {info.url} uses {info.block_size}-token "
            f"blocks; start the server with --block-size {trace_block_size}, or re-block the trace with "
            f"--reblock {info.block_size}"
        )

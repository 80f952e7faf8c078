"""Replay exactly what a benchmark server saw (the JSON ``vllm-wa bench-serve`` writes).

``load_served`` turns the client's records into a trace whose requests are
the ones the server completed, with the server's own timing: a request looks
its prompt up when the engine schedules it (send time plus the client's
time to first token minus the server's) and frees its blocks at its last
token (that plus the server's TTFT and generation time).  Failed requests are
left out (counted in the notes).

``ServedEngine`` is the ``--engine vllm`` driver for such traces: vLLM's real
``KVCacheManager`` with the server's block size, the very token ids the
client sent (so even the block hashes equal the server's), and the reply's
tokens occupying KV slots as they did on the server (all generated tokens but
the last), so partly filled reply blocks take space without ever being
prefix hits.  Peer policies are told about the blocks vLLM caches: the full
prompt blocks by their trace hash ids (what the server's lookups match), the
full blocks past them (the prompt's tail filled up by the reply, the reply's
own) by keys of their own request, which no later prompt can hit.

What it cannot model: the exact interleaving of lookups and frees within one
engine step (it orders them by the estimated times above), chunked prefill
spreading a long prompt's allocation over several steps, and preemption.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from vllm.v1.request import Request, RequestStatus

from vllm_wa.fileio import READ_ERRORS, reader_for
from vllm_wa.replay.lifetime import LifetimeModel
from vllm_wa.replay.policies import ReplayPolicy
from vllm_wa.replay.records import MAX_TOKENS, hash_ids, int_field, str_field, token_field
from vllm_wa.replay.trace import Trace, TraceRequest
from vllm_wa.replay.vllm_engine import VLLMEngine
from vllm_wa.served_format import FORMAT, VERSION
from vllm_wa.sim.clock import SettableClock
from vllm_wa.sim.token_ids import FIRST_TOKEN, prompt_token_ids
from vllm_wa.validation import check_number, short_repr

FMT = "served"


def is_served_result(path: str) -> bool:
    """Whether ``path`` is a bench-serve result (a JSON object with its format
    tag near the start: first as written, among the first keys once sorted),
    compressed or not."""
    try:
        with reader_for(path)(path, "rb") as f:
            head = f.read(4096)
    except READ_ERRORS:
        return False
    return head.lstrip().startswith(b"{") and FORMAT.encode() in head


def _num(v: Any) -> float | None:
    """A finite number as a float; None for anything else (an integer past the float range too)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def served_request(rec: dict[str, Any], block_size: int) -> TraceRequest | None:
    """A completed record as the engine saw it; None for a request that failed."""
    if rec.get("error") is not None or _num(rec.get("done")) is None or _num(rec.get("sent")) is None:
        return None
    sent, done = float(rec["sent"]), float(rec["done"])
    first = _num(rec.get("first_token"))
    ttft = _num(rec.get("server_ttft_ms"))
    queue = _num(rec.get("server_queue_ms"))
    gen = _num(rec.get("server_generation_ms"))
    if first is not None and ttft is not None and queue is not None:
        # The engine scheduled the request `queue` after it arrived there and
        # `ttft` before the client saw its first token; what is left of the
        # client's time to first token is the API server's way in and out,
        # split evenly.
        slack = max(0.0, (first - sent) - (queue + ttft) / 1000.0)
        lookup = sent + queue / 1000.0 + slack / 2
        free = lookup + (ttft + (gen or 0.0)) / 1000.0
    else:
        lookup, free = sent, done
    if not math.isfinite(free - lookup):  # (not finite either when lookup or free is not)
        raise ValueError("its timings add up past the float range")
    # The server's count of the prompt's tokens, else the client's.
    n_in = token_field(rec, "prompt_tokens" if rec.get("prompt_tokens") is not None else "input_tokens", lo=1)
    hashes = hash_ids(rec, blocks_for=(n_in, block_size))
    n_out = token_field(rec, "completion_tokens") if rec.get("completion_tokens") is not None else 0
    conversation = int_field(rec, "conversation", lo=-1) if rec.get("conversation") is not None else -1
    return TraceRequest(
        request_id=str(rec.get("request_id", rec.get("index"))),
        arrival=lookup,
        hash_ids=hashes,
        input_tokens=n_in,
        output_tokens=n_out,
        tag=str_field(rec, "tag") or "default",
        conversation=conversation,
        # What the server's engine ended up with: the hint, else the finish reason.
        outcome=str_field(rec, "outcome_hint") or str_field(rec, "finish_reason") or "length",
        service_time=max(0.0, free - lookup),
    )


def load_served(path: str, *, skip_bad: bool = False) -> Trace:
    """The requests a bench-serve run completed, timed as the server ran them.

    A record that is not a completed request's (an error) is left out and
    counted in the notes; a malformed one is an error naming it, or, with
    ``skip_bad``, skipped and counted in ``Trace.skipped_lines``.
    """
    with reader_for(path)(path, "rt", encoding="utf-8") as f:
        d = json.load(f)
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{path}: not a bench-serve result")
    if d.get("version") != VERSION:
        raise ValueError(f"unsupported {FORMAT} version {short_repr(d.get('version'))}; expected {VERSION}")
    bs = int(check_number("block_size", d.get("block_size"), ge=1, le=MAX_TOKENS, integer=True))
    records = d.get("requests", [])
    if not isinstance(records, list):
        raise ValueError("'requests' must be a list of records")  # noqa: TRY004 - a bad record is a ValueError in every loader
    reqs = []
    ids: set[str] = set()
    failed = skipped = 0
    for i, rec in enumerate(records):
        try:
            if not isinstance(rec, dict):
                raise ValueError("not an object")  # noqa: TRY004 - as above
            r = served_request(rec, bs)
        except ValueError as e:
            if skip_bad:
                skipped += 1
                continue
            raise ValueError(f"record {i}: {e}") from None
        if r is None:
            failed += 1
        elif r.request_id in ids:
            if not skip_bad:
                raise ValueError(f"record {i}: request id {short_repr(r.request_id)} appears twice")
            skipped += 1
        else:
            ids.add(r.request_id)
            reqs.append(r)
    if not reqs:
        raise ValueError(f"{path}: no completed request to replay")
    reqs.sort(key=lambda r: r.arrival)
    server = d.get("server") if isinstance(d.get("server"), dict) else {}
    trace = Trace(f"{d.get('label', 'served')}:{d.get('trace', '')}", bs, reqs, FMT, skipped_lines=skipped)
    # The client sent the source trace's conversations (none: all -1, as Mooncake's).
    trace.conversations = any(r.conversation >= 0 for r in reqs)
    trace.notes.append(
        f"served by {server.get('url')} ({server.get('num_gpu_blocks')} blocks of {bs} tokens): "
        f"{len(reqs)} completed requests, {failed} failed left out"
    )
    return trace


def replay_config(cfg: Any) -> Any:
    """A served trace is measured from its first request, with the server's exact service times."""
    return replace(cfg, profile_fraction=0.0, lifetime=LifetimeModel(min_service_s=0.0))


class ServedEngine(VLLMEngine):
    """``--engine vllm`` for served traces: the server's tokens, block size and reply slots."""

    finished_status = RequestStatus.FINISHED_LENGTH_CAPPED

    def __init__(self, trace: Trace, policy: ReplayPolicy, num_blocks: int, clock: SettableClock) -> None:
        super().__init__(trace, policy, num_blocks, clock, tokens_per_block=trace.block_size)

    def _max_len(self, trace: Trace) -> int:
        return max(r.input_tokens + r.output_tokens for r in trace.requests) + 1

    def _prompt(self, req: TraceRequest) -> tuple[list[int], int]:
        return prompt_token_ids(req.hash_ids, self.block_size, req.input_tokens), max(1, req.output_tokens)

    def _looked_up(self, req: TraceRequest) -> Sequence[Any]:
        return req.hash_ids[: req.input_tokens // self.block_size]  # full blocks only

    def _full_blocks(self, req: TraceRequest) -> int | None:
        return None  # the lookup sees full blocks only

    def _generate(self, vreq: Request, req: TraceRequest) -> None:
        # The reply's KV: every generated token but the last was fed back.
        n_kv = req.output_tokens - 1
        if n_kv > 0:
            vreq.append_output_token_ids([FIRST_TOKEN] * n_kv)
            if self.manager.allocate_slots(vreq, n_kv) is not None:
                vreq.num_computed_tokens += n_kv

    def _admitted(self, req: TraceRequest, info: Any) -> tuple[Any, list[Any]]:
        """The request's cached (full) blocks, a peer's key for each.

        A partly filled last block is left out: the pool hands it out again
        without an eviction, so a peer must never index it. Full blocks past
        the prompt's (its tail filled up by the reply, the reply's own) get
        keys of their own request, which no later prompt can hit.
        """
        held = self.manager.coordinator.get_blocks(req.request_id)[0]
        n = len(held)
        while n and held[n - 1].block_hash is None:
            n -= 1
        full = req.input_tokens // self.block_size
        keys = [*req.hash_ids[: min(full, n)], *((req.request_id, j) for j in range(full, n))]
        return replace(info, hashes=keys), held[:n]

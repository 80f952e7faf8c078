"""Benchmark hook: a request may say how its reply ended in a recorded trace.

The workload-aware queue classes a request's freed blocks by how its reply
ended (a tool call, an end of turn, a length limit).  A replayed trace cannot
reproduce that with a random-weight model (it calls no tools) and with
``ignore_eos`` (every reply ends by length).  ``vllm-wa bench-serve``
therefore sends the outcome the trace recorded in ``vllm_xargs.wa_outcome``
(``"tool"``, ``"stop"`` or ``"length"``).

The server honours it only when started with ``--wa-bench-outcome-hints``
(a benchmark hook: in production a client could mislabel its own blocks).
The hint is sent *before* the request reaches the engine
(``OutcomeReporter.send_hints`` -> the engine utility ``wa_expect_outcomes``
-> ``BlockTagger.expect_outcome``): the tagger keeps it as a pending fact and
applies it when the request finishes and frees its blocks, so the blocks and
the controller's events carry it from the start.  It never reaches a call
released earlier under the same id (a client may reuse ids: that call's
blocks may be another client's).  It never overrides an outcome the engine
observed itself other than ``stop``/``length`` (see ``BlockTagger.reclassify``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm_wa.engine_patch.compat import UnsupportedVLLMError
from vllm_wa.serving import api_side
from vllm_wa.serving.api_metrics import api_counters

logger = logging.getLogger(__name__)
HINT_KEY = "wa_outcome"
HINT_OUTCOMES = ("tool", "stop", "length")
_MARK = "__vllm_wa_outcome_hints__"

_warned = False  # a bad hint is logged once, then only counted


def hint_of(request: Any) -> str | None:
    """The request's valid outcome hint; a bad one is counted and ignored."""
    xargs = getattr(request, "vllm_xargs", None)
    if not isinstance(xargs, dict) or HINT_KEY not in xargs:
        return None
    hint = xargs[HINT_KEY]
    if hint in HINT_OUTCOMES:
        return hint
    api_counters().hints_ignored.inc()
    global _warned
    if not _warned:
        _warned = True
        logger.warning("vllm-wa: ignoring outcome hint %r (expected one of %s)", hint, HINT_OUTCOMES)
    return None


def completion_keys(base: str, request: Any) -> list[str]:
    """The ids the engine's tagger files a completion's late facts under (``cmpl-<id>-<i>``)."""
    prompt = getattr(request, "prompt", None)
    n = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)) else 1
    return [f"cmpl-{base}-{i}" for i in range(n)]


def chat_keys(base: str, request: Any) -> list[str]:
    """The id the engine's tagger files a chat completion's late facts under (``chatcmpl-<id>``)."""
    return [f"chatcmpl-{base}"]


def _wrap(orig: Any, keys_of: Any) -> Any:
    @functools.wraps(orig)
    async def create(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        reporter = api_side._REPORTER
        hint = hint_of(request) if reporter is not None else None
        if hint is not None:
            raw_request = args[0] if args else kwargs.get("raw_request")
            # The base id the wrapped method will use (vLLM's own rule: the
            # X-Request-Id header, else the body's request_id, which vLLM's
            # request models always fill; "" for a body without one).
            rid = getattr(request, "request_id", None)
            base = self._base_request_id(raw_request, rid if isinstance(rid, str) else "")
            keys = keys_of(base, request) if base else []
            sent = 0
            try:
                # Counted as applied only when it reached the engines: an id
                # too long to remember, or none at all, leaves nothing to send.
                sent = await reporter.send_hints([[k, hint] for k in keys]) if keys else 0
            except Exception as e:  # noqa: BLE001 - a hint must never fail the request
                logger.debug("vllm-wa: outcome hint not delivered: %s", e)
            (api_counters().hints_applied if sent else api_counters().hints_ignored).inc()
        return await orig(self, request, *args, **kwargs)

    setattr(create, _MARK, orig)
    return create


def install() -> None:
    """Honour outcome hints on completions and chat completions (idempotent).

    Only called when ``--wa-bench-outcome-hints`` is set: by ``enable_online``,
    and by the plugin in each extra API-server process.
    """
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    targets = (
        (OpenAIServingCompletion, "create_completion", completion_keys),
        (OpenAIServingChat, "create_chat_completion", chat_keys),
    )
    for cls, _, _ in targets:  # all checked before any is wrapped
        if not callable(getattr(cls, "_base_request_id", None)):
            # The wrapper keys a hint by the id the wrapped method will use.
            raise UnsupportedVLLMError(f"vLLM's {cls.__name__} has no _base_request_id: outcome hints cannot be matched")
    for cls, name, keys in targets:
        current = getattr(cls, name)
        if getattr(current, _MARK, None) is None:
            setattr(cls, name, _wrap(current, keys))
    logger.warning(
        "vllm-wa: --wa-bench-outcome-hints: requests may set their reply outcome (vllm_xargs.%s); "
        "a benchmark hook, not for production", HINT_KEY,
    )

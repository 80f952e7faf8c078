"""The benchmark hook ``--wa-bench-outcome-hints`` and the rule for reported outcomes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import REGISTRY


def hint_counts() -> tuple[float, float]:
    """``vllm_wa_api_outcome_hints_total`` as /metrics shows it: (applied, ignored)."""
    def value(result: str) -> float:
        return REGISTRY.get_sample_value("vllm_wa_api_outcome_hints_total", {"result": result}) or 0.0

    return value("applied"), value("ignored")


def test_outcome_hint_is_reported_before_the_request_and_bad_hints_are_ignored(monkeypatch):
    from vllm.entrypoints.serve.engine.serving import BaseServing

    from vllm_wa.serving import api_side, outcome_hints

    sent = []

    class Reporter:
        async def send_hints(self, items):
            sent.append(("report", items))
            return len(items)

    async def orig(self, request, raw_request=None):
        sent.append(("request", request.request_id))
        return "reply"

    # The serving object's own request-id rule (vLLM's BaseServing._base_request_id).
    serving = SimpleNamespace(_base_request_id=BaseServing._base_request_id)
    wrapped = outcome_hints._wrap(orig, outcome_hints.completion_keys)
    ok = SimpleNamespace(request_id="abc", prompt=[1, 2, 3], vllm_xargs={"type_info": "t", "wa_outcome": "tool"})
    monkeypatch.setattr(api_side, "_REPORTER", Reporter())
    assert asyncio.run(wrapped(serving, ok, None)) == "reply"
    assert sent == [("report", [["cmpl-abc-0", "tool"]]), ("request", "abc")]
    sent.clear()
    headers = SimpleNamespace(headers={"X-Request-Id": "hdr"})
    asyncio.run(wrapped(serving, ok, headers))  # the header wins, as in vLLM
    assert sent == [("report", [["cmpl-hdr-0", "tool"]]), ("request", "abc")]
    assert outcome_hints.chat_keys("abc", ok) == ["chatcmpl-abc"]
    batch = SimpleNamespace(request_id="two", prompt=[[1], [2]], vllm_xargs={"wa_outcome": "stop"})
    assert outcome_hints.completion_keys("two", batch) == ["cmpl-two-0", "cmpl-two-1"]
    sent.clear()
    before = hint_counts()
    bad = SimpleNamespace(request_id="b", prompt=[1], vllm_xargs={"wa_outcome": "abort"})
    asyncio.run(wrapped(serving, bad, None))
    assert sent == [("request", "b")] and hint_counts() == (before[0], before[1] + 1)
    asyncio.run(wrapped(serving, ok, None))
    assert hint_counts() == (before[0] + 1, before[1] + 1)
    # Without --wa-online nothing reports: the hint is just ignored.
    monkeypatch.setattr(api_side, "_REPORTER", None)
    sent.clear()
    asyncio.run(wrapped(serving, ok, None))
    assert sent == [("request", "abc")]


def test_a_hint_is_counted_applied_only_when_it_reaches_the_engines(monkeypatch):
    """A hint under an id no engine remembers (too long) is dropped by the
    API server, and one under an empty id (an empty X-Request-Id) has no key:
    neither reaches an engine, so each counts as ignored, not applied."""
    from vllm.entrypoints.serve.engine.serving import BaseServing

    from vllm_wa.engine_patch.block_tagger import MAX_LATE_FACT_ID
    from vllm_wa.serving import api_side, outcome_hints

    calls = []

    class Engines:
        class engine_core:
            @staticmethod
            async def call_utility_all_async(method, items):
                calls.append((method, items))

    async def orig(self, request, raw_request=None):
        return "reply"

    serving = SimpleNamespace(_base_request_id=BaseServing._base_request_id)
    wrapped = outcome_hints._wrap(orig, outcome_hints.chat_keys)
    monkeypatch.setattr(api_side, "_REPORTER", api_side.OutcomeReporter(engine_client=Engines(), flush_interval=0.0))
    req = SimpleNamespace(request_id="abc", vllm_xargs={"wa_outcome": "tool"})
    for header in ("x" * MAX_LATE_FACT_ID, ""):
        before = hint_counts()
        assert asyncio.run(wrapped(serving, req, SimpleNamespace(headers={"X-Request-Id": header}))) == "reply"
        assert calls == [] and hint_counts() == (before[0], before[1] + 1), repr(header[:8])
    before = hint_counts()
    asyncio.run(wrapped(serving, req, None))
    assert calls == [("wa_expect_outcomes", [["chatcmpl-abc", "tool"]])]
    assert hint_counts() == (before[0] + 1, before[1])


def test_outcome_hints_are_installed_only_with_their_flag(monkeypatch):
    from vllm_wa.serving import api_side, outcome_hints, plugin

    installed = []
    monkeypatch.setattr(api_side, "install", lambda settings: None)
    monkeypatch.setattr(outcome_hints, "install", lambda: installed.append(True))
    base = dict(wa_online=True, wa_config=None, wa_params=None, wa_allow_pin=False)
    assert not plugin.enable_online(SimpleNamespace(**base)).bench_outcome_hints
    assert installed == []
    assert plugin.enable_online(SimpleNamespace(**base, wa_bench_outcome_hints=True)).bench_outcome_hints
    assert installed == [True]


def test_reported_outcomes_refine_stop_and_length_but_never_abort(clock):
    from vllm.v1.request import RequestStatus

    from conftest import finish, make_manager, make_request, run_prefill
    from vllm_wa.engine_patch.install import install_wa_queue

    class OutcomeKey:
        uses_block_features = False

        def __call__(self, req, position, reuse_count):
            return f"{req.tag}.{req.outcome}"

    m = make_manager(20)
    h = install_wa_queue(m.block_pool, clock=clock, class_key=OutcomeKey())
    toks = lambda base: list(range(base, base + 32))  # noqa: E731
    for rid, base, status, hint in (
        ("len", 1000, RequestStatus.FINISHED_LENGTH_CAPPED, "tool"),
        ("abo", 2000, RequestStatus.FINISHED_ABORTED, "tool"),
    ):
        r = make_request(rid, toks(base), tag="t")
        run_prefill(m, r)
        h.tagger.reclassify(rid, hint)  # a hint: before the request finishes
        finish(m, r, status)
    assert h.queue.free_blocks_by_class() == {"t.tool": 2, "t.abort": 2}
    assert h.tagger.reclassify("abo", "stop") == 0  # after the free, too
    assert h.queue.free_blocks_by_class() == {"t.tool": 2, "t.abort": 2}
    assert h.tagger.reclassified_requests == 1
    # The same fact again (a hint, then the API server's own report) moves and counts nothing.
    assert h.tagger.reclassify("len", "tool") == 0
    assert h.tagger.reclassified_requests == 1
    # A hint equal to the engine's own outcome changes no request either.
    r = make_request("same", toks(3000), tag="t")
    run_prefill(m, r)
    h.tagger.reclassify("same", "length")
    finish(m, r, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert h.queue.free_blocks_by_class()["t.length"] == 2 and h.tagger.reclassified_requests == 1

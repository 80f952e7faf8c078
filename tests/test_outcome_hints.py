"""The benchmark hook ``--wa-bench-outcome-hints`` and the rule for reported outcomes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace


def test_outcome_hint_is_reported_before_the_request_and_bad_hints_are_ignored(monkeypatch):
    from vllm_wa.serving import api_side, outcome_hints

    sent = []

    class Reporter:
        async def report_now(self, items):
            sent.append(("report", items))

    async def orig(self, request, raw_request=None):
        sent.append(("request", request.request_id))
        return "reply"

    wrapped = outcome_hints._wrap(orig, outcome_hints.completion_keys)
    ok = SimpleNamespace(request_id="abc", prompt=[1, 2, 3], vllm_xargs={"type_info": "t", "wa_outcome": "tool"})
    monkeypatch.setattr(api_side, "_REPORTER", Reporter())
    assert asyncio.run(wrapped(None, ok, None)) == "reply"
    assert sent == [("report", [["cmpl-abc-0", "tool"]]), ("request", "abc")]
    headers = SimpleNamespace(headers={"X-Request-Id": "hdr"})
    assert outcome_hints.completion_keys(ok, headers) == ["cmpl-hdr-0"]
    assert outcome_hints.chat_keys(ok, None) == ["chatcmpl-abc"]
    sent.clear()
    before = outcome_hints.COUNTERS.ignored
    bad = SimpleNamespace(request_id="b", prompt=[1], vllm_xargs={"wa_outcome": "abort"})
    asyncio.run(wrapped(None, bad, None))
    assert sent == [("request", "b")] and outcome_hints.COUNTERS.ignored == before + 1
    # Without --wa-online nothing reports: the hint is just ignored.
    monkeypatch.setattr(api_side, "_REPORTER", None)
    sent.clear()
    asyncio.run(wrapped(None, ok, None))
    assert sent == [("request", "abc")]


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

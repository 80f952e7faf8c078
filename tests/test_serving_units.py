"""Serving pieces that the CPU end-to-end test cannot trigger (a random model calls no tools)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY
from serving_harness import Engine
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.request import RequestStatus

from vllm_wa.controller.config import ControllerConfig
from vllm_wa.controller.controller import start_online
from vllm_wa.engine_patch.block_tagger import MAX_LATE_FACT_ID
from vllm_wa.engine_patch.install import install_wa_queue
from vllm_wa.kv_block import set_hash
from vllm_wa.params import ParamsError, WAParams
from vllm_wa.serving import api_side, engine_side
from vllm_wa.serving import metrics as metrics_mod
from vllm_wa.serving import settings as settings_mod
from vllm_wa.serving.engine_side import EngineWA, external_request_id, match_api_reports
from vllm_wa.serving.pin_request import parse_pin_request
from vllm_wa.serving.settings import MAX_OUTCOME_REPORTS_PER_CALL, ServingSettings

from conftest import finish, make_manager, make_request, run_prefill


def test_external_request_ids():
    assert external_request_id("chatcmpl-abc123-1a2b3c4d") == "chatcmpl-abc123"
    assert external_request_id("0_chatcmpl-abc123-1a2b3c4d") == "chatcmpl-abc123"
    assert external_request_id("cmpl-xyz-0-deadbeef") == "cmpl-xyz-0"
    assert external_request_id("plain") == "plain"


def test_without_request_id_randomization_a_client_ids_hex_ending_is_kept(monkeypatch):
    """vLLM adds ``-<8 hex>`` to every engine id unless
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``: then the engine id is the
    client's own, and stripping that ending lost the client's late outcomes."""
    m = make_manager(40)
    h = install_wa_queue(m.block_pool, None)
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    match_api_reports(h.tagger)
    assert h.tagger.request_key("job-1a2b3c4d") == "job-1a2b3c4d"
    assert h.tagger.request_key("1_job-1a2b3c4d") == "job-1a2b3c4d"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0")
    match_api_reports(h.tagger)
    assert h.tagger.request_key("job-1a2b3c4d-deadbeef") == "job-1a2b3c4d"


def test_chat_response_with_tool_calls_is_reported():
    from vllm.entrypoints.generate.base.protocol import FunctionCall, ToolCall
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )

    msg = ChatMessage(role="assistant", content=None,
                      tool_calls=[ToolCall(function=FunctionCall(name="ls", arguments="{}"))])
    resp = ChatCompletionResponse(
        id="chatcmpl-1", model="m", choices=[ChatCompletionResponseChoice(index=0, message=msg, finish_reason="tool_calls")],
        usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    )
    assert api_side._chat_outcomes(resp) == ("chatcmpl-1", True)
    plain = resp.model_copy(update={"choices": [ChatCompletionResponseChoice(
        index=0, message=ChatMessage(role="assistant", content="hi"), finish_reason="stop")]})
    assert api_side._chat_outcomes(plain) == ("chatcmpl-1", False)


def test_streamed_tool_call_is_reported_after_the_stream():
    reporter = api_side.OutcomeReporter(engine_client=None)

    async def sse():
        yield 'data: {"id": "chatcmpl-9", "choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'
        yield 'data: {"id": "chatcmpl-9", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}\n\n'
        yield "data: [DONE]\n\n"

    async def consume():
        return [c async for c in api_side._watch_stream(sse(), reporter)]

    chunks = asyncio.run(consume())
    assert len(chunks) == 3
    assert reporter._pending == [["chatcmpl-9", "tool"]]


def test_a_streamed_plain_reply_is_parsed_once_not_chunk_by_chunk(monkeypatch):
    reporter = api_side.OutcomeReporter(engine_client=None)
    parsed = []
    loads = json.loads
    monkeypatch.setattr(api_side.json, "loads", lambda text: parsed.append(text) or loads(text))
    delta = json.dumps({"content": 'the word "tool_calls" in a reply'})  # its quotes escaped

    async def sse():
        for _ in range(100):
            yield f'data: {{"id": "chatcmpl-7", "choices": [{{"index": 0, "delta": {delta}}}]}}\n\n'
        yield "data: [DONE]\n\n"

    async def consume():
        return [c async for c in api_side._watch_stream(sse(), reporter)]

    assert len(asyncio.run(consume())) == 101
    assert len(parsed) == 1 and reporter._pending == []


def test_chat_wrapper_reports_and_passes_results_through(monkeypatch):
    reporter = api_side.OutcomeReporter(engine_client=None)
    monkeypatch.setattr(api_side, "_REPORTER", reporter)
    result = SimpleNamespace(id="chatcmpl-5", choices=[SimpleNamespace(message=SimpleNamespace(tool_calls=[1]))])

    async def orig(self, request, raw_request=None):
        return result

    wrapped = api_side._wrap_chat(orig)
    assert asyncio.run(wrapped(None, None)) is result
    assert reporter._pending == [["chatcmpl-5", "tool"]]


def run_reporter_until(reporter, done) -> None:
    """Run the reporter's flush loop until ``done()`` holds (at most 1,000 turns of the event loop)."""

    async def loop():
        task = asyncio.ensure_future(reporter.run())
        for _ in range(1000):
            if done():
                break
            await asyncio.sleep(0)
        task.cancel()

    asyncio.run(loop())


def report_counts() -> tuple[float, float]:
    """``vllm_wa_api_outcome_reports_total`` as /metrics shows it: (sent, dropped)."""
    def value(result: str) -> float:
        return REGISTRY.get_sample_value("vllm_wa_api_outcome_reports_total", {"result": result}) or 0.0

    return value("sent"), value("dropped")


def test_lost_outcome_reports_are_counted(monkeypatch):
    """The API server's buffer when full, and a batch the engines refuse: counted, not silent."""
    monkeypatch.setattr(api_side, "MAX_PENDING_REPORTS", 2)

    class Refusing:
        class engine_core:
            @staticmethod
            async def call_utility_all_async(method, *args):
                raise RuntimeError("engine gone")

    before = report_counts()
    reporter = api_side.OutcomeReporter(engine_client=Refusing(), flush_interval=0.0)
    for i in range(3):
        reporter.report(f"chatcmpl-{i}", "tool")
    assert reporter.dropped == 1 and len(reporter._pending) == 2

    run_reporter_until(reporter, lambda: reporter.dropped == 3)
    assert reporter.dropped == 3 and reporter.reported == 0
    monkeypatch.setattr(api_side, "_REPORTER", reporter)
    assert api_side.api_state() == {"outcome_reports_sent": 0, "outcome_reports_dropped": 3}
    # And on /metrics, as counters (each loss counted once).
    assert report_counts() == (before[0], before[1] + 3)
    # A benchmark hint sent at once, refused: lost too, and the caller hears of it.
    with pytest.raises(RuntimeError):
        asyncio.run(reporter.send_hints([["chatcmpl-x", "tool"]]))
    assert reporter.dropped == 4 and report_counts() == (before[0], before[1] + 4)


def test_reports_go_to_the_engines_in_calls_they_apply_whole(monkeypatch):
    """The API server never sends more in one call than an engine applies from one."""
    monkeypatch.setattr(api_side, "MAX_OUTCOME_REPORTS_PER_CALL", 3)
    calls = []

    class Engines:
        class engine_core:
            @staticmethod
            async def call_utility_all_async(method, items):
                calls.append(len(items))

    before = report_counts()
    reporter = api_side.OutcomeReporter(engine_client=Engines(), flush_interval=0.0)
    for i in range(7):
        reporter.report(f"chatcmpl-{i}", "tool")

    run_reporter_until(reporter, lambda: reporter.reported == 7)
    assert calls == [3, 3, 1] and reporter.dropped == 0
    assert report_counts() == (before[0] + 7, before[1])
    # Sent at once (a benchmark hint for a completion of many prompts): the same limit.
    calls.clear()
    asyncio.run(reporter.send_hints([[f"cmpl-x-{i}", "tool"] for i in range(8)]))
    assert calls == [3, 3, 2] and reporter.reported == 15


def test_outcome_reports_under_ids_no_engine_remembers_are_dropped_in_the_api_server():
    """The client chooses the id's length (X-Request-Id, the body's request_id);
    an engine remembers no release under an id over MAX_LATE_FACT_ID, so a
    fact about one was held and sent to every engine for nothing."""
    calls = []

    class Engines:
        class engine_core:
            @staticmethod
            async def call_utility_all_async(method, items):
                calls.append([rid for rid, _ in items])

    before = report_counts()
    reporter = api_side.OutcomeReporter(engine_client=Engines(), flush_interval=0.0)
    long_id = "chatcmpl-" + "x" * MAX_LATE_FACT_ID
    reporter.report(long_id, "tool")
    reporter.report("chatcmpl-ok", "tool")
    assert reporter.dropped == 1 and [rid for rid, _ in reporter._pending] == ["chatcmpl-ok"]
    asyncio.run(reporter.send_hints([[long_id, "tool"], ["cmpl-ok", "tool"]]))
    assert calls == [["cmpl-ok"]] and reporter.dropped == 2
    assert report_counts() == (before[0] + 1, before[1] + 2)


def engine_with_outcome_key(num_blocks: int = 20):
    """A real KV-cache manager with the WA queue keyed by tag and outcome, and
    the engine core object the utility calls get: ``(manager, handle, ewa, core)``."""
    from vllm_wa.controller.features import FeatureKey

    m = make_manager(num_blocks)
    handles = []

    def install(sink, registry, key, conversations):
        h = install_wa_queue(m.block_pool, None, sink=sink, registry=registry, class_key=FeatureKey(("tag", "outcome")))
        match_api_reports(h.tagger)
        handles.append(h)
        return h.queue, h.tagger

    controller = start_online(ControllerConfig(), num_blocks, install)
    h = handles[0]
    ewa = EngineWA(h, controller, scheduler=SimpleNamespace(shutdown=lambda wait: None),
                   settings=ServingSettings(online=True), engine_index=0, block_size=16)
    return m, h, ewa, SimpleNamespace(scheduler=SimpleNamespace(_vllm_wa_engine=ewa))


def test_a_report_reaching_an_engine_that_did_not_serve_the_call_is_not_kept_for_its_next_call():
    """Data parallel: every engine core gets every report. The engine that
    served call 1 re-files it; another keeps nothing, so call 2 under the same
    client id, served there and ending in a plain stop, stays ``stop``."""
    served_on, other = engine_with_outcome_key(40), engine_with_outcome_key(40)

    def serve(m, rid: str, first_token: int) -> None:
        r = make_request(rid, list(range(first_token, first_token + 16 * 2 + 1)), tag="agent")
        run_prefill(m, r)
        finish(m, r)

    serve(served_on[0], "chatcmpl-abc-11111111", 0)
    assert [engine_side.wa_report_outcomes(core, [["chatcmpl-abc", "tool"]]) for _, _, _, core in (served_on, other)] \
        == [2, 0]
    serve(other[0], "chatcmpl-abc-22222222", 1000)
    assert served_on[1].queue.free_blocks_by_class() == {"agent.o:tool": 2}
    assert other[1].queue.free_blocks_by_class() == {"agent.o:stop": 2}


def test_a_late_outcome_reaches_the_request_released_last_under_its_id_and_ids_are_bounded():
    """Two API calls that sent the same id: a tool report re-files the one whose
    reply just ended, not the other client's (they differ in vLLM's random
    suffix); the children of one n > 1 call move together.  A request id over
    MAX_LATE_FACT_ID characters is not remembered (counted), and a report under
    such an id is invalid: 4,096 remembered 1-MB ids would hold 8 GB."""
    from vllm_wa.engine_patch.block_tagger import MAX_LATE_FACT_ID

    m, h, ewa, core = engine_with_outcome_key(40)

    def serve(rid: str, first_token: int) -> None:
        r = make_request(rid, list(range(first_token, first_token + 16 * 2 + 1)), tag="agent")
        run_prefill(m, r)
        finish(m, r)

    serve("chatcmpl-7-aaaaaaaa", 0)  # another client's earlier call with the same id
    serve("chatcmpl-7-bbbbbbbb", 1000)
    assert engine_side.wa_report_outcomes(core, [["chatcmpl-7", "tool"]]) == 2
    assert h.queue.free_blocks_by_class() == {"agent.o:stop": 2, "agent.o:tool": 2}
    serve("0_chatcmpl-8-cccccccc", 2000)  # one call, n = 2
    serve("1_chatcmpl-8-cccccccc", 3000)
    assert engine_side.wa_report_outcomes(core, [["chatcmpl-8", "tool"]]) == 4
    assert h.queue.free_blocks_by_class() == {"agent.o:stop": 2, "agent.o:tool": 6}

    long_id = "x" * (MAX_LATE_FACT_ID + 1)
    serve(long_id + "-dddddddd", 4000)
    assert h.tagger.long_request_ids == 1 and long_id not in h.tagger._finished
    assert engine_side.wa_report_outcomes(core, [[long_id, "tool"]]) == 0
    assert ewa.invalid_reports == 1
    assert h.queue.free_blocks_by_class() == {"agent.o:stop": 4, "agent.o:tool": 6}
    assert engine_side.wa_get_metrics(core)["long_request_ids"] == 1


def test_a_hint_reaches_the_next_call_under_its_id_never_an_earlier_one():
    """A benchmark hint is sent before its call reaches the engine.  Sent as
    a late report, it found an earlier call released under the same id (a
    client reusing ids) and moved that call's blocks, and the hinted call
    kept its own outcome."""
    m, h, ewa, core = engine_with_outcome_key(40)

    def serve(rid: str, first_token: int) -> None:
        r = make_request(rid, list(range(first_token, first_token + 16 * 2 + 1)), tag="agent")
        run_prefill(m, r)
        finish(m, r)

    serve("chatcmpl-5-aaaaaaaa", 0)  # an earlier call under the id, released
    assert engine_side.wa_expect_outcomes(core, [["chatcmpl-5", "tool"], ["x", "bogus"]]) == 1
    assert ewa.invalid_reports == 1
    assert h.queue.free_blocks_by_class() == {"agent.o:stop": 2}  # the earlier call's blocks stay
    serve("chatcmpl-5-bbbbbbbb", 1000)  # the hinted call
    assert h.queue.free_blocks_by_class() == {"agent.o:stop": 2, "agent.o:tool": 2}


def test_an_outcome_reported_before_the_release_reaches_every_child_of_its_call_only():
    """A benchmark hint arrives before its call reaches the engine: every child
    of that n > 1 call takes it (the first child alone did), a later call that
    sends the same id does not."""
    m, h, _, core = engine_with_outcome_key(40)

    def serve(rid: str, first_token: int) -> None:
        r = make_request(rid, list(range(first_token, first_token + 16 * 2 + 1)), tag="agent")
        run_prefill(m, r)
        finish(m, r)

    assert engine_side.wa_expect_outcomes(core, [["chatcmpl-9", "tool"]]) == 1  # kept, pending
    serve("0_chatcmpl-9-aaaaaaaa", 0)  # one call, n = 3
    serve("1_chatcmpl-9-aaaaaaaa", 1000)
    serve("2_chatcmpl-9-aaaaaaaa", 2000)
    assert h.queue.free_blocks_by_class() == {"agent.o:tool": 6}
    assert h.tagger.reclassified_requests == 3
    serve("chatcmpl-9-bbbbbbbb", 3000)  # another call under the same id, no hint of its own
    assert h.queue.free_blocks_by_class() == {"agent.o:stop": 2, "agent.o:tool": 6}
    serve("chatcmpl-9-cccccccc", 4000)
    assert h.queue.free_blocks_by_class() == {"agent.o:stop": 4, "agent.o:tool": 6}


def test_blocks_freed_without_a_release_are_counted_under_the_default_class():
    """A sliding window frees blocks mid-request, without a release hook: they
    go to the default class, which the metrics then report even though no
    request was untagged (before, its counts were kept and never shown)."""
    m, h, _, core = engine_with_outcome_key(5)  # 4 usable blocks
    r = make_request("chatcmpl-1-0a1b2c3d", list(range(16 * 3 + 2)), tag="agent")
    run_prefill(m, r)
    finish(m, r)  # 3 full blocks to its class, the partial one to go first
    assert set(engine_side.wa_get_metrics(core)["classes"]) == {"agent.o:stop"}
    taken = m.block_pool.get_new_blocks(3)  # the partial block and two of the full ones
    for i, b in enumerate(taken):
        set_hash(b, make_block_hash_with_group_id(bytes([i + 1]) * 32, 0))
    m.block_pool.free_blocks(taken)  # what vLLM's sliding-window manager does
    assert h.queue.free_blocks_by_class() == {"agent.o:stop": 1, "default": 3}
    metrics = engine_side.wa_get_metrics(core)
    classes = metrics["classes"]
    assert classes["default"]["freed"] == 3
    assert classes["agent.o:stop"] == {"evictions": 2, "reuses": 0, "freed": 3}
    assert metrics["num_classes"] == 2  # the classes gauge counts the rows it shows


def test_outcome_reports_reclassify_engine_blocks():
    m, h, ewa, core = engine_with_outcome_key()
    r = make_request("chatcmpl-42-0a1b2c3d", list(range(16 * 3 + 2)), tag="agent")
    run_prefill(m, r)
    finish(m, r, RequestStatus.FINISHED_STOPPED)
    assert h.queue.free_blocks_by_class() == {"agent.o:stop": 3}
    moved = engine_side.wa_report_outcomes(core, [["chatcmpl-42", "tool"], ["x", "bogus"], "junk"])
    assert moved == 3
    assert h.queue.free_blocks_by_class() == {"agent.o:tool": 3}
    assert ewa.invalid_reports == 2
    state = engine_side.wa_get_state(core)
    assert state["enabled"] and state["outcomes_reclassified"] == 1
    metrics = engine_side.wa_get_metrics(core)
    # Hit accounting is per tag, over every prompt token, as vLLM's prefix_cache_queries.
    assert metrics["tags"]["agent"]["queried_tokens"] == 16 * 3 + 2
    assert set(metrics["classes"]) == {"agent.o:stop", "agent.o:tool"}  # a tag takes no class slot
    assert metrics["classes"]["agent.o:tool"]["freed"] == 3
    # Reports past one call's limit are dropped and counted. (Reports for requests this
    # engine does not hold wait, a bounded number, uncounted: with data parallelism every
    # engine gets every report.)
    n = MAX_OUTCOME_REPORTS_PER_CALL + 5
    assert engine_side.wa_report_outcomes(core, [[f"later-{i}", "tool"] for i in range(n)]) == 0
    dropped = engine_side.wa_get_metrics(core)["outcome_reports_dropped"]
    assert dropped == 5
    rendered = {
        f.name: f.samples[0].value
        for f in metrics_mod.WACollector(lambda: [{"enabled": True, "metrics": engine_side.wa_get_metrics(core)}]).collect()
        if f.samples
    }
    assert rendered["vllm_wa_outcome_reports_dropped"] == dropped
    assert rendered["vllm_wa_outcomes_reclassified"] == 1 and rendered["vllm_wa_invalid_outcome_reports"] == 2
    json.dumps(state), json.dumps(metrics)  # plain data for the utility channel


@pytest.mark.parametrize(
    "body, msg",
    [
        ({"params": {"a": {"x": 1}, "p": {"x": 1.5}}}, r"\[0.0, 1.0\]"),
        ({"params": {"a": {"x": 1}, "p": {"x": 0.5}}, "features": ["color"]}, "features"),
        ({"params": {}, "mode": "auto"}, "no params"),
        ({"mode": "auto", "features": "not-a-list"}, "no features"),
        ({"mode": "auto", "features": ["tag"]}, "no features"),
        # A mixture replaces the class's exponential, and its 'a' and 'p' are still checked.
        ({"params": {"a": {"x": "junk"}, "p": {"x": 0.5}, "mixture": {"x": [[0.5, 1.0]]}}}, "class 'x'"),
        ({"params": {"a": {"x": 1.0}, "p": {"x": 7}, "mixture": {"x": [[0.5, 1.0]]}}}, r"\[0.0, 1.0\]"),
        ({"other": 1}, "unknown field"),
        ({}, "to pin"),
        ("text", "JSON object"),
    ],
)
def test_pin_request_validation(body, msg):
    with pytest.raises((ParamsError, ValueError), match=msg):
        parse_pin_request(body)


def test_pin_request_parses():
    params, feats = parse_pin_request({"params": {"a": {"x": 0.1}, "p": {"x": 0.5}}, "features": ["tag", "outcome"]})
    assert params.model_for("x").p == 0.5 and feats == ("tag", "outcome")
    assert parse_pin_request({"mode": "auto"}) == (None, None)


# Prints which of vLLM's functions and classes carry vllm-wa's patches after
# the plugin loads in an API server process (online: as --wa-online makes it,
# then what the API server does for /metrics and an engine core for its queue).
_PATCH_PROBE = """
import json, multiprocessing, sys
multiprocessing.current_process().name = "ApiServer_0"
from vllm_wa.serving.plugin import register; register()
if sys.argv[1] == "online":
    from vllm_wa.serving import metrics
    class NoMetrics:
        def collect(self): return []
    metrics.install(NoMetrics())
    from vllm_wa.kv_block import install_hash_alias
    install_hash_alias()
from prometheus_client import multiprocess
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
import vllm.entrypoints.launchers.app as app
w = "__vllm_wa_wrapped__"
print(json.dumps({
    "Scheduler.__init__": hasattr(Scheduler.__init__, w),
    "EngineCore.wa_get_snapshot": hasattr(EngineCore, "wa_get_snapshot"),
    "MultiProcessCollector.__init__": hasattr(multiprocess.MultiProcessCollector.__init__, w),
    "attach_endpoint_plugins": hasattr(app.attach_endpoint_plugins, w),
    "KVCacheBlock.wa_block_hash": hasattr(KVCacheBlock, "wa_block_hash"),
}))
"""


def test_plugin_without_flag_patches_no_engine_code():
    """Every mark the online run shows is absent without the flag (so each check can fail)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_WA_")}
    marks = {}
    for mode, extra in (("plain", {}), ("online", {"VLLM_WA_ONLINE": "1"})):
        out = subprocess.run([sys.executable, "-c", _PATCH_PROBE, mode], capture_output=True, text=True, timeout=180,
                             env={**env, **extra})
        assert out.returncode == 0, out.stderr[-2000:]
        marks[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    assert not any(marks["plain"].values()), marks["plain"]
    assert all(marks["online"].values()), marks["online"]


def test_unsupported_vllm_refuses_to_start(monkeypatch):
    import vllm

    from vllm_wa.serving import plugin

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    args = SimpleNamespace(wa_online=True, wa_config=None, wa_params=None, wa_allow_pin=False)
    with pytest.raises(SystemExit, match="refusing to start.*0.31.2"):
        plugin.enable_online(args)


def test_bad_config_or_params_refuse_to_start(tmp_path):
    from vllm_wa.serving import plugin

    bad_cfg = tmp_path / "c.toml"
    bad_cfg.write_text("[controller]\nnope = 1\n")
    with pytest.raises(SystemExit, match="controller.nope"):
        plugin.enable_online(SimpleNamespace(wa_online=True, wa_config=str(bad_cfg), wa_params=None))
    bad_params = tmp_path / "p.json"
    bad_params.write_text('{"a": {"x": 1}, "p": {"x": 9}}')
    with pytest.raises(SystemExit, match="p.json"):
        plugin.enable_online(SimpleNamespace(wa_online=True, wa_config=None, wa_params=str(bad_params)))
    # More classes than the class cap: the queue could use only the first ones,
    # and every state snapshot would carry them all (200,000 took 0.4 s a poll).
    cap = ControllerConfig().max_classes
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps({"a": {f"c{i}": 0.1 for i in range(cap + 1)}, "p": {f"c{i}": 0.5 for i in range(cap + 1)}}))
    with pytest.raises(SystemExit, match=f"wide.json.*{cap + 1} classes.*class cap"):
        plugin.enable_online(SimpleNamespace(wa_online=True, wa_config=None, wa_params=str(wide)))
    seeded = tmp_path / "seeded.toml"
    seeded.write_text(f'[controller]\nseed_params = "{wide}"\n')
    with pytest.raises(SystemExit, match="wide.json.*class cap"):
        plugin.enable_online(SimpleNamespace(wa_online=True, wa_config=str(seeded), wa_params=None))
    assert len(WAParams.load(str(wide), max_classes=cap + 1).models) == cap + 1  # a config with a wider cap takes it


def test_enable_online_keeps_the_operators_metrics_interval(monkeypatch):
    from vllm_wa.serving import plugin
    from vllm_wa.serving.settings import ENV_METRICS_INTERVAL, ENV_ONLINE

    installed = []
    monkeypatch.setattr(api_side, "install", installed.append)
    monkeypatch.setenv(ENV_METRICS_INTERVAL, "1.5")
    monkeypatch.setenv(ENV_ONLINE, "0")
    settings = plugin.enable_online(
        SimpleNamespace(wa_online=True, wa_config=None, wa_params=None, wa_allow_pin=True)
    )
    assert settings.metrics_interval_s == 1.5 and settings.allow_pin
    assert installed == [settings]
    assert ServingSettings.from_env() == settings


def test_bad_seed_params_in_the_config_refuse_to_start(tmp_path):
    from vllm_wa.serving import plugin

    bad = tmp_path / "seed.json"
    bad.write_text('{"a": {"x": 1}, "p": {"x": 9}}')
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[controller]\nseed_params = "{bad}"\n')
    with pytest.raises(SystemExit, match="seed.json"):
        plugin.enable_online(SimpleNamespace(wa_online=True, wa_config=str(cfg), wa_params=None))
    cfg.write_text(f'[controller]\nseed_params = "{tmp_path / "missing.json"}"\n')
    with pytest.raises(SystemExit, match="missing.json"):
        plugin.enable_online(SimpleNamespace(wa_online=True, wa_config=str(cfg), wa_params=None))


def test_refit_fault_hook_is_off_by_default_and_counted_when_on(monkeypatch):
    from vllm_wa.controller.controller import WAController
    from vllm_wa.engine_patch.events import EventSink
    from vllm_wa.serving import faults

    def controller():
        return WAController(ControllerConfig(), 100, lambda p, k: None, EventSink())

    c = controller()
    monkeypatch.delenv(faults.ENV_FAULT_REFIT_EVERY, raising=False)
    faults.install_from_env(c)
    for _ in range(4):
        c.refit()
    assert c.errors == 0 and c.refits == 4
    monkeypatch.setenv(faults.ENV_FAULT_REFIT_EVERY, "2")
    c = controller()
    faults.install_from_env(c)
    for _ in range(4):
        c.refit()
    assert c.errors == 2 and c.refits == 2 and "InjectedFault" in c.last_error


def test_extra_api_servers_install_the_outcome_hints_they_serve():
    """With ``--api-server-count`` > 1 the ``ApiServer_N`` processes serve HTTP:
    the benchmark's outcome hints must be installed there too, not only in the
    parent that parsed the flags."""
    code = (
        "import multiprocessing;"
        "multiprocessing.current_process().name = 'ApiServer_0';"
        "from vllm_wa.serving.plugin import register; register();"
        "from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion as C;"
        "print('hints', hasattr(C.create_completion, '__vllm_wa_outcome_hints__'))"
    )
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("VLLM_WA_")}
    for flag, want in (("1", "hints True"), ("0", "hints False")):
        env = {**base, settings_mod.ENV_ONLINE: "1", settings_mod.ENV_BENCH_OUTCOME_HINTS: flag}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env,
                             check=False)
        assert out.returncode == 0, out.stderr[-2000:]
        assert want in out.stdout


# ---- what the review of the install path found (2026-12-05) -------------------------------------


def test_a_number_the_parser_cannot_hold_is_a_clear_error_naming_the_file(tmp_path):
    from vllm_wa.controller.config import ConfigError
    from vllm_wa.params import WAParams
    from vllm_wa.serving import plugin

    huge = "9" * 5000  # past Python's 4,300-digit limit: a ValueError, not a JSONDecodeError
    params = tmp_path / "p.json"
    params.write_text('{"a": {"x": ' + huge + '}, "p": {"x": 0.5}}')
    with pytest.raises(ParamsError, match="does not parse"):
        WAParams.load(str(params))
    with pytest.raises(SystemExit, match="p.json"):
        plugin.enable_online(SimpleNamespace(wa_online=True, wa_config=None, wa_params=str(params)))
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[controller]\nshadow_blocks = {huge}\n")
    with pytest.raises(ConfigError, match="c.toml"):
        ControllerConfig.load(str(cfg))


def test_a_refit_interval_the_scheduler_cannot_run_is_refused():
    from vllm_wa.controller.config import ConfigError

    for bad in (1e14, 1e-9):  # apscheduler's OverflowError in the engine core; refits back to back
        with pytest.raises(ConfigError, match="refit_interval_s"):
            ControllerConfig(refit_interval_s=bad)
    assert ControllerConfig(refit_interval_s=3600.0).refit_interval_s == 3600.0


def test_a_vllm_wa_variable_it_cannot_use_is_an_error_not_a_default(monkeypatch):
    from vllm_wa.serving import plugin
    from vllm_wa.serving.settings import ENV_METRICS_INTERVAL, ENV_ONLINE, SettingsError

    installed = []
    monkeypatch.setattr(api_side, "install", installed.append)
    monkeypatch.setenv(ENV_ONLINE, "1")
    for bad in ("nan", "-3", "0", "abc", "1e-9", "1e9"):  # all became 5.0, or a 57,000-a-second poll
        monkeypatch.setenv(ENV_METRICS_INTERVAL, bad)
        with pytest.raises(SettingsError, match=ENV_METRICS_INTERVAL):
            ServingSettings.from_env()
        with pytest.raises(SystemExit, match=ENV_METRICS_INTERVAL):
            plugin.enable_online(SimpleNamespace(wa_online=True, wa_config=None, wa_params=None))
    monkeypatch.setenv(ENV_METRICS_INTERVAL, "2.5")
    assert ServingSettings.from_env().metrics_interval_s == 2.5
    monkeypatch.setenv(ENV_ONLINE, "true")  # meant on; it was silently off
    with pytest.raises(SettingsError, match="set it to 1"):
        ServingSettings.from_env()
    monkeypatch.setenv(ENV_ONLINE, "0")  # off: the other variables are not read
    monkeypatch.setenv(ENV_METRICS_INTERVAL, "abc")
    assert ServingSettings.from_env() == ServingSettings()
    assert installed == []


def _plugin_run(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("VLLM_WA_")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env={**base, **env}, check=False
    )


def test_an_unsupported_vllm_with_the_environment_switch_on_exits_naming_the_switch():
    code = "import vllm; vllm.__version__ = '0.40.0'\nfrom vllm_wa.serving.plugin import register\nregister()"
    out = _plugin_run(code, VLLM_WA_ONLINE="1")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr  # was a traceback through vLLM's plugin loader
    assert "VLLM_WA_ONLINE=1 is set in the environment" in out.stderr and "0.40.0" in out.stderr


def test_wa_options_without_wa_online_are_reported_not_silently_dropped():
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from types import SimpleNamespace\n"
        "from vllm_wa.serving.plugin import register; register()\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "args = SimpleNamespace(wa_online=False, wa_config='/nonexistent.toml', wa_params=None, wa_allow_pin=True)\n"
        "try:\n    EngineArgs.from_cli_args(args)\nexcept Exception:\n    pass  # vLLM's own needs every field\n"
    )
    out = _plugin_run(code)
    assert "--wa-config, --wa-allow-pin have no effect without --wa-online" in out.stderr, out.stderr[-2000:]


def test_a_vllm_whose_cli_hooks_moved_still_starts_plain():
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.platforms import current_platform\n"
        "pre = current_platform.pre_register_and_update\n"
        "EngineArgs.from_cli_args = staticmethod(lambda args: 'plain')  # another vLLM's API\n"
        "from vllm_wa.serving.plugin import register; register()\n"
        "assert current_platform.pre_register_and_update == pre  # no half-installed hook\n"
        "print(EngineArgs.from_cli_args(None))\n"
    )
    out = _plugin_run(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("plain")
    assert "cannot add the --wa-* options to this vLLM" in out.stderr


def test_a_content_length_that_is_not_ascii_digits_is_left_to_the_streams_count():
    """``"²".isdigit()`` is true and ``int("²")`` raises: behind a server that
    passes such a header on, a PUT /wa/params failed with an exception."""
    from vllm_wa.serving.params_api import read_body

    class Req:
        def __init__(self, length: str) -> None:
            self.headers = {"content-length": length}

        async def stream(self):
            yield b'{"mode": "auto"}'

    assert asyncio.run(read_body(Req("\u00b2"), 100)) == b'{"mode": "auto"}'
    # Over the limit: refused before the stream is read.
    assert asyncio.run(read_body(Req("500"), 100)) is None
    # int() refuses over 4,300 digits (httptools passes such a header on).
    assert asyncio.run(read_body(Req("0" * 5000 + "16"), 100)) == b'{"mode": "auto"}'
    assert asyncio.run(read_body(Req("9" * 5000), 100)) is None
    assert asyncio.run(read_body(Req("0" * 5000 + "101"), 100)) is None
    assert asyncio.run(read_body(Req("100"), 100)) == b'{"mode": "auto"}'


def test_the_configs_seed_params_run_in_the_queue_until_the_first_refit(tmp_path):
    """``seed_params`` in the config: the live queue runs them, as GET
    /wa/params reports, until the tuner's first choice (LRU first) replaces
    them, exactly as a --wa-params file does."""
    seed = tmp_path / "seed.json"
    seed.write_text(json.dumps({"a": {"agent_1": 0.02, "chat_1": 1.0}, "p": {"agent_1": 0.9, "chat_1": 0.1}}))
    e = Engine(ControllerConfig(seed_params=str(seed), refit_interval_s=1.0), ServingSettings(online=True))
    state = engine_side.wa_get_state(e.core)
    live = e.handle.queue.params
    assert state["params_source"] == live.source == "pr-json"
    assert sorted(live.models) == sorted(state["params"]["a"]) == ["agent_1", "chat_1"]
    e.clock.advance(1.0)
    e.controller.refit()
    live = e.handle.queue.params
    assert live.source == "online:lru" and not live.models
    assert engine_side.wa_get_state(e.core)["params_source"] == "online:lru"


def test_the_engines_run_the_config_and_params_the_api_server_checked(tmp_path, monkeypatch):
    """Each --wa-* file is read once: a pipe (``--wa-config <(render)``) gives
    its content only once, and a file edited after the check must not reach
    the engines unchecked.  The settings name private copies of the bytes
    that were checked."""
    from vllm_wa.serving import plugin
    from vllm_wa.serving.settings import ENV_CONFIG, ENV_ONLINE, ENV_PARAMS, ENV_SEED_PARAMS

    monkeypatch.setattr(api_side, "install", lambda settings: None)
    for name in (ENV_ONLINE, ENV_CONFIG, ENV_PARAMS, ENV_SEED_PARAMS):  # restored after the test (export() sets them)
        monkeypatch.setenv(name, "0" if name == ENV_ONLINE else "")
    params = tmp_path / "p.json"
    params.write_text(json.dumps({"a": {"agent_1": 0.02}, "p": {"agent_1": 0.9}}))
    seed = tmp_path / "seed.json"
    seed.write_text(json.dumps({"a": {"human_1": 0.001}, "p": {"human_1": 0.5}}))
    read_fd, write_fd = os.pipe()
    os.write(write_fd, f"[controller]\nrefit_interval_s = 1.0\nmax_classes = 16\nseed_params = {str(seed)!r}\n".encode())
    os.close(write_fd)
    try:
        settings = plugin.enable_online(
            SimpleNamespace(wa_online=True, wa_config=f"/dev/fd/{read_fd}", wa_params=str(params))
        )
    finally:
        os.close(read_fd)
    params.write_text("not json any more")  # edited after the check
    seed.write_text("[]")  # the config's seed parameters too
    assert ServingSettings.from_env() == settings
    config = settings.controller_config()
    assert (config.refit_interval_s, config.max_classes) == (1.0, 16)
    assert config.seed_params != str(seed)
    assert sorted(WAParams.load(config.seed_params, max_classes=config.max_classes).models) == ["human_1"]
    assert settings.snapshot_max_age_s == 1.0
    assert settings.params_path != str(params)
    assert sorted(WAParams.load(settings.params_path, max_classes=config.max_classes).models) == ["agent_1"]
    assert os.stat(os.path.dirname(settings.params_path)).st_mode & 0o077 == 0  # private to its user


def test_a_scheduler_built_again_stops_the_earlier_controllers_job(monkeypatch):
    """vLLM may build its scheduler again in the same engine process; the
    earlier controller's refit job kept running beside the new one for good."""
    monkeypatch.setattr(ServingSettings, "from_env", classmethod(lambda cls: ServingSettings(online=True)))
    first, second = (SimpleNamespace(kv_cache_manager=make_manager(20)) for _ in range(2))
    engine_side._attach(first)
    try:
        assert first._vllm_wa_engine.scheduler.running
        engine_side._attach(second)
        assert not first._vllm_wa_engine.scheduler.running
        assert second._vllm_wa_engine.scheduler.running
    finally:
        for s in (first, second):
            s._vllm_wa_engine.stop()

"""``vllm-wa bench-serve`` without a real server: prompts, slices, failures, the replay of what was served.

The end-to-end agreement with a real ``vllm serve`` is in test_serving_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import math
import os
import signal
import subprocess
import sys
import time
from array import array

import pytest

from fake_vllm_server import FakeConfig, FakeServer
from vllm_wa.bench import report
from vllm_wa.bench.client import BenchClient, ClientConfig
from vllm_wa.bench.controller_scaling import time_scaled, to_toml
from vllm_wa.bench.prom import parse_metrics
from vllm_wa.bench.results import RequestRecord, RunResult
from vllm_wa.bench.server_info import BenchError
from vllm_wa.bench.slicing import SliceSpec, reblock, slice_trace
from vllm_wa.bench.workload import build_workload
from vllm_wa.controller.config import ControllerConfig
from vllm_wa.replay.trace import Trace, TraceRequest
from vllm_wa.sim.token_ids import block_token_ids, prompt_token_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def req(rid, t, ids, conv=0, n_in=None, out=4, tag="tool", outcome="tool", service=None, bs=16):
    ids = array("q", ids)
    return TraceRequest(rid, t, ids, n_in or len(ids) * bs, out, tag, conv, outcome, service)


def small_trace(n_conv=3, turns=4, bs=16, gap=1.0) -> Trace:
    """Conversations whose every turn extends the previous prompt by two blocks."""
    reqs = []
    for c in range(n_conv):
        ids: list[int] = []
        for k in range(turns):
            ids = ids + [1000 * (c + 1) + len(ids), 1000 * (c + 1) + len(ids) + 1]
            reqs.append(req(f"c{c}t{k}", c * 0.1 + k * gap, ids, conv=c, bs=bs))
    reqs.sort(key=lambda r: r.arrival)
    return Trace("small", bs, reqs, "bailian", conversations=True)


# ---- prompts ----------------------------------------------------------------------------------


def vllm_block_hashes(tokens: list[int], bs: int) -> list:
    """vLLM's own chained block hashes of a prompt."""
    from conftest import make_request

    return list(make_request("x", tokens, block_size=bs).block_hashes)


def test_prompt_tokens_reproduce_the_traces_prefix_sharing_in_vllms_hashes():
    bs = 16
    a = prompt_token_ids([1, 2, 3, 4], bs, 64)
    b = prompt_token_ids([1, 2, 9, 4], bs, 60)  # shares two blocks, then differs (same later id, other prefix)
    assert a == prompt_token_ids([1, 2, 3, 4], bs, 64)  # deterministic
    assert len(b) == 60 and b[:48] == prompt_token_ids([1, 2, 9], bs, 48)
    ha, hb = vllm_block_hashes(a, bs), vllm_block_hashes(b, bs)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert len(hb) == 3  # the partial last block is not hashed
    assert all(16 <= t < 384 for t in a)  # inside the tiny model's vocabulary
    assert block_token_ids(1, bs) != block_token_ids(2, bs)
    with pytest.raises(ValueError, match="do not fill"):
        prompt_token_ids([1, 2], bs, 40)


# ---- slices -----------------------------------------------------------------------------------


def shared_prefix(x, y) -> int:
    n = 0
    for a, b in zip(x, y):
        if a != b:
            break
        n += 1
    return n


def test_reblocking_keeps_which_prompts_share_which_tokens():
    t = Trace("t", 64, [req("a", 0, [1, 2, 3], n_in=150, bs=64), req("b", 1, [1, 2, 7], n_in=192, bs=64)], "agentic")
    split = reblock(t, 32)
    a, b = split.requests
    assert split.block_size == 32 and len(a.hash_ids) == 5 and len(b.hash_ids) == 6  # ceil(150/32), 192/32
    assert shared_prefix(a.hash_ids, b.hash_ids) == 4  # the two shared 64-token blocks
    merged = reblock(split, 64)
    assert [len(r.hash_ids) for r in merged.requests] == [3, 3]
    assert shared_prefix(*(r.hash_ids for r in merged.requests)) == 2
    with pytest.raises(ValueError, match="neither divides"):
        reblock(t, 48)


def test_slice_truncates_prompts_and_keeps_the_first_conversations_and_seconds():
    t = small_trace(n_conv=3, turns=4)
    s = slice_trace(t, SliceSpec(max_prompt_blocks=4, conversations=2, duration=2.5))
    assert {r.conversation for r in s.requests} == {0, 1}
    assert max(r.arrival for r in s.requests) < t.start + 2.5
    assert max(len(r.hash_ids) for r in s.requests) == 4
    assert all(r.input_tokens == len(r.hash_ids) * 16 for r in s.requests)
    assert any("truncated" in n for n in s.notes)
    with pytest.raises(ValueError, match="positive"):
        SliceSpec(max_prompt_blocks=0)


def test_workload_think_times_caps_and_requests_that_do_not_fit():
    t = Trace("w", 16, [
        req("a", 10.0, [1, 2], out=100, service=2.0),
        req("b", 20.0, [1, 2, 3], out=3),
        req("c", 30.0, list(range(100, 400)), conv=1),  # 300 blocks: over max_model_len
    ], "agentic", conversations=True)
    w = build_workload(t, max_output_tokens=16, max_model_len=1024)
    assert [r.trace_id for r in w.requests] == ["a", "b"]
    assert w.excluded_too_long == 1 and any("left out" in n for n in w.notes)
    a, b = w.requests
    assert (a.arrival, a.max_tokens, b.max_tokens) == (0.0, 16, 3)
    assert b.think == pytest.approx(20.0 - 10.0 - 2.0)
    with pytest.raises(ValueError, match="max_model_len"):
        build_workload(t, 16, max_model_len=8)


# ---- metrics ----------------------------------------------------------------------------------


def test_metrics_parsing_and_differences():
    text = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0\n'
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="m"} 2.0\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="40"} 1.0\n'
        "# TYPE vllm_wa_evicted_blocks_total gauge\n"
        'vllm_wa_evicted_blocks_total{class="tool",engine="0"} 7.0\n'
    )
    a = parse_metrics(text)
    assert (a.prefix_cache_queries, a.prefix_cache_hits, a.preemptions) == (150.0, 30.0, 2.0)
    assert a.cache_config["block_size"] == "32"
    b = parse_metrics(text.replace(" 30.0", " 45.0").replace(" 7.0", " 9.0"))
    d = b.minus(a)
    assert d["prefix_cache_hits"] == 15.0 and d["preemptions"] == 0.0
    assert d["wa"] == {'vllm_wa_evicted_blocks_total{class="tool",engine="0"}': 2.0}


# ---- the client against a stand-in server ------------------------------------------------------


def run_client(url: str, trace: Trace, **kw) -> RunResult:
    cfg = ClientConfig(url=url, time_scale=kw.pop("time_scale", 0.01), max_output_tokens=4, progress=False, **kw)
    client = BenchClient(cfg, trace)
    return asyncio.run(client.run())


def test_client_sends_token_prompts_tags_hints_and_records_usage():
    t = small_trace()
    with FakeServer(FakeConfig()) as srv:
        res = run_client(srv.url, t)
        sent = srv.cfg.received
    assert len(sent) == len(t.requests) and all(r.ok for r in res.requests)
    body = sent[0]
    assert body["ignore_eos"] and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["vllm_xargs"] == {"type_info": "tool", "wa_outcome": "tool"}
    by_conv: dict[int, list] = {}
    for r in res.requests:
        by_conv.setdefault(r.conversation, []).append(r)
    for recs in by_conv.values():  # closed loop: a turn starts after the previous reply
        assert all(b.sent >= a.done for a, b in zip(recs, recs[1:]))
    s = report.summarize(res)
    assert s["failed"] == 0 and s["cached_tokens"] == s["server"]["prefix_cache_hits"]
    assert s["qttft_ms"]["p50"] == pytest.approx(1.5)


def test_block_size_mismatch_is_refused_before_sending_anything():
    with FakeServer(FakeConfig(block_size=32)) as srv:
        with pytest.raises(BenchError, match="16-token blocks but the server .* uses 32-token blocks.*--reblock 32"):
            run_client(srv.url, small_trace(bs=16))
        assert srv.cfg.received == []


def test_unreachable_server_and_refused_key_say_so():
    with FakeServer(FakeConfig()) as srv:
        url = srv.url
    with pytest.raises(BenchError, match="cannot reach the server"):
        run_client(url, small_trace())
    with FakeServer(FakeConfig(api_key="right")) as srv:
        with pytest.raises(BenchError, match="refused the API key"):
            run_client(srv.url, small_trace(), api_key="wrong")
        assert run_client(srv.url, small_trace(), api_key="right").requests


def test_requests_failing_mid_run_are_counted_and_the_run_goes_on():
    t = small_trace(n_conv=2, turns=4)
    with FakeServer(FakeConfig(fail_http={2}, fail_stream={5})) as srv:
        res = run_client(srv.url, t)
    assert len(res.requests) == len(t.requests)  # every turn was still sent
    failed = [r for r in res.requests if not r.ok]
    assert len(failed) == 2
    assert any("HTTP 500" in r.error for r in failed) and any("stream" in r.error for r in failed)
    s = report.summarize(res)
    assert s["failed"] == 2 and s["completed"] == len(t.requests) - 2


def test_the_hit_rate_comparison_pairs_the_requests_both_runs_completed():
    """Same trace, same (history-free) fake cache; one run loses its three
    1-block prompts (which hit nothing). Compared over what each completed,
    the failures read as a gain of 7 points."""
    reqs = [req(f"r{k}", 0.01 * k, [5000 + k] if k % 2 == 0 else [1, 2, 3, 4]) for k in range(8)]
    t = Trace("t", 16, reqs, "bailian", conversations=True)
    with FakeServer(FakeConfig()) as srv:
        full = run_client(srv.url, t, label="lru@100")
    with FakeServer(FakeConfig(fail_stream={0, 2, 4})) as srv:
        lossy = run_client(srv.url, t, label="wa-online@100")
    a, b = report.summarize(full), report.summarize(lossy)
    assert (a["failed"], b["failed"]) == (0, 3) and b["token_hit_rate"] > a["token_hit_rate"] + 0.05
    hit_a, hit_b, n = report.paired_hit_rates(full, lossy)
    assert n == 5 and hit_a == hit_b
    assert "hit rate +0.00 points on the 5 requests both completed" in report.format_table([a, b], results=[full, lossy])
    assert "hit rate - (the runs lost 3 and 0 requests" in report.format_table([a, b])


def test_a_server_that_falls_behind_the_schedule_is_reported():
    """The closed loop waits for each reply: a slow server stretches the run, and the report says so."""
    t = small_trace(n_conv=1, turns=6, gap=1.0)  # scheduled 0 .. 5 trace s
    # Replies the trace says took 0.9 s leave 0.1 trace s of think time: each reply's own latency
    # (ms, tens of ms on a loaded machine) is not added to every later turn's send time.
    timed = Trace(t.name, t.block_size, [dataclasses.replace(r, service_time=0.9) for r in t.requests], t.fmt,
                  conversations=True)
    with FakeServer(FakeConfig()) as srv:
        kept = report.summarize(run_client(srv.url, timed, time_scale=0.5))
    with FakeServer(FakeConfig(delay_s=0.1)) as srv:
        slow = report.summarize(run_client(srv.url, t, time_scale=0.01))
    assert kept["schedule_stretch"] < report.STRETCH_WARN and report.schedule_warning(kept) is None
    # Each reply takes 0.1 s against 0.01 s between scheduled arrivals: the last goes out ~0.5 s in, not 0.05.
    assert slow["schedule_stretch"] > 5
    assert slow["behind_schedule_trace_s"]["p50"] > 10  # trace seconds: client seconds / the time scale
    warning = report.schedule_warning(slow)
    assert warning is not None and "fell behind" in warning and "--time-scale" in warning
    assert "schedule stretch" in report.format_table([kept, slow])


def test_a_burst_the_server_fell_behind_on_is_reported_though_the_last_request_was_on_time():
    """Ten requests in 0.2 s at 0.1 s a reply, then a lull: the last request
    goes out on time (stretch 1.0) while most went out ~0.5 trace s late."""
    reqs = [req(f"a{k}", 0.02 * k, [1, 10 + k]) for k in range(10)] + [req("b0", 4.0, [2, 99], conv=1)]
    t = Trace("burst", 16, reqs, "bailian", conversations=True)
    with FakeServer(FakeConfig(delay_s=0.1)) as srv:
        s = report.summarize(run_client(srv.url, t, time_scale=1.0))
    assert s["schedule_stretch"] < report.STRETCH_WARN
    assert s["behind_schedule_trace_s"]["p90"] > report.LAG_WARN_SHARE * s["schedule_span_trace_s"]
    assert "90th percentile" in report.schedule_warning(s)


def test_a_run_against_a_used_server_says_so():
    t = small_trace(n_conv=1, turns=2)
    with FakeServer(FakeConfig()) as srv:
        first = report.summarize(run_client(srv.url, t))
        second = report.summarize(run_client(srv.url, t))
    assert first["queries_before_run"] == 0 and report.used_server_warning(first) is None
    assert second["queries_before_run"] > 0 and "already looked up" in report.used_server_warning(second)


def test_bad_client_arguments_are_refused_before_anything_runs(tmp_path):
    for bad in ({"time_scale": math.inf}, {"time_scale": 0.0}, {"request_timeout_s": 0.0},
                {"request_timeout_s": math.nan}, {"max_output_tokens": 0}):
        with pytest.raises(ValueError):
            ClientConfig(url="http://localhost:1", **bad)
    t = small_trace(n_conv=1, turns=2)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({
        "chat_id": i, "parent_chat_id": -1, "timestamp": r.arrival, "input_length": r.input_tokens,
        "output_length": r.output_tokens, "type": "text", "turn": 1, "hash_ids": list(r.hash_ids)}) + "\n"
        for i, r in enumerate(t.requests)))
    with FakeServer(FakeConfig()) as srv:
        for extra in (["--json", str(tmp_path / "missing" / "run.json")], ["--time-scale", "inf"],
                      ["--request-timeout", "0"]):
            p = subprocess.run([sys.executable, "-m", "vllm_wa.cli", "bench-serve", str(path), "--url", srv.url, *extra],
                               capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
            assert p.returncode == 2 and "Traceback" not in p.stderr and "error:" in p.stderr, p.stderr
        assert srv.cfg.received == []  # refused before a request was sent


def test_replay_of_what_the_server_saw(tmp_path):
    """Two identical prompts in a row: the second hits all but its last block (vLLM recomputes it)."""
    from vllm_wa.replay.loaders import load_trace
    from vllm_wa.replay.runner import ReplayConfig, prepare, sweep
    from vllm_wa.replay.served import replay_config

    res = RunResult(label="x", url="u", trace="t", block_size=16, time_scale=1.0, max_output_tokens=4,
                    server={"num_gpu_blocks": 20})
    from vllm_wa.bench.results import RequestRecord

    for i in range(2):
        res.requests.append(RequestRecord(
            index=i, request_id=f"r{i}", conversation=0, tag="tool", outcome_hint="tool", hash_ids=[1, 2, 3, 4],
            input_tokens=64, max_tokens=4, planned=i, sent=float(i), first_token=i + 0.01, done=i + 0.02,
            prompt_tokens=64, cached_tokens=48 * i, completion_tokens=4, finish_reason="length",
            server_ttft_ms=5.0, server_queue_ms=1.0, server_generation_ms=5.0))
    res.requests.append(RequestRecord(index=2, request_id="r2", conversation=1, tag="tool", outcome_hint=None,
                                      hash_ids=[9], input_tokens=16, max_tokens=4, planned=3.0, sent=3.0,
                                      error="HTTP 500: boom"))
    path = str(tmp_path / "served.json")
    res.write(path)
    trace = load_trace(path)
    assert trace.fmt == "served" and len(trace.requests) == 2 and "1 failed left out" in trace.notes[0]
    r0 = trace.requests[0]
    assert r0.arrival == pytest.approx(0.0 + 0.001 + 0.002) and r0.service_time == pytest.approx(0.010)
    for policy in ("lru", "wa-online"):
        [r] = sweep(prepare(trace, [policy], replay_config(ReplayConfig(engine="vllm"))), [policy], [20], jobs=1)
        assert r.hit_tokens == 48 and r.prompt_tokens == 128 and r.overflow == 0


def test_a_malformed_served_record_is_an_error_naming_it_or_skipped_and_counted(tmp_path):
    """A bench-serve result passes the checks every trace format does: records
    that are not objects, non-string
    outcomes, booleans as ids and absurd lengths name the record (or are
    skipped and counted with --skip-bad); none is a traceback or a silent result."""
    from vllm_wa.bench.results import RequestRecord
    from vllm_wa.replay.loaders import TraceFormatError, load_trace

    def result(**changes):
        res = RunResult(label="x", url="u", trace="t", block_size=16, time_scale=1.0, max_output_tokens=4)
        for i in range(3):
            res.requests.append(RequestRecord(
                index=i, request_id=f"r{i}", conversation=i, tag="chat", outcome_hint=None, hash_ids=[10 * i, 10 * i + 1],
                input_tokens=32, max_tokens=4, planned=float(i), sent=float(i), done=i + 0.5,
                prompt_tokens=32, completion_tokens=4, finish_reason="length"))
        path = str(tmp_path / "served.json")
        res.write(path)
        with open(path) as f:
            d = json.load(f)
        for key, value in changes.items():
            d["requests"][1][key] = value
        if "record" in changes:
            d["requests"][1] = changes["record"]
        with open(path, "w") as f:
            json.dump(d, f)
        return path

    assert len(load_trace(result()).requests) == 3
    for changes, msg in [
        ({"record": "oops"}, "record 1: not an object"),
        ({"hash_ids": [True, 11]}, "booleans"),
        ({"hash_ids": [-1, 11]}, "negative"),
        ({"outcome_hint": ["tool"]}, "outcome_hint"),
        ({"completion_tokens": 10**18}, "completion_tokens"),
        ({"completion_tokens": -100}, "completion_tokens"),
        ({"prompt_tokens": "32"}, "prompt_tokens"),
        ({"conversation": 1.7}, "conversation"),
        # Finite timings whose sum is not: the request would hold its blocks forever.
        ({"first_token": 1.6, "server_queue_ms": 1.0, "server_ttft_ms": 1e308, "server_generation_ms": 1e308},
         "float range"),
        ({"sent": -1e308, "done": 1e308}, "float range"),  # each finite, the service time not
    ]:
        path = result(**changes)
        with pytest.raises(TraceFormatError, match=msg):
            load_trace(path)
        trace = load_trace(path, skip_bad=True)
        assert len(trace.requests) == 2 and trace.skipped_lines == 1, changes
    # A repeated id is another block behind its prefix, as in every format (vLLM chains the hashes).
    trace = load_trace(result(hash_ids=[10, 10]))
    assert len(trace.requests) == 3 and len(set(trace.requests[1].hash_ids)) == 2
    assert [n for n in trace.notes if "another prefix" in n]
    # An integer past the float range is no timing, as a missing or non-finite one.
    assert len(load_trace(result(server_queue_ms=10**400, first_token=1.6, server_ttft_ms=1.0)).requests) == 3
    # Compressed, or with its keys sorted (the format tag no longer first), it is still a bench-serve result.
    with open(result()) as f:
        d = json.load(f)
    with gzip.open(tmp_path / "served.json.gz", "wt") as f:
        json.dump(d, f, sort_keys=True, indent=2)
    assert len(load_trace(str(tmp_path / "served.json.gz")).requests) == 3
    # Compressed under a name that does not say so: read by its first bytes, as a trace is.
    os.replace(tmp_path / "served.json.gz", tmp_path / "served-gzipped.json")
    assert len(load_trace(str(tmp_path / "served-gzipped.json")).requests) == 3
    d["requests"] = "abc"
    with open(path, "w") as f:
        json.dump(d, f)
    with pytest.raises(TraceFormatError, match="must be a list"):
        load_trace(path)


def test_interrupted_run_writes_what_was_measured(tmp_path):
    trace_path = tmp_path / "t.jsonl"
    with open(trace_path, "w") as f:
        for k in range(40):
            f.write(json.dumps({"chat_id": k, "parent_chat_id": k - 1 if k else -1, "timestamp": k * 0.01,
                                "input_length": 32, "output_length": 2, "type": "text", "turn": k + 1,
                                "hash_ids": [7, 100 + k]}) + "\n")
    out = tmp_path / "run.json"
    with FakeServer(FakeConfig(delay_s=0.2)) as srv:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_wa.cli", "bench-serve", str(trace_path), "--url", srv.url,
             "--json", str(out), "--label", "cut-short"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            # A shell that runs the suite in the background ignores SIGINT, and the child would
            # inherit that: restore the default so Ctrl-C reaches the client as it does in a terminal.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + 120
        while len(srv.cfg.received) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    res = RunResult.read(str(out))
    assert res.interrupted and res.label == "cut-short"
    assert 3 <= len(res.requests) < 40
    assert sum(r.ok for r in res.requests) >= 2
    assert res.metrics_after  # the server's counters were read after the interruption
    assert "run ended early" in output


# ---- controller config and report helpers ---------------------------------------------------------


def test_time_scaled_controller_config_round_trips(tmp_path):
    cfg = time_scaled(ControllerConfig(), 0.05)
    assert cfg.memory_s == pytest.approx(90.0) and cfg.refit_interval_s == 1.0
    assert {c.horizon for c in cfg.candidates} == {h * 0.05 for h in {c.horizon for c in ControllerConfig().candidates}}
    p = tmp_path / "c.toml"
    p.write_text(to_toml(cfg))
    assert ControllerConfig.load(str(p)) == cfg


def test_candidate_seconds_from_the_controller_or_its_switches():
    before = [{"engine": 0, "seconds_on_candidate": {"lru": 10.0, "wa": 0.0}}]
    after = [{"engine": 0, "seconds_on_candidate": {"lru": 40.0, "wa": 30.0}}]
    assert report.candidate_seconds(before, after) == ({"lru": 30.0, "wa": 30.0}, "seconds_on_candidate")
    before = [{"engine": 0, "active_candidate": "lru", "last_refit": 100.0}]
    after = [{"engine": 0, "active_candidate": "wa", "last_refit": 160.0,
              "switches": [{"time": 50.0, "to": "lru"}, {"time": 120.0, "from": "lru", "to": "wa"}]}]
    assert report.candidate_seconds(before, after) == ({"lru": 20.0, "wa": 40.0}, "switches")
    assert report.percentile([1, 2, 3, 4], 50) == 2.5 and report.percentile([], 50) is None


# ---- the make bench-serve driver --------------------------------------------------------------


def write_bailian(path, n_conv=3, turns=4):
    with open(path, "w") as f:
        for c in range(n_conv):
            ids: list[int] = []
            for k in range(turns):
                ids = ids + [1000 * (c + 1) + len(ids), 1000 * (c + 1) + len(ids) + 1]
                f.write(json.dumps({"chat_id": 100 * c + k, "parent_chat_id": 100 * c + k - 1 if k else -1,
                                    "timestamp": c + 10.0 * k, "input_length": 16 * len(ids), "output_length": 50,
                                    "type": "text", "turn": k + 1, "hash_ids": ids}) + "\n")


def test_suite_dry_run_plans_same_size_servers_and_refuses_caches_too_small(tmp_path, capsys):
    from vllm_wa.bench import suite

    trace = tmp_path / "t.jsonl"
    write_bailian(trace)
    common = ["--trace", str(trace), "--dry-run", "--out-dir", str(tmp_path / "out"), "--block-size", "32",
              "--max-prompt-blocks", "3", "--max-output-tokens", "8"]
    assert suite.main(common + ["--sizes", "50%,100%"]) == 0
    out = capsys.readouterr().out
    servers = [line for line in out.splitlines() if "] server:" in line]
    assert len(servers) == 4  # lru and wa-online at each size
    assert sum("--wa-online --wa-bench-outcome-hints --wa-config" in s for s in servers) == 2
    assert all("--enforce-eager" in s and "--max-model-len 128 " in s for s in servers)  # 3 blocks + 8 tokens
    assert "12 requests in 3 conversations" in out and "(dry run: nothing started)" in out
    with pytest.raises(SystemExit, match="at least 5 blocks"):
        suite.main(common + ["--sizes", "4"])
    assert suite.main(["--trace", str(trace), "--dry-run", "--gpu", "--model", "/weights/m", "--sizes", "100%",
                       "--out-dir", str(tmp_path / "gpu")]) == 0
    out = capsys.readouterr().out
    gpu = [line for line in out.splitlines() if "] server:" in line]
    assert gpu and not any("--enforce-eager" in s or "VLLM_CPU" in s for s in gpu)
    assert "time scale 1 " in out and "the shipped defaults" in out


def test_suite_wa_candidate_runs_one_candidate_with_the_tuner_off(tmp_path, capsys):
    from vllm_wa.bench import suite

    trace = tmp_path / "t.jsonl"
    write_bailian(trace)
    name = "tag+outcome+think/hyper/posterior/L10"
    out_dir = tmp_path / "out"
    common = ["--trace", str(trace), "--out-dir", str(out_dir), "--block-size", "32", "--max-prompt-blocks", "3",
              "--sizes", "100%"]
    plan = suite.make_plan(suite.parse_args(common + ["--wa-candidate", name]))
    cfg = ControllerConfig.load(plan.wa_config)
    assert not cfg.tuner_enabled and cfg.initial == "tag+outcome+think/hyper/posterior/L0.5"  # horizon x 0.05
    assert cfg.refit_interval_s == 1.0 and cfg.memory_s == pytest.approx(90.0)  # still scaled by 0.05
    with pytest.raises(SystemExit, match="must name a candidate"):
        suite.make_plan(suite.parse_args(common + ["--wa-candidate", "nope"]))
    with pytest.raises(SystemExit, match="scaled shipped config"):
        suite.make_plan(suite.parse_args(common + ["--wa-candidate", name, "--wa-config", "default"]))


# ---- what the review of the client found (2026-12-05) ------------------------------------------------

SAMPLE = os.path.join(ROOT, "vllm_wa", "data", "agentic-coding-sample.tar.xz")


def test_agentic_prompts_whose_last_partial_block_has_no_id_are_sent_as_their_blocks():
    """The agentic traces hash full blocks only: ``in`` runs past the last id by up to 63 tokens."""
    from vllm_wa.replay.loaders import load_trace

    full = load_trace(SAMPLE)
    assert any(r.input_tokens > len(r.hash_ids) * full.block_size for r in full.requests)
    gpu = slice_trace(full, SliceSpec(max_prompt_blocks=496, conversations=2))  # the suite's --gpu cut
    assert any("partial block has no id" in n for n in gpu.notes)
    for r in gpu.requests:
        prompt_token_ids(r.hash_ids, gpu.block_size, r.input_tokens)  # raised before: tokens past the ids
    merged = slice_trace(full, SliceSpec(block_size=128, conversations=2))
    for r in merged.requests:  # no merged block named again by the last id it covers
        assert len(set(r.hash_ids)) == len(r.hash_ids)
    with FakeServer(FakeConfig(block_size=64, max_model_len=10**6)) as srv:
        res = run_client(srv.url, gpu, time_scale=1e-5)
    assert len(res.requests) == len(gpu.requests) and all(r.ok for r in res.requests)


def test_a_stream_chunk_of_another_shape_fails_its_request_and_the_run_goes_on():
    odd = {
        0: '{"choices": [null]}',
        1: '{"choices": [], "usage": 7}',
        2: '{"choices": [], "usage": {"prompt_tokens": "32", "completion_tokens": 4}}',
        3: '{"choices": [], "usage": {"prompt_tokens": 32, "completion_tokens": 4, "prompt_tokens_details": "n/a"}}',
    }
    t = small_trace(n_conv=2, turns=4)
    with FakeServer(FakeConfig(odd_usage=odd)) as srv:
        res = run_client(srv.url, t)
        odd_ids = {srv.cfg.received[i]["request_id"] for i in odd}  # the server's n-th request got one
    assert len(res.requests) == len(t.requests)
    assert {r.request_id for r in res.requests if not r.ok} == odd_ids
    assert all("malformed" in r.error for r in res.requests if not r.ok)


def test_a_reply_cut_short_is_a_failed_request():
    t = small_trace(n_conv=1, turns=3)
    with FakeServer(FakeConfig(cut_short={1})) as srv:
        res = run_client(srv.url, t)
    assert [r.ok for r in res.requests] == [True, False, True]
    assert "ended early: 1 of 4 tokens" in res.requests[1].error and "abort" in res.requests[1].error


def test_the_request_timeout_bounds_the_whole_streamed_reply():
    t = small_trace(n_conv=1, turns=1)
    with FakeServer(FakeConfig(stream_s=2.0)) as srv:  # a token every 0.05 s: no single read waits long
        res = run_client(srv.url, t, request_timeout_s=0.5)
    # Before, the reply streamed to its end and passed.
    assert not res.requests[0].ok and "request timeout (0.5 s)" in res.requests[0].error


def test_a_trace_without_conversations_is_sent_open_loop():
    reqs = [req(f"m{k}", 0.01 * k, [5, 100 + k], conv=-1, outcome=None) for k in range(5)]
    t = Trace("mooncake-like", 16, reqs, "mooncake")  # names no conversation
    w = build_workload(t, 4)
    assert len(w.conversations) == 5 and all(r.think == 0.0 for r in w.requests)
    with FakeServer(FakeConfig(delay_s=1.0)) as srv:
        res = run_client(srv.url, t, time_scale=1.0)
    sent = sorted(r.sent for r in res.requests)
    assert all(r.ok for r in res.requests)
    assert sent[-1] - sent[0] < 0.9  # each at its own time; one after another they would take 4 s
    with pytest.raises(ValueError, match="names no conversations"):
        slice_trace(t, SliceSpec(conversations=2))


def test_a_counter_that_fell_between_two_scrapes_was_reset_and_counts_from_zero():
    def text(queries, hits, evicted):
        return (
            "# TYPE vllm:prefix_cache_queries counter\n"
            f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}\n'
            f'vllm:prefix_cache_queries_total{{engine="1"}} 500\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            f'vllm:prefix_cache_hits_total{{engine="0"}} {hits}\n'
            "# TYPE vllm:request_success counter\n"
            f'vllm:request_success_total{{engine="0",finished_reason="length"}} {hits // 100}\n'
            "# TYPE vllm_wa_evicted_blocks counter\n"
            f'vllm_wa_evicted_blocks_total{{class="tool",engine="0"}} {evicted}\n'
        )

    before = parse_metrics(text(10000, 9000, 500))
    after = parse_metrics(text(2000, 200, 40))  # engine 0 restarted: these counted from zero
    d = after.minus(before)
    assert d["prefix_cache_queries"] == 2000 and d["prefix_cache_hits"] == 200  # -8000 and -8800 before
    assert d["finished"] == {"length": 2}
    assert d["wa"] == {'vllm_wa_evicted_blocks_total{class="tool",engine="0"}': 40}
    grown = parse_metrics(text(12000, 9500, 600)).minus(before)
    assert (grown["prefix_cache_queries"], grown["prefix_cache_hits"]) == (2000, 500)


def _send_all(bench: BenchClient, handler, requests) -> list[RequestRecord]:
    import httpx

    async def go():
        bench._stop = asyncio.Event()
        recs = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for r in requests:
                rec = RequestRecord(
                    index=r.index, request_id=str(r.index), conversation=0, tag=r.tag, outcome_hint=None,
                    hash_ids=list(r.hash_ids), input_tokens=r.input_tokens, max_tokens=r.max_tokens,
                    planned=0.0, scheduled=0.0,
                )
                await bench._send(client, "m", r, rec)
                recs.append(rec)
        return recs

    return asyncio.run(go())


def test_an_answer_from_the_server_ends_a_run_of_unreachable_requests():
    import httpx

    calls = []

    def handler(request):
        calls.append(1)
        if len(calls) % 2:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(503, text="overloaded")

    t = small_trace(n_conv=1, turns=5)
    bench = BenchClient(ClientConfig(url="http://x", max_consecutive_unreachable=3, progress=False), t)
    recs = _send_all(bench, handler, build_workload(t, 4).requests)
    assert len(recs) == 5 and not any(r.ok for r in recs)
    # unreachable, 503, unreachable, 503, unreachable: never 3 in a row
    assert not bench._stop.is_set() and not bench.result.stop_reason


def test_connections_a_server_going_down_drops_unanswered_count_as_unreachable():
    """A server shutting down accepts a connection and closes it with no reply
    (httpx: RemoteProtocolError, ReadError). Only refusals counted, so a run of
    such drops never stopped the client: CI saw 24 failures in a row and a run
    reported as complete."""
    import httpx

    kinds = [httpx.RemoteProtocolError("Server disconnected without sending a response."),
             httpx.ReadError("Connection reset by peer"), httpx.ConnectError("refused")]

    def handler(request):
        raise kinds.pop(0)

    t = small_trace(n_conv=1, turns=5)
    bench = BenchClient(ClientConfig(url="http://x", max_consecutive_unreachable=3, progress=False), t)
    recs = _send_all(bench, handler, build_workload(t, 4).requests[:3])
    assert all("cannot reach the server" in r.error for r in recs)
    assert "3 requests in a row could not reach the server" in bench.result.stop_reason


def test_a_stream_broken_after_the_server_answered_is_not_unreachable():
    import httpx

    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"id": "x", "choices": [{"index": 0, "text": "x", "finish_reason": null}]}\n\n'
            raise httpx.ReadError("Connection reset by peer")

    t = small_trace(n_conv=1, turns=5)
    bench = BenchClient(ClientConfig(url="http://x", max_consecutive_unreachable=2, progress=False), t)
    recs = _send_all(bench, lambda request: httpx.Response(200, stream=Broken()), build_workload(t, 4).requests[:3])
    assert all(r.error.startswith("ReadError") for r in recs)
    assert not bench.result.stop_reason and bench._unreachable == 0


def test_a_run_the_server_walked_out_of_exits_non_zero_and_keeps_its_records(tmp_path):
    from vllm_wa.cli import main

    trace_path = tmp_path / "t.jsonl"
    records = [{"chat_id": k, "parent_chat_id": k - 1 if k else -1, "timestamp": k * 0.001, "input_length": 32,
                "output_length": 2, "type": "text", "turn": k + 1, "hash_ids": [7, 100 + k]} for k in range(30)]
    trace_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "run.json"
    with FakeServer(FakeConfig(gone_after=1)) as srv:  # one conversation: one request at a time
        code = main(["bench-serve", str(trace_path), "--url", srv.url, "--json", str(out), "--time-scale", "1"])
    assert code == 1  # 0 before: a run the server left looked like a finished one
    res = RunResult.read(str(out))
    assert res.interrupted and "could not reach the server" in res.stop_reason
    assert res.requests[0].ok and not any(r.ok for r in res.requests[1:])
    assert 20 <= len(res.requests) - 1 <= 21  # stopped at 20 in a row (one more may race the shutdown)


def test_a_models_list_without_a_model_object_is_a_clear_error():
    with FakeServer(FakeConfig(models_body='{"data": ["some-model"]}')) as srv, pytest.raises(BenchError, match="lists no model"):
        run_client(srv.url, small_trace())


def test_the_tiny_model_is_built_from_the_command_line(tmp_path, capsys):
    """The README's CPU recipe: ``python -m vllm_wa.bench.tiny_model DIR``, then ``vllm serve DIR``."""
    from vllm_wa.bench.tiny_model import main

    main([str(tmp_path / "tiny")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "tiny")
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert config["max_position_embeddings"] >= 2048 and (tmp_path / "tiny" / "tokenizer.json").exists()


# ---- what the review of the suite found (2026-12-07) --------------------------------------------------

FAKE_SERVE = """
import os, sys, time
sys.path.insert(0, {tests!r})
import fake_vllm_server as fv
port, gone = int(sys.argv[1]), sys.argv[2]
real = fv.ThreadingHTTPServer
fv.ThreadingHTTPServer = lambda addr, handler: real(("127.0.0.1", port), handler)
srv = fv.FakeServer(fv.FakeConfig(gone_after=None if gone == "-" else int(gone)))
srv.thread.start()
while not srv.closed:
    time.sleep(0.05)
os._exit(1)  # the API server exits once its HTTP side is gone (a crash)
"""


def test_the_suite_says_a_run_ended_early_and_exits_1(tmp_path, monkeypatch, capsys):
    """The --wa-online server went away after 3 replies: the client stopped
    after 20 unreachable requests in a row, and the suite printed the rest as
    a result and exited 0 (the bench-serve CLI exits 1)."""
    from vllm_wa.bench import server_proc, suite

    fake = tmp_path / "fake_serve.py"
    fake.write_text(FAKE_SERVE.format(tests=os.path.join(ROOT, "tests")))
    monkeypatch.setattr(server_proc.ServerSpec, "argv", lambda self, vllm="vllm": [
        sys.executable, str(fake), str(self.port), "3" if self.wa_online else "-"])
    monkeypatch.setattr(suite, "build_tiny_model", lambda *a, **k: None)
    trace = tmp_path / "t.jsonl"
    with open(trace, "w") as f:
        for c in range(6):
            ids: list[int] = []
            for k in range(5):
                ids = ids + [1000 * (c + 1) + k]
                f.write(json.dumps({"chat_id": 10 * c + k, "parent_chat_id": 10 * c + k - 1 if k else -1,
                                    "timestamp": 0.01 * c + 0.05 * k, "input_length": 16 * len(ids),
                                    "output_length": 2, "type": "text", "turn": k + 1, "hash_ids": ids}) + "\n")
    out = tmp_path / "out"
    code = suite.main(["--trace", str(trace), "--out-dir", str(out), "--block-size", "16", "--sizes", "100%",
                       "--no-fidelity", "--wa-config", "default", "--startup-timeout", "60"])
    assert code == 1
    assert "the run ended early" in capsys.readouterr().out
    written = json.loads((out / "bench-serve.json").read_text())
    assert written["complete"] is False
    assert {r["policy"]: bool(r["ended_early"]) for r in written["runs"]} == {"lru": False, "wa-online": True}


def test_stopping_a_server_stops_its_process_group_after_the_leader_died():
    """A crashed API server leaves its engine core running in its process
    group; stop() did nothing once the leader had exited."""
    from vllm_wa.bench.server_proc import stop_process_group

    proc = subprocess.Popen(["sh", "-c", "sleep 300 & exit 1"], start_new_session=True)
    proc.wait(10)
    os.killpg(proc.pid, 0)  # the child ("engine core") is still in the group
    stop_process_group(proc, grace_s=10.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the server's process group outlived stop()")


def test_sigterm_interrupts_like_ctrl_c_inside_and_changes_nothing_after():
    from vllm_wa.bench.server_proc import sigterm_interrupts

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), sigterm_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at once
    assert signal.getsignal(signal.SIGTERM) == before

"""End to end: a real ``vllm serve --wa-online`` of a tiny local model on CPU.

Starts the server (and once without the flag), sends tagged requests of two
classes with the OpenAI client so that blocks are reused and evicted, and
checks /wa/params, /metrics, bad input, pinning, and the Grafana dashboard's
queries through a real Prometheus scraping the server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tiny_model import build_tiny_hybrid_model, build_tiny_model
from vllm_wa.serving.cpu_shim import write_vllm_dist_shim

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "test-secret"
TIMING_FILE = os.environ.get("VLLM_WA_TIMINGS", "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: object = None, key: str | None = None, timeout: float = 30) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Server:
    def __init__(self, model: str, shim: str, log_dir: str, wa: bool, config: str | None = None,
                 extra: tuple[str, ...] = (), name: str = "") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        vllm_bin = os.path.join(os.path.dirname(sys.executable), "vllm")
        cmd = [
            vllm_bin, "serve", model, "--served-model-name", "tiny", "--port", str(self.port),
            "--host", "127.0.0.1", "--block-size", "32", "--max-model-len", "512", "--enforce-eager",
            "--num-gpu-blocks-override", "40", "--max-num-seqs", "4", "--api-key", API_KEY,
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-per-request-metrics",
        ]
        if wa:
            cmd += ["--wa-online", "--wa-allow-pin", "--wa-bench-outcome-hints"]
            cmd += ["--wa-config", config] if config else []
        cmd += list(extra)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([shim, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env["VLLM_WA_METRICS_INTERVAL"] = "1"
        env.pop("VLLM_WA_ONLINE", None)
        self.log_path = os.path.join(log_dir, f"server-{name or ('wa' if wa else 'plain')}.log")
        self.log = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=log_dir,
                                     start_new_session=True)
        deadline = t0 + 420
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log:\n{self.tail()}")
            try:
                if http("GET", self.url + "/health", timeout=2)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                pass
            time.sleep(0.5)
        else:
            self.stop()
            raise RuntimeError(f"server did not start; log:\n{self.tail()}")
        self.startup_s = time.monotonic() - t0

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


WORDS = "the quick brown fox jumps over the lazy dog user assistant tool call function result".split()


def text(seed: int, n_words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3 + i // 5) % len(WORDS)] for i in range(n_words))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    model = build_tiny_model(str(d / "tiny-model"))
    shim = write_vllm_dist_shim(str(d / "shim")) or str(d / "shim")
    cfg = d / "wa.toml"
    cfg.write_text(
        "[controller]\nrefit_interval_s = 1.0\nfit_interval_s = 1.0\nmin_samples = 2\nsample_rate = 1.0\nmemory_s = 600\n"
        # A handful of reuses per class: each class keeps its own fit (no separation test),
        # so the per-class path is what these tests exercise.
        "class_confidence = 0\n"
        # The tuner stays on the WA candidate: these tests check the serving path and the
        # dashboard's per-class series, which a demotion to LRU would remove (the tuner's
        # switching is tested on generated traces in test_tuner.py).
        # Only that candidate is fitted: fits of every default candidate each second kept
        # an engine core busy and slowed the plain server beside it.
        "[tuner]\nenabled = false\ninitial = \"tag+outcome/hyper/posterior/L10\"\n"
        "[[tuner.candidates]]\nfeatures = [\"tag\", \"outcome\"]\n"
    )
    return {"dir": str(d), "model": model, "shim": shim, "config": str(cfg)}


@pytest.fixture(scope="module")
def wa_server(workdir):
    s = Server(workdir["model"], workdir["shim"], workdir["dir"], wa=True, config=workdir["config"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server(workdir, wa_server):
    s = Server(workdir["model"], workdir["shim"], workdir["dir"], wa=False)
    yield s
    s.stop()


def send_conversations(url: str, n_rounds: int = 6) -> int:
    # 6 conversations growing to ~13 blocks of 32 tokens each: more than the
    # 40-block cache holds, so blocks are both reused and evicted.
    """Two workloads: quick agent loops and slower chats, sharing prefixes per conversation."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key=API_KEY)
    served = 0
    history = {("agent_1", c): text(c, 120) for c in range(3)}
    history.update({("chat_1", c): text(100 + c, 120) for c in range(3)})
    for r in range(n_rounds):
        for (tag, conv), prompt in list(history.items()):
            if tag == "chat_1" and r % 2:
                continue  # people come back less often than tools
            out = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=2, temperature=0.0,
                extra_body={"vllm_xargs": {"type_info": tag}},
            )
            assert out.choices[0].text is not None
            served += 1
            history[(tag, conv)] = prompt + " " + text(r + conv, 55)
            time.sleep(0.05)
    return served


def wa_states(url: str) -> list[dict]:
    code, body = http("GET", url + "/wa/params", key=API_KEY)
    assert code == 200, body
    return json.loads(body)["engines"]


def wa_state(url: str) -> dict:
    engines = wa_states(url)
    assert len(engines) == 1
    return engines[0]


def wait_for_state(url: str, ok, timeout: float = 60.0) -> dict:
    """The state once ``ok(state)`` holds (GET serves a copy up to one poll interval old)."""
    deadline = time.monotonic() + timeout
    while True:
        st = wa_state(url)
        if ok(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.25)


def test_wa_online_server_learns_swaps_and_is_observable(wa_server):
    url = wa_server.url
    assert http("GET", url + "/wa/params")[0] == 401  # it lists every client's tags: the API key guards it
    first = wa_state(url)
    assert first["enabled"] and first["mode"] == "auto"
    pid0 = first["pid"]
    served = send_conversations(url)
    assert served >= 25
    # A few refits after the traffic: classes fitted and parameters swapped.
    r0 = wa_state(url)["refits"]
    st = wait_for_state(url, lambda s: s["refits"] >= r0 + 3 and s["swaps"] >= 1)
    # Learned per-class estimates, from both workloads.
    classes = st["classes"]
    assert any(name.startswith("agent_1") for name in classes), classes
    assert any(name.startswith("chat_1") for name in classes), classes
    fitted = [c for c in classes.values() if c["fitted"]]
    assert fitted and all(0 < c["reuse_probability"] <= 1 and c["reuse_rate"] > 0 for c in fitted)
    assert sum(c["reuses"] for c in classes.values()) > 0
    # Parameters were swapped live, on the same engine process.
    assert st["swaps"] >= 1 and st["params_version"] > first["params_version"]
    assert st["pid"] == pid0 and wa_server.proc.poll() is None
    assert st["errors"] == 0 and st["hook_errors"] == 0
    # Blocks were evicted and reused in the small cache.
    code, metrics = http("GET", url + "/metrics")
    assert code == 200
    assert "vllm_wa_params_version" in metrics
    assert 'vllm_wa_reuse_rate{class="' in metrics
    assert "vllm_wa_evicted_blocks_total" in metrics
    evicted = sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
        if line.startswith("vllm_wa_evicted_blocks_total{")
    )
    assert evicted > 0
    # The real-cache check's two sides, counted on the same sampled blocks
    # through vLLM's own prefix-cache hits: the running candidate's prediction
    # and what the real cache had.
    ran = [c for c in st["calibration"]["total"].values() if c["lookups"]]
    assert ran and all(0 <= c["real_hit_rate"] <= 1 and 0 <= c["predicted_hit_rate"] <= 1 for c in ran)
    assert sum(c["real_hit_rate"] * c["lookups"] for c in ran) > 0  # the conversations came back
    if st["calibration"]["window"].get(st["active_candidate"], {}).get("lookups"):
        # (Absent only while a candidate the tuner just switched to has seen no lookup.)
        assert 'vllm_wa_sampled_real_hit_ratio{engine="' in metrics
        assert 'vllm_wa_sampled_predicted_hit_ratio{engine="' in metrics
    # The API server's own counters, from its start (none lost).
    assert 'vllm_wa_api_outcome_reports_total{result="sent"}' in metrics
    assert 'vllm_wa_api_outcome_reports_total{result="dropped"} 0.0' in metrics
    # Requests kept being served while parameters were swapped.
    swaps_before = st["swaps"]
    assert send_conversations(url, n_rounds=2) > 0
    assert wait_for_state(url, lambda s: s["swaps"] > swaps_before)["swaps"] > swaps_before
    if TIMING_FILE:
        with open(TIMING_FILE, "a") as f:
            f.write(json.dumps({"server": "wa-online", "startup_s": wa_server.startup_s, "state": wa_state(url)}) + "\n")


def test_bad_tag_is_served_and_counted(wa_server):
    from openai import OpenAI

    client = OpenAI(base_url=wa_server.url + "/v1", api_key=API_KEY)
    before = wa_state(wa_server.url)["tags_invalid"]
    for bad in ["bad tag with spaces", "x" * 200, 17]:
        out = client.completions.create(
            model="tiny", prompt=text(9, 30), max_tokens=1, extra_body={"vllm_xargs": {"type_info": bad}}
        )
        assert out.choices
    st = wait_for_state(wa_server.url, lambda s: s["tags_invalid"] >= before + 3)
    assert st["tags_invalid"] == before + 3  # once per request


def test_put_params_needs_key_valid_values_and_can_pin(wa_server):
    url = wa_server.url + "/wa/params"
    good = {"params": {"a": {"agent_1": 0.2, "chat_1": 0.01}, "p": {"agent_1": 0.9, "chat_1": 0.5}}}
    before = wa_state(wa_server.url)
    code, _ = http("PUT", url, good)
    assert code == 401
    for bad in [
        {"params": {"a": {"x": 1.0}, "p": {"x": 2.0}}},
        {"params": {"a": {"x": -1}, "p": {"x": 0.5}}},
        {"params": {"a": {"x": 1.0}}},
        {"mode": "sideways"},
        [1, 2, 3],
    ]:
        code, body = http("PUT", url, bad, key=API_KEY)
        assert code == 422, (bad, body)
    code, _ = http("PUT", url, None, key=API_KEY)
    assert code in (400, 422)
    after = wa_state(wa_server.url)
    assert after["mode"] == "auto" == before["mode"]
    # None of the refused bodies reached the queue: no pin, no class "x".
    assert after["params_source"] != "pinned" and "x" not in after["params"].get("a", {})
    code, body = http("PUT", url, good, key=API_KEY)
    assert code == 200, body
    pinned = wa_state(wa_server.url)
    assert pinned["mode"] == "pinned"
    assert pinned["params"]["a"]["agent_1"] == pytest.approx(0.2)
    # Refits keep the pin.
    later = wait_for_state(wa_server.url, lambda s: s["refits"] >= pinned["refits"] + 2)
    assert later["refits"] >= pinned["refits"] + 2
    assert later["mode"] == "pinned" and later["params"]["a"]["agent_1"] == pytest.approx(0.2)
    code, body = http("PUT", url, {"mode": "auto"}, key=API_KEY)
    assert code == 200, body
    assert wa_state(wa_server.url)["mode"] == "auto"


def _prometheus_query(prom: str, expr: str) -> list:
    q = urllib.parse.urlencode({"query": expr})
    code, body = http("GET", f"{prom}/api/v1/query?{q}")
    assert code == 200, body
    data = json.loads(body)
    assert data["status"] == "success", data
    return data["data"]["result"]


def test_grafana_dashboard_queries_return_series(wa_server, workdir):
    prom_bin = shutil.which("prometheus")
    assert prom_bin, "Debian's prometheus package is part of the test set-up (make test installs it)"
    with open(os.path.join(ROOT, "dashboards", "vllm-wa.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 9
    d = os.path.join(workdir["dir"], "prometheus")
    os.makedirs(d, exist_ok=True)
    port = free_port()
    with open(os.path.join(d, "prometheus.yml"), "w") as f:
        f.write(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: vllm\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{wa_server.port}']\n"
        )
    log = open(os.path.join(d, "prometheus.log"), "w")
    proc = subprocess.Popen(
        [prom_bin, f"--config.file={d}/prometheus.yml", f"--storage.tsdb.path={d}/data",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    prom = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if _prometheus_query(prom, "up") and _prometheus_query(prom, "vllm_wa_params_version"):
                    break
            except (urllib.error.URLError, ConnectionError, AssertionError):
                pass
            time.sleep(1)
        # Traffic while Prometheus scrapes, so every rate() has samples: two scrapes after it, which
        # a loaded machine (1 s scrape timeout) may take longer than a fixed 6 s to make.
        send_conversations(wa_server.url, n_rounds=3)
        deadline = time.monotonic() + 60
        while True:
            empty = [expr for expr in exprs if not _prometheus_query(prom, expr.replace("$__rate_interval", "1m"))]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not empty, f"panel queries without series: {empty}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()


def test_generated_tags_and_put_bodies_over_http(wa_server):
    """The fuzz test's inputs, a smaller batch, against the live server (see test_fuzz_serving.py)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from serving_harness import auth_header, bearer_tokens, pin_bodies, tag_values

    url = wa_server.url
    seen: dict[str, dict[int, int]] = {"tags": {}, "bodies": {}}

    @settings(max_examples=5, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(tags=st.lists(tag_values, min_size=20, max_size=20),
           bodies=st.lists(st.tuples(pin_bodies(), bearer_tokens), min_size=20, max_size=20))
    def batch(tags, bodies):
        for i, tag in enumerate(tags):
            body = {"model": "tiny", "prompt": text(i, 20), "max_tokens": 1, "vllm_xargs": {"type_info": tag}}
            req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json", **auth_header(API_KEY)})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    code = r.status
            except urllib.error.HTTPError as e:
                code = e.code
            seen["tags"][code] = seen["tags"].get(code, 0) + 1
            assert code in (200, 400), (tag, code)
        for raw, token in bodies:
            req = urllib.request.Request(url + "/wa/params", data=raw, method="PUT",
                                         headers={"Content-Type": "application/json", **auth_header(token)})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    code = r.status
            except urllib.error.HTTPError as e:
                code = e.code
            seen["bodies"][code] = seen["bodies"].get(code, 0) + 1
            assert code in (200, 400, 401, 413, 422), (raw[:200], code)

    batch()
    assert sum(seen["tags"].values()) >= 100 and sum(seen["bodies"].values()) >= 100, seen
    assert http("PUT", url + "/wa/params", {"mode": "auto"}, key=API_KEY)[0] == 200
    st_ = wait_for_state(url, lambda s: s["mode"] == "auto")
    assert st_["hook_errors"] == 0 and st_["errors"] == 0 and wa_server.proc.poll() is None
    code, metrics = http("GET", url + "/metrics")
    assert code == 200
    classes = {line.split('class="', 1)[1].split('"', 1)[0] for line in metrics.splitlines()
               if line.startswith("vllm_wa_freed_blocks_total{")}
    assert 0 < len(classes) <= 64


def test_without_flag_nothing_changes(plain_server):
    plain = plain_server
    code, _ = http("GET", plain.url + "/wa/params")
    assert code == 404
    send_conversations(plain.url, n_rounds=1)
    code, metrics = http("GET", plain.url + "/metrics")
    assert code == 200 and "vllm:prefix_cache_queries" in metrics
    assert "vllm_wa_" not in metrics
    if TIMING_FILE:
        with open(TIMING_FILE, "a") as f:
            f.write(json.dumps({"server": "plain", "startup_s": plain.startup_s}) + "\n")


def test_bench_serve_agrees_with_both_servers_counters(plain_server, wa_server, tmp_path):
    """A shortened ``vllm-wa bench-serve`` run (16 real agentic conversations, prompts cut to
    8 blocks, 600 trace seconds at 1/30 speed) against the plain and the --wa-online server.

    Each server's prefix-cache hit counter grows by exactly the cached tokens the client
    was told, nothing is preempted (4 requests of at most 9 blocks fit the 40-block
    cache), both servers get the same requests, none fails, the --wa-online server
    applies the outcome hints, and the replay of the plain server's requests predicts
    its hit rate.
    """
    import asyncio

    from vllm_wa.bench import report
    from vllm_wa.bench.client import BenchClient, ClientConfig
    from vllm_wa.bench.slicing import SliceSpec, slice_trace
    from vllm_wa.bench.suite import predict
    from vllm_wa.replay.loaders import AgenticOptions, load_trace

    sample = os.path.join(ROOT, "vllm_wa", "data", "agentic-coding-sample.tar.xz")
    full = load_trace(sample, agentic=AgenticOptions(max_conversations=16, window=600, seed=0))
    trace = slice_trace(full, SliceSpec(block_size=32, max_prompt_blocks=8, duration=600))
    hints_before = wa_state(wa_server.url)["outcomes_reclassified"]
    results = {}
    for name, srv in (("lru", plain_server), ("wa-online", wa_server)):
        cfg = ClientConfig(url=srv.url, api_key=API_KEY, time_scale=1 / 30, max_output_tokens=8, label=name,
                           progress=False)
        res = asyncio.run(BenchClient(cfg, trace).run())
        s = report.summarize(res)
        assert s["failed"] == 0 and s["completed"] == len(trace.requests), s["errors"]
        assert s["cached_tokens_reported"] == s["completed"]
        assert s["cached_tokens"] == s["server"]["prefix_cache_hits"]
        assert s["prompt_tokens"] == s["server"]["prefix_cache_queries"]
        assert s["server"]["preemptions"] == 0
        assert s["ttft_ms"]["n"] == s["qttft_ms"]["n"] == s["completed"]
        results[name] = res
    sent = {
        name: [(r.index, r.hash_ids, r.input_tokens, r.max_tokens, r.tag, r.outcome_hint) for r in res.requests]
        for name, res in results.items()
    }
    assert sent["lru"] == sent["wa-online"]
    hinted = sum(r.outcome_hint is not None for r in results["wa-online"].requests)
    assert hinted > 0
    # GET /wa/params serves the snapshot the poller fetched, up to one interval old.
    st = wait_for_state(wa_server.url, lambda s: s["outcomes_reclassified"] - hints_before >= hinted, timeout=15)
    assert st["outcomes_reclassified"] - hints_before == hinted
    path = str(tmp_path / "lru.json")
    results["lru"].write(path)
    measured = report.summarize(results["lru"])["token_hit_rate"]
    predicted = predict(path, ["lru"], 40, None)["lru"]
    assert abs(predicted - measured) <= 0.02, (predicted, measured)
    if TIMING_FILE:
        with open(TIMING_FILE, "a") as f:
            f.write(json.dumps({"bench_serve": {"measured": measured, "predicted": predicted}}) + "\n")


def test_data_parallel_engines_each_report_and_take_a_pin(workdir, wa_server, plain_server):
    """``--data-parallel-size 2`` on CPU: two engine cores behind two API servers (vLLM then
    serves /metrics from a multiprocess registry); every API server reaches both engines."""
    wa_server.stop()  # more servers at once would not fit this machine's cores
    plain_server.stop()
    dp = Server(workdir["model"], workdir["shim"], workdir["dir"], wa=True, config=workdir["config"],
                extra=("--data-parallel-size", "2"), name="dp")
    try:
        url = dp.url
        engines = wa_states(url)
        assert sorted(e["engine"] for e in engines) == [0, 1]
        assert all(e["enabled"] for e in engines) and len({e["pid"] for e in engines}) == 2
        assert send_conversations(url, n_rounds=2) > 0
        for _ in range(4):  # /metrics from either API server shows both engines, as counters
            code, metrics = http("GET", url + "/metrics")
            assert code == 200
            assert "# TYPE vllm_wa_refits_total counter" in metrics
            for eng in ("0", "1"):
                assert f'vllm_wa_refits_total{{engine="{eng}"}}' in metrics
                assert f'vllm_wa_params_version{{engine="{eng}"}}' in metrics
            # The API servers' own counters, summed over them by the multiprocess registry.
            assert 'vllm_wa_api_outcome_reports_total{result="dropped"}' in metrics
        pin = {"params": {"a": {"agent_1": 0.2}, "p": {"agent_1": 0.9}}, "features": ["tag"]}
        code, body = http("PUT", url + "/wa/params", pin, key=API_KEY)
        assert code == 200, body
        assert sorted(r["engine"] for r in json.loads(body)["engines"]) == [0, 1]
        deadline = time.monotonic() + 60
        while True:
            engines = wa_states(url)  # whichever API server answers
            if all(e["mode"] == "pinned" for e in engines) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert [e["params"]["a"] for e in engines] == [{"agent_1": pytest.approx(0.2)}] * 2
        assert http("PUT", url + "/wa/params", {"mode": "auto"}, key=API_KEY)[0] == 200
        if TIMING_FILE:
            with open(TIMING_FILE, "a") as f:
                f.write(json.dumps({"server": "wa-online-dp2", "startup_s": dp.startup_s}) + "\n")
    finally:
        dp.stop()


def test_a_hybrid_model_with_a_sliding_window_is_served_and_its_window_blocks_counted(workdir):
    """A Gemma 3 model (a 64-token sliding-window layer, then a full-attention
    one) under ``--wa-online``: two KV-cache groups, and vLLM frees the blocks
    that leave the window while a request still decodes, with no release hook.
    They are filed and counted under ``default``; every request is served, the
    prefix cache hits, and no hook fails.  (With 200 blocks little is evicted,
    so the queue's filing of such blocks is guarded by the engine-patch unit
    tests; this one checks serving and counting.  It runs after the
    data-parallel test, which stops the other servers.)"""
    model = build_tiny_hybrid_model(os.path.join(workdir["dir"], "tiny-hybrid"), sliding_window=64)
    s = Server(model, workdir["shim"], workdir["dir"], wa=True, config=workdir["config"],
               extra=("--num-gpu-blocks-override", "200"), name="hybrid")
    try:
        url = s.url
        history = {c: text(200 + c, 100) for c in range(3)}
        cached = []
        for turn in range(3):
            for c, prompt in list(history.items()):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 96, "ignore_eos": True,
                        "vllm_xargs": {"type_info": f"{'agent' if c else 'chat'}_1"}}
                code, out = http("POST", url + "/v1/completions", body, key=API_KEY, timeout=120)
                assert code == 200, out
                usage = json.loads(out)["usage"]
                cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                history[c] = prompt + " " + text(turn + c, 40)
        assert sum(cached[3:]) > 0  # later turns hit their conversation's prefix
        st = wait_for_state(url, lambda st: st["events_processed"] > 0)
        assert st["hook_errors"] == 0 and st["errors"] == 0
        deadline = time.monotonic() + 60
        while True:
            code, metrics = http("GET", url + "/metrics")
            freed = {
                line.split('class="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("vllm_wa_freed_blocks_total{")
            }
            if freed.get("default", 0) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert freed.get("default", 0) > 0, freed  # the window's blocks, freed mid-request
        assert any(v > 0 for k, v in freed.items() if k != "default"), freed  # releases, by class
    finally:
        s.stop()

"""/wa/params and the metrics collector over real engine-side objects (defects 2, 8 and 10 of issue 9)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from serving_harness import API_KEY, Engine, make_app
from starlette.testclient import TestClient

from vllm_wa.controller.config import ControllerConfig
from vllm_wa.serving import params_api
from vllm_wa.serving.metrics import WACollector
from vllm_wa.serving.pin_request import MAX_PIN_BODY_BYTES
from vllm_wa.serving.settings import ServingSettings
from vllm_wa.sim.clock import SettableClock

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SETTINGS = ServingSettings(online=True, allow_pin=True)


def config(**kw) -> ControllerConfig:
    return ControllerConfig(**{"refit_interval_s": 1.0, "fit_interval_s": 1.0, "min_samples": 2, "sample_rate": 1.0,
                               "initial": "tag+outcome/hyper/posterior/L10", **kw})


def traffic(engine: Engine, tags=("agent_1", "chat_1"), rounds: int = 3) -> None:
    for r in range(rounds):
        for i, tag in enumerate(tags):
            prompt = list(range(1000 * i, 1000 * i + 16 * (3 + r) + 1))
            engine.submit({"model": "m", "prompt": "x", "vllm_xargs": {"type_info": tag}}, prompt)
            engine.clock.advance(0.5)


@pytest.fixture
def engine():
    e = Engine(config(), SETTINGS)
    traffic(e)
    return e


# ---- defect 2: GET from the published snapshot; pins bounded; GET follows the API key ------------


def test_get_serves_the_cached_snapshot_without_engine_work_per_request(engine):
    app, client, _ = make_app([engine], SETTINGS)
    with TestClient(app) as http:
        for _ in range(50):
            r = http.get("/wa/params", headers=AUTH)
            assert r.status_code == 200
    assert client.calls["wa_get_snapshot"] == 1  # one fetch for 50 reads
    state = r.json()["engines"][0]
    assert state["enabled"] and state["mode"] == "auto" and "tags_invalid" in state
    # The answering API server's own counters (no reporter runs here).
    assert r.json()["api_server"] == {"outcome_reports_sent": 0, "outcome_reports_dropped": 0}


def test_get_copy_is_at_most_max_age_old(engine):
    clock = SettableClock(0.0)
    app, client, _ = make_app([engine], SETTINGS, max_age_s=2.0, clock=clock)
    with TestClient(app) as http:
        assert http.get("/wa/params", headers=AUTH).json()["engines"][0]["refits"] == 0
        engine.controller.refit()
        clock.advance(1.0)
        assert http.get("/wa/params", headers=AUTH).json()["engines"][0]["refits"] == 0  # cached
        clock.advance(1.5)
        assert http.get("/wa/params", headers=AUTH).json()["engines"][0]["refits"] == 1
    assert client.calls["wa_get_snapshot"] == 2


def test_get_needs_the_api_key_unless_opened(engine):
    app, _, _ = make_app([engine], SETTINGS)
    with TestClient(app) as http:
        assert http.get("/wa/params").status_code == 401
        assert http.get("/wa/params", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert http.get("/wa/params", headers=AUTH).status_code == 200
    open_app, _, _ = make_app([engine], ServingSettings(online=True, public_params=True))
    with TestClient(open_app) as http:
        assert http.get("/wa/params").status_code == 200
    keyless, _, _ = make_app([engine], SETTINGS, api_key=None)
    with TestClient(keyless) as http:
        assert http.get("/wa/params").status_code == 200


def test_pins_are_bounded_by_the_class_cap_and_the_body_size(engine):
    app, client, _ = make_app([engine], SETTINGS)
    cap = engine.handle.registry.max_classes
    too_many = {"params": {"a": {f"c{i}": 0.1 for i in range(cap + 1)}, "p": {f"c{i}": 0.5 for i in range(cap + 1)}}}
    huge = {"params": {"a": {"x": 0.1}, "p": {"x": 0.5}}, "features": ["tag"] + ["pad"] * MAX_PIN_BODY_BYTES}
    with TestClient(app) as http:
        r = http.put("/wa/params", json=too_many, headers=AUTH)
        assert r.status_code == 422 and "class cap" in r.json()["error"]
        r = http.put("/wa/params", content=json.dumps(huge), headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 413
    assert client.calls["wa_set_params"] == 0
    assert engine.controller.pinned is None


def test_a_pin_shows_in_the_next_get(engine):
    app, _, _ = make_app([engine], SETTINGS)
    with TestClient(app) as http:
        assert http.get("/wa/params", headers=AUTH).json()["engines"][0]["mode"] == "auto"
        r = http.put("/wa/params", json={"params": {"a": {"agent_1": 0.2}, "p": {"agent_1": 0.9}}}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert http.get("/wa/params", headers=AUTH).json()["engines"][0]["mode"] == "pinned"


@pytest.mark.parametrize("params", [
    {"a": {"agent_1": 1e-300}, "p": {"agent_1": 1e-30}, "mode": "ttl"},
    # Rates whose sum (the default model's mean) overflows the float range.
    {"a": {"agent_1": 1e308, "chat_1": 1e308}, "p": {"agent_1": 1, "chat_1": 1}, "mode": "pr"},
    # The largest float as a rate: its mean delay is subnormal, its inverse overflows.
    {"a": {"agent_1": 1.7976931348623157e308}, "p": {"agent_1": 1}, "mode": "pr"},
    {"a": {"agent_1": 1.7976931348623157e308}, "p": {"agent_1": 1}, "default": [[1, 0.1]], "mode": "pr"},
    # A mixture whose mean delay overflows it.
    {"a": {"agent_1": 1}, "p": {"agent_1": 1}, "mixture": {"agent_1": [[0.5, 3e-309], [0.5, 3e-309]]},
     "default": [[1, 0.1]], "mode": "posterior"},
])
def test_a_pin_of_extreme_but_valid_numbers_is_applied_and_refits_go_on(engine, params):
    """Each number passes its own check; together they once made a time to live
    of log(0), and sums past the float range once made a 500 (an overflow in
    the pooled default), a 503 (in the engines' copy of the pin) and a failure
    of every refit after it (in the published state)."""
    app, _, _ = make_app([engine], SETTINGS)
    with TestClient(app) as http:
        r = http.put("/wa/params", json={"params": params}, headers=AUTH)
        assert r.status_code == 200, r.text
        c = engine.controller
        assert c.pinned is not None and c.params.mode == params["mode"]
        engine.clock.advance(2.0)
        c.refit()
        assert c.errors == 0 and c.params.mode == params["mode"], c.last_error
        assert http.get("/wa/params", headers=AUTH).json()["engines"][0]["mode"] == "pinned"


def test_a_pin_with_more_mixture_components_than_a_fit_makes_is_refused(engine):
    """Every free-list head's score sums over its model's components on the
    engine thread: a pin within the body limit could otherwise carry
    thousands and slow every request."""
    app, client, _ = make_app([engine], SETTINGS)
    heavy = [[0, 1]] * 18_000  # within the body limit
    with TestClient(app) as http:
        r = http.put("/wa/params", json={"params": {"a": {}, "p": {}, "default": heavy}}, headers=AUTH)
        assert r.status_code == 422 and "at most 16 components" in r.json()["error"], r.text
    assert client.calls["wa_set_params"] == 0


def test_a_pin_on_an_engine_without_vllm_wa_is_a_conflict_not_a_server_error(engine):
    """vLLM turns prefix caching off by itself for some models; such an engine
    runs without vllm-wa, says so on GET, and refuses a pin with 409."""
    app, client, _ = make_app([engine], SETTINGS)
    client.engines = [SimpleNamespace(core=SimpleNamespace(scheduler=SimpleNamespace()))]
    with TestClient(app, raise_server_exceptions=False) as http:
        assert http.get("/wa/params", headers=AUTH).json()["engines"] == [{"enabled": False}]
        r = http.put("/wa/params", headers=AUTH, json={"mode": "auto"})
    assert r.status_code == 409 and "not enabled" in r.json()["error"], r.text


def test_pins_cross_vllms_msgpack_channel_as_parsed(engine):
    """Integers of any size are valid JSON numbers: the engines get the parsed
    pin (floats), never the client's raw body, so a pin never fails to encode."""
    app, client, _ = make_app([engine], SETTINGS)
    big = 2**64
    bodies = [
        {"params": {"a": {"agent_1": big}, "p": {"agent_1": 1}, "L": big}},
        {"params": {"a": {"agent_1": 0.2}, "p": {"agent_1": 0.9}, "mixture": {"agent_1": [[1, big]]}}},
    ]
    with TestClient(app) as http:
        for body in bodies:
            r = http.put("/wa/params", json=body, headers=AUTH)
            assert r.status_code == 200, r.text
            assert engine.controller.pinned.horizon == float(body["params"].get("L", 5.0))
        r = http.put("/wa/params", json={"params": {"a": {}, "p": {}, "version": big}}, headers=AUTH)
        assert r.status_code == 422 and "version" in r.json()["error"]
        odd_default = {"a": {}, "p": {}, "default": {"a": 1.0, "p": 0.5, "\ud800": 0}}
        r = http.put("/wa/params", content=json.dumps({"params": odd_default}),
                     headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 422 and "exactly 'p' and 'a'" in r.json()["error"]
        assert http.get("/wa/params", headers=AUTH).status_code == 200
    assert client.calls["wa_set_params"] == len(bodies)


def test_a_repin_that_changes_only_the_stamp_or_a_little_is_applied(engine):
    app, _, _ = make_app([engine], SETTINGS)
    base = {"a": {"agent_1": 0.2}, "p": {"agent_1": 0.9}}
    with TestClient(app) as http:
        assert http.put("/wa/params", json={"params": base}, headers=AUTH).status_code == 200
        assert engine.handle.queue.params.stamp == "free"
        assert http.put("/wa/params", json={"params": {**base, "stamp": "lookup"}}, headers=AUTH).status_code == 200
        assert engine.handle.queue.params.stamp == "lookup"
        nudged = {"a": {"agent_1": 0.2 * 1.001}, "p": {"agent_1": 0.9}, "stamp": "lookup"}  # within swap_tolerance
        assert http.put("/wa/params", json={"params": nudged}, headers=AUTH).status_code == 200
        assert engine.handle.queue.params.model_for("agent_1").a == pytest.approx(0.2 * 1.001, rel=1e-12)


def test_unreachable_engines_give_503_not_500(engine):
    app, client, _ = make_app([engine], SETTINGS)

    async def down(method, *args):
        raise ConnectionError("engine core gone")

    client.call_utility_all_async = down
    with TestClient(app, raise_server_exceptions=False) as http:
        r = http.put("/wa/params", json={"params": {"a": {"agent_1": 0.2}, "p": {"agent_1": 0.9}}}, headers=AUTH)
    assert r.status_code == 503 and "did not answer" in r.json()["error"]


def test_get_answers_non_finite_numbers_as_null(engine):
    app, _, snapshots = make_app([engine], SETTINGS)
    with TestClient(app) as http:
        http.get("/wa/params", headers=AUTH)
        first = snapshots.engines[0]
        # What the next fetch brings (a fetch replaces the list).
        snapshots.engines = [{**first, "state": {**first["state"], "odd": [float("inf"), {"x": float("nan")}, 1.5]}}]
        r = http.get("/wa/params", headers=AUTH)
    assert r.status_code == 200 and r.json()["engines"][0]["odd"] == [None, {"x": None}, 1.5]


def test_get_renders_the_engines_state_once_per_fetch_and_its_own_counters_each_time(engine, monkeypatch):
    """A public GET must not cost a walk of every class per request."""
    rendered = []
    render = params_api.render_json
    monkeypatch.setattr(params_api, "render_json", lambda obj: rendered.append(obj) or render(obj))
    counters = {"n": 0}

    def api_state():
        counters["n"] += 1
        return {"answered": counters["n"]}

    app, client, snapshots = make_app([engine], SETTINGS, api_state=api_state)
    with TestClient(app) as http:
        bodies = [http.get("/wa/params", headers=AUTH).json() for _ in range(5)]
        engine.controller.refit()
        fresh = http.get("/wa/params", headers=AUTH)  # unchanged: no new fetch yet
        snapshots.fetched_at = float("-inf")  # the copy is stale: the next GET fetches
        after = http.get("/wa/params", headers=AUTH).json()
    assert client.calls["wa_get_snapshot"] == 2
    assert [b["api_server"] for b in bodies] == [{"answered": i} for i in range(1, 6)]
    assert all(b["engines"] == bodies[0]["engines"] for b in bodies) and fresh.json()["engines"] == bodies[0]["engines"]
    assert after["engines"][0]["refits"] == bodies[0]["engines"][0]["refits"] + 1
    engine_renders = [obj for obj in rendered if isinstance(obj, list)]
    assert len(engine_renders) == 2  # once per fetch, not per GET
    assert fresh.headers["content-type"] == "application/json"


# ---- defect 8: PUT body handling -----------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, status, reason",
    [
        ("[" * 100_000 + "]" * 100_000, 400, "nested"),
        (json.dumps({"params": {"a": {}, "p": {}, "mixture": {"x": [[[[[[[[[1]]]]]]]]]}}}), 400, "nested"),
        ("{not json", 400, "JSON"),
        (b"\xff\xfe{", 400, "JSON"),
        (json.dumps({"params": {"a": {"x": 0.1}, "p": {"x": 0.5}, "bogus": 1}}), 422, "unknown key"),
        (json.dumps({"params": {"a": {"bad name": 0.1}, "p": {"bad name": 0.5}}}), 422, "class name"),
        (json.dumps({"params": {"a": {"x" * 200: 0.1}, "p": {"x" * 200: 0.5}}}), 422, "class name"),
        (json.dumps({"params": {"a": {"x": 0.1}, "p": {"x": 0.5}, "mixture": {"y": [[0.5, 1]]}}}), 422, "mixture"),
        (json.dumps({"params": {"a": {"x": 0.1}, "p": {"x": 0.5}}, "features": [["tag"]]}), 422, "features"),
        (json.dumps({"params": {"a": {"x": 10 ** 400}, "p": {"x": 0.5}}}), 422, "finite"),
    ],
)
def test_bad_put_bodies_get_a_4xx_with_the_reason(engine, raw, status, reason):
    app, client, _ = make_app([engine], SETTINGS)
    with TestClient(app, raise_server_exceptions=True) as http:
        r = http.put("/wa/params", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert reason in r.json()["error"]
    assert client.calls["wa_set_params"] == 0 and engine.controller.pinned is None


@pytest.mark.parametrize("token", ["tëst-secret", "тест", "test-secret\u00a0", "Bearer\u2028x"])
def test_non_ascii_bearer_tokens_get_401(engine, token):
    app, _, _ = make_app([engine], SETTINGS)
    with TestClient(app) as http:
        headers = {"Authorization": f"Bearer {token}".encode(), "Content-Type": "application/json"}
        r = http.put("/wa/params", content=b'{"mode": "auto"}', headers=headers)
        assert r.status_code == 401
        assert http.get("/wa/params", headers={"Authorization": f"Bearer {token}".encode()}).status_code == 401


def test_keys_are_checked_by_vllms_own_middleware(engine, monkeypatch):
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    seen = []
    orig = AuthenticationMiddleware.verify_token
    monkeypatch.setattr(AuthenticationMiddleware, "verify_token", lambda self, h: seen.append(1) or orig(self, h))
    app, _, _ = make_app([engine], SETTINGS)
    with TestClient(app) as http:
        assert http.get("/wa/params", headers=AUTH).status_code == 200
    assert seen


# ---- defect 10: a custom collector; counters are counters; no stale series -----------------------


def scrape(snapshots) -> dict:
    reg = CollectorRegistry()
    reg.register(WACollector(lambda: snapshots.engines))
    return {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}


def samples(fam, **labels):
    return [s for s in fam.samples if all(s.labels.get(k) == v for k, v in labels.items())]


def test_engine_totals_are_counters_and_labels_are_bounded(engine):
    app, _, snapshots = make_app([engine], SETTINGS)
    with TestClient(app) as http:
        http.get("/wa/params", headers=AUTH)
    fams = scrape(snapshots)
    for name in ("vllm_wa_param_swaps", "vllm_wa_refits", "vllm_wa_controller_errors", "vllm_wa_checkpoint_errors",
                 "vllm_wa_checkpoint_trims",
                 "vllm_wa_events_dropped", "vllm_wa_invalid_tags", "vllm_wa_evicted_blocks", "vllm_wa_freed_blocks",
                 "vllm_wa_prefix_cache_hit_tokens", "vllm_wa_prefix_cache_queried_tokens",
                 "vllm_wa_finest_classes_retired", "vllm_wa_finest_folded_observations"):
        assert fams[name].type == "counter", name
        assert all(s.name == name + "_total" for s in fams[name].samples if not s.name.endswith("_created"))
    assert fams["vllm_wa_params_version"].type == "gauge"
    assert fams["vllm_wa_finest_classes"].type == "gauge"
    tags = {s.labels["tag"] for s in fams["vllm_wa_prefix_cache_queried_tokens"].samples}
    classes = {s.labels["class"] for s in fams["vllm_wa_freed_blocks"].samples}
    assert tags == {"agent_1", "chat_1"}
    assert classes == {"agent_1.o:stop", "chat_1.o:stop"}  # no tag rows, no unused reserved rows
    # The tuner: nothing before the first refit publishes its state, then one
    # series per configured candidate and per switch reason, whatever the traffic.
    assert "vllm_wa_tuner_active" not in fams or not fams["vllm_wa_tuner_active"].samples
    engine.clock.advance(2.0)
    engine.controller.refit()
    app, _, snapshots = make_app([engine], SETTINGS)  # a fresh copy (the first is cached for 60 s)
    with TestClient(app) as http:
        http.get("/wa/params", headers=AUTH)
    fams = scrape(snapshots)
    candidates = set(engine.controller.tuner.names)
    assert fams["vllm_wa_tuner_candidate_seconds"].type == "counter"
    assert {s.labels["candidate"] for s in fams["vllm_wa_tuner_candidate_seconds"].samples} == candidates
    active = {s.labels["candidate"]: s.value for s in fams["vllm_wa_tuner_active"].samples}
    assert set(active) == candidates and sum(active.values()) == 1
    assert active[engine.controller.active] == 1
    reasons = {s.labels["reason"] for s in samples(fams["vllm_wa_tuner_switches"]) if s.name.endswith("_total")}
    assert reasons == {"promote", "demote", "real-check", "replace"}
    for name in ("vllm_wa_tuner_shadow_overflow_requests", "vllm_wa_tuner_shadow_lost_finishes",
                 "vllm_wa_tuner_shadow_expired_requests"):
        assert fams[name].type == "counter", name
        assert {s.labels["candidate"] for s in samples(fams[name]) if s.name.endswith("_total")} == candidates


def test_a_miniature_cache_s_lost_finishes_reach_the_metrics(engine, monkeypatch):
    """Requests a miniature cache released without their finish (more held
    than it may hold, or none for max_watch_s) and sampled requests that did
    not fit are counted per candidate, as counters, once each."""
    from vllm_wa.controller import shadow

    monkeypatch.setattr(shadow, "MAX_LIVE_REQUESTS", 2)
    c = engine.controller
    name = next(n for n in c.tuner.names if n != "lru")
    sc = c.candidates[name].shadow
    for i in range(5):
        sc.lookup(f"lost{i}", "t", [("lost", i, j) for j in range(2)], 1.0)
    sc.expire(1.0 + 2 * c.config.max_watch_s, c.config.max_watch_s)
    engine.clock.advance(2.0)
    c.refit()
    row = next(x for x in c.snapshot["candidates"] if x["name"] == name)
    assert (row["shadow_lost_finishes"], row["shadow_expired"], row["shadow_overflow"]) == (3, 2, 0)
    app, _, snapshots = make_app([engine], SETTINGS)
    with TestClient(app) as http:
        http.get("/wa/params", headers=AUTH)
    fams = scrape(snapshots)
    lost = {s.labels["candidate"]: s.value for s in samples(fams["vllm_wa_tuner_shadow_lost_finishes"])
            if s.name.endswith("_total")}
    expired = {s.labels["candidate"]: s.value for s in samples(fams["vllm_wa_tuner_shadow_expired_requests"])
               if s.name.endswith("_total")}
    assert lost[name] == 3 and expired[name] == 2
    assert all(v == 0 for n, v in lost.items() if n != name)


def test_reuse_series_disappear_when_a_class_falls_back_to_the_default(engine):
    app, _, snapshots = make_app([engine], SETTINGS)
    pin = {"params": {"a": {"agent_1": 0.2, "chat_1": 0.01}, "p": {"agent_1": 0.9, "chat_1": 0.5}}, "features": ["tag"]}
    with TestClient(app) as http:
        assert http.put("/wa/params", json=pin, headers=AUTH).status_code == 200
        traffic(engine)  # blocks freed under the tag key
        snapshots.engines = None
        http.get("/wa/params", headers=AUTH)
        assert samples(scrape(snapshots)["vllm_wa_reuse_rate"], **{"class": "agent_1"})
        only_chat = {"params": {"a": {"chat_1": 0.01}, "p": {"chat_1": 0.5}}, "features": ["tag"]}
        assert http.put("/wa/params", json=only_chat, headers=AUTH).status_code == 200
    fams = scrape(snapshots)
    assert not samples(fams["vllm_wa_reuse_rate"], **{"class": "agent_1"})
    assert not samples(fams["vllm_wa_reuse_probability"], **{"class": "agent_1"})
    assert samples(fams["vllm_wa_reuse_rate"], **{"class": "chat_1"})
    assert samples(fams["vllm_wa_freed_blocks"], **{"class": "agent_1"})  # the class itself is still in use


def test_collector_appears_in_vllms_multiprocess_registry(engine, tmp_path, monkeypatch):
    import vllm.entrypoints.serve.instrumentator.metrics as vllm_metrics
    from prometheus_client import REGISTRY, multiprocess

    from vllm_wa.serving import metrics

    app, _, snapshots = make_app([engine], SETTINGS)
    with TestClient(app) as http:
        http.get("/wa/params", headers=AUTH)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(multiprocess.MultiProcessCollector, "__init__", multiprocess.MultiProcessCollector.__init__)
    collector = WACollector(lambda: snapshots.engines)
    try:
        metrics.install(collector)
        metrics.install(collector)  # idempotent
        # vLLM's registry for /metrics, and the one its instrumentator builds per scrape.
        per_scrape = CollectorRegistry()
        multiprocess.MultiProcessCollector(per_scrape)
        for registry in (vllm_metrics.get_prometheus_registry(), per_scrape):
            assert registry is not REGISTRY
            text = generate_latest(registry).decode()
            assert text.count('vllm_wa_freed_blocks_total{class="agent_1.o:stop",engine="0"}') == 1
    finally:
        REGISTRY.unregister(collector)


def test_counters_never_go_back_across_api_servers(engine, tmp_path):
    """Two API servers poll the engine on their own schedules; whichever answers
    a scrape, a counter never reads lower than the scrape before (a drop is a
    reset to Prometheus)."""
    from vllm_wa.serving.shared_metrics import SharedCopies

    app_a, _, snap_a = make_app([engine], SETTINGS)
    app_b, _, snap_b = make_app([engine], SETTINGS)
    servers = []
    for pid, snap in ((1, snap_a), (2, snap_b)):
        shared = SharedCopies(str(tmp_path), pid=pid)
        snap.on_fetch = shared.publish
        servers.append((snap, WACollector(lambda shared=shared, snap=snap: shared.freshest(snap.engines))))

    def refits(collector) -> float:
        reg = CollectorRegistry()
        reg.register(collector)
        fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
        return samples(fams["vllm_wa_refits"], engine="0")[0].value

    with TestClient(app_a) as http_a, TestClient(app_b) as http_b:
        http_b.get("/wa/params", headers=AUTH)  # B's copy: before the refits below
        engine.clock.advance(10.0)
        for _ in range(3):
            engine.controller.refit()
        http_a.get("/wa/params", headers=AUTH)  # A's copy: after them
        assert snap_b.engines[0]["metrics"]["refits"] < snap_a.engines[0]["metrics"]["refits"]
        seen = [refits(servers[0][1]), refits(servers[1][1]), refits(servers[0][1])]
    assert seen[0] == seen[1] == seen[2] == snap_a.engines[0]["metrics"]["refits"]
    # Without the shared copies, B alone would have answered with its older count.
    assert refits(WACollector(lambda: snap_b.engines)) < seen[0]


def test_the_calibration_gauges_are_the_running_candidates_over_the_last_window():
    """The real cache's and the running candidate's sampled hit ratios, from the
    snapshot the last refit published; nothing before a sampled lookup."""
    from vllm_wa.serving.engine_side import _calibration

    window = {
        "wa": {"lookups": 10, "real_hit_rate": 0.2, "predicted_hit_rate": 0.3},
        "lru": {"lookups": 5, "real_hit_rate": 0.1, "predicted_hit_rate": 0.1},
    }
    snapshot = {"active_candidate": "wa", "calibration": {"window": window}}
    assert _calibration(snapshot) == {"sampled_real_hit_ratio": 0.2, "sampled_predicted_hit_ratio": 0.3}
    assert _calibration(None) == {}
    assert _calibration({"active_candidate": "lru", "calibration": {"window": {}}}) == {}


def test_the_tuner_metrics_count_each_switch_once_under_its_reason():
    """A real-check demotion is counted as itself, not also as a plain one; the
    candidates' seconds and the tuner's choice come from the same snapshot."""
    from vllm_wa.serving.engine_side import _tuner

    snapshot = {
        "active_candidate": "wa", "promotions": 3, "demotions": 2, "real_check_demotions": 1, "replacements": 1,
        "seconds_on_candidate": {"lru": 100.0, "wa": 50.0},
    }
    metrics = {"engine": 0, **_tuner(snapshot)}
    reg = CollectorRegistry()
    reg.register(WACollector(lambda: [{"enabled": True, "metrics": metrics}]))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    switches = {s.labels["reason"]: s.value for s in fams["vllm_wa_tuner_switches"].samples if s.name.endswith("_total")}
    assert switches == {"promote": 3, "demote": 1, "real-check": 1, "replace": 1}
    assert sum(switches.values()) == snapshot["promotions"] + snapshot["demotions"] + snapshot["replacements"]
    seconds = {s.labels["candidate"]: s.value for s in fams["vllm_wa_tuner_candidate_seconds"].samples
               if s.name.endswith("_total")}
    assert seconds == {"lru": 100.0, "wa": 50.0}
    assert {s.labels["candidate"]: s.value for s in fams["vllm_wa_tuner_active"].samples} == {"lru": 0, "wa": 1}
    assert _tuner(None) == {}

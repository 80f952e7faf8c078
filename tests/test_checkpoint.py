"""Controller checkpoints: any file content gives the prior, never a failed start; write failures are counted."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_wa.controller.checkpoint import Checkpoint, CheckpointError, parse_checkpoint, read_checkpoint
from vllm_wa.controller.config import CandidateSpec, ControllerConfig
from vllm_wa.controller.controller import WAController
from vllm_wa.controller.features import FINEST
from vllm_wa.controller.survival import NUM_BINS, SurvivalData
from vllm_wa.engine_patch.block_tagger import RequestTags
from vllm_wa.engine_patch.events import EventKind, EventSink, FinishedEvent, FreedEvent, LookupEvent
from vllm_wa.params import WAParams


def config(**kw) -> ControllerConfig:
    base = dict(refit_interval_s=1.0, fit_interval_s=1.0, min_samples=5, tuner_min_requests=10, tuner_min_batches=2,
                tuner_batch_s=1.0, tuner_window_s=60.0, tuner_demote_window_s=10.0,
                initial="tag+outcome/hyper/posterior/L10", class_confidence=0.0)  # a few reuses: own fits
    base.update(kw)
    return ControllerConfig(**base)


def feed(sink: EventSink, t: float) -> float:
    """Two tags whose blocks come back: enough for fitted classes."""
    for r in range(8):
        for c in range(4):
            tag = "tool" if c % 2 else "human"
            rid = f"{tag}-{c}-{r}"
            hashes = tuple((j, (c, j)) for j in range(4 + r))
            sink.emit(LookupEvent(EventKind.LOOKUP, t, rid, tag, tuple(h for _, h in hashes), ()))
            t += 0.1
            req = RequestTags(rid, tag, "stop")
            for j, h in hashes:
                sink.emit(FreedEvent(EventKind.FREED, t, h, req, j, r))
            sink.emit(FinishedEvent(EventKind.FINISHED, t, rid, req))
        t += 2.0
    return t


def controller(clock=lambda: 0.0, **kw) -> WAController:
    return WAController(config(**kw), 200, lambda params, key: None, EventSink(capacity=100000), clock=clock)


@pytest.fixture
def saved(tmp_path):
    """A real checkpoint of a controller that learned something."""
    clock = [0.0]
    c = controller(lambda: clock[0])
    clock[0] = feed(c.sink, 0.0)
    c.refit()
    clock[0] = feed(c.sink, clock[0])  # more data, new fits: a second version
    c.refit()
    path = tmp_path / "ckpt.json"
    assert c.save_checkpoint(str(path))
    return c, path, json.loads(path.read_text())


def test_round_trip_restores_estimators_and_version(saved, tmp_path):
    c, path, written = saved
    assert c.version >= 2
    # The file shows what ran, at its version.
    assert WAParams.from_pr_json(written["params"]).models == c._target()[0].models
    fresh = controller()
    assert fresh.load_checkpoint(str(path))
    assert len(fresh._bank) == len(c._bank)
    # The parameter version continues where it stopped (defect 7's last part).
    assert fresh.version == c.version
    # The saved params are not run (the tuner starts on LRU), so the
    # controller reports what the live queue runs until its first refit:
    # the prior, not the file's params.
    assert fresh.params.source == "prior" and not fresh.params.models
    fresh.refit()
    assert fresh.params.version == c.version + 1


def test_a_checkpoint_written_past_the_finest_class_cap_reads_back(monkeypatch, tmp_path):
    """Past the cap, finest classes fold features (``*``); a key's class
    over such rows has no class name the engine makes.  It got a model, the
    model's name went into the checkpoint, and the next start refused the
    whole file (everything learned lost)."""
    import vllm_wa.controller.controller as mod

    monkeypatch.setattr(mod, "MAX_FINE_CLASSES", 4)
    monkeypatch.setattr(mod, "FOLDED_ROOM", 2)
    clock = [0.0]
    c = controller(lambda: clock[0])
    for _ in range(3):
        clock[0] = feed(c.sink, clock[0])
        c.refit()
    assert c.errors == 0 and any("*" in "".join(map(str, comps)) for comps in c._fine)
    assert c.params.models and not [n for n in c.params.models if "*" in n]
    path = tmp_path / "folded.json"
    assert c.save_checkpoint(str(path))
    fresh = controller(lambda: clock[0])
    assert fresh.load_checkpoint(str(path))
    assert len(fresh._bank) == len(c._bank)


def _many_tags(c: WAController, n: int, t: float = 0.0) -> None:
    """``n`` tags, each with four blocks reused a second later."""
    evs = []
    for i in range(n):
        req = RequestTags(f"r{i}", f"t{i}", "stop")
        hashes = tuple(("b", i, j) for j in range(4))
        evs += [FreedEvent(EventKind.FREED, t, h, req, j, 0) for j, h in enumerate(hashes)]
        evs.append(LookupEvent(EventKind.LOOKUP, t + 1.0 + i % 7, f"n{i}", f"t{i}", hashes, ()))
        t += 0.001
    c.process(evs)


def _two_keys(**kw) -> WAController:
    cands = (
        CandidateSpec(("tag",), "exponential", "posterior", 10.0),
        CandidateSpec(("tag", "outcome"), "exponential", "posterior", 10.0),
    )
    cfg = config(candidates=cands, initial="tag+outcome/exp/posterior/L10", min_samples=3, **kw)
    return WAController(cfg, 200, lambda params, key: None, EventSink(capacity=1 << 16), clock=lambda: 20.0)


def test_a_checkpoint_of_many_keys_stays_within_its_class_cap(monkeypatch, tmp_path):
    """The live queue holds every key's models (the running one's and the
    others', for blocks freed under them): 30 tags under two keys are 60
    models, over a cap of 40 that each key's 30 classes are within.  The
    checkpoint keeps the running candidate's own, so a restart reads it."""
    import vllm_wa.controller.controller as mod

    monkeypatch.setattr(mod, "CHECKPOINT_MAX_CLASSES", 40)
    c = _two_keys()
    _many_tags(c, 30)
    c.refit()
    assert c.errors == 0 and len(c.params.models) == 60
    path = tmp_path / "keys.json"
    assert c.save_checkpoint(str(path))
    assert len(WAParams.from_pr_json(json.loads(path.read_text())["params"]).models) == 30
    fresh = _two_keys()
    assert fresh.load_checkpoint(str(path))
    assert len(fresh._bank) == len(c._bank)


def test_drift_cuts_are_kept_up_to_the_cap_per_key(monkeypatch, tmp_path):
    """Two keys whose 30 classes were all cut: 60 cuts, over a cap of 40
    that bounds each key's.  Capped over all keys, the last 20 were dropped
    and a restart brought back what their drifts forgot."""
    import vllm_wa.controller.controller as mod

    monkeypatch.setattr(mod, "CHECKPOINT_MAX_CLASSES", 40)
    c = _two_keys()
    for key in c._key_classes:
        c._drift_of(key).update = lambda name, gaps: True  # every class is cut at its lookup
    _many_tags(c, 30)
    path = tmp_path / "cuts.json"
    assert c.save_checkpoint(str(path))
    assert len(json.loads(path.read_text())["drift_cuts"]) == 60
    fresh = _two_keys()
    assert fresh.load_checkpoint(str(path))
    for key in c._key_classes:
        before, after = c._class_data(key, None), fresh._class_data(key, None)
        assert {n: d.n_events for n, d in before.items()} == {n: d.n_events for n, d in after.items()}, key.name
    # A file over the cap for one key is refused.
    data = json.loads(path.read_text())
    one_key = [e for e in data["drift_cuts"] if e["key"] == ["tag"]]
    data["drift_cuts"] = one_key + [dict(e, **{"class": e["class"] + "x"}) for e in one_key]
    with pytest.raises(CheckpointError, match="more than 40 entries"):
        parse_checkpoint(data, max_classes=40)


def test_a_fifo_at_the_checkpoint_path_does_not_block_the_start(tmp_path):
    """A FIFO passes a size check (0 bytes) and blocks open() until a writer
    comes: the engine's start hung.  Only a regular file is read."""
    import threading

    path = tmp_path / "ckpt.json"
    os.mkfifo(path)
    result: list[bool] = []
    reader = threading.Thread(target=lambda: result.append(controller().load_checkpoint(str(path))), daemon=True)
    reader.start()
    reader.join(10.0)
    hung = reader.is_alive()
    if hung:  # unblock it before failing
        with open(path, "w"):
            pass
        reader.join(5.0)
    assert not hung and result == [False]
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_checkpoint(str(tmp_path), max_classes=10)


def test_a_restart_keeps_what_the_real_cache_check_found_overstated(saved, tmp_path):
    """A candidate the real-cache check demoted faces its raised bar after a
    restart too (the evidence is about this traffic); names no longer
    configured are dropped."""
    c, _, _ = saved
    name = "tag+outcome/hyper/posterior/L10"
    assert name in c.tuner.names
    c.tuner.overstated[name] = 0.02
    path = tmp_path / "with_overstated.json"
    assert c.save_checkpoint(str(path))
    written = json.loads(path.read_text())
    assert written["overstated"] == {name: 0.02}
    fresh = controller()
    assert fresh.load_checkpoint(str(path))
    assert fresh.tuner.overstated == {name: 0.02}
    # With the check turned off, its findings raise no bar either, and are
    # written back as they were, for a later run with the check on.
    off = controller(tuner_real_check=False)
    assert off.load_checkpoint(str(path))
    assert off.tuner.overstated == {}
    assert off.save_checkpoint(str(path))
    assert json.loads(path.read_text())["overstated"] == {name: 0.02}
    # A checkpoint written before the field, or naming a candidate this
    # configuration lacks (or LRU), restores no overstatement.
    for extra in ({}, {"overstated": {"gone/exp/pr/L5": 0.3, "lru": 0.1}}):
        old = {k: v for k, v in written.items() if k != "overstated"} | extra
        path.write_text(json.dumps(old))
        fresh = controller()
        assert fresh.load_checkpoint(str(path))
        assert fresh.tuner.overstated == {}
    # Nothing found: the key is left out, so a build from before it reads the file.
    assert "overstated" not in json.loads(saved[1].read_text())


FOLD = ["*"] * 4  # the timing features, folded


def _class_entry(components, data=None):
    return {"components": components, "data": data or {"events": [0.0] * NUM_BINS, "censored": [1.0] * NUM_BINS}}


def _crafted(saved_data) -> list:
    """Checkpoint contents an attacker or a broken disk may leave (issue 9, defect 1)."""
    good = saved_data
    deep = "[" * 200_000 + "]" * 200_000
    return [
        "{not json",
        deep,
        '{"version": 2, "classes": ' + deep + "}",
        json.dumps({**good, "classes": [_class_entry([["x"], "stop", 0, 0, *FOLD])]}),  # unhashable tag
        json.dumps({**good, "classes": [_class_entry([{"a": 1}, "stop", 0, 0, *FOLD])]}),
        json.dumps({**good, "classes": [_class_entry({"a": 1, "b": 2, "c": 3, "d": 4})]}),  # 4 keys
        json.dumps({**good, "classes": [_class_entry(["x" * 10_000, "stop", 0, 0, *FOLD])]}),  # oversized tag
        json.dumps({**good, "classes": [_class_entry(["bad tag", "stop", 0, 0, *FOLD])]}),
        json.dumps({**good, "classes": [_class_entry(["t", "exploded", 0, 0, *FOLD])]}),
        json.dumps({**good, "classes": [_class_entry(["t", "stop", 99, 0, *FOLD])]}),
        json.dumps({**good, "classes": [_class_entry(["t", "stop", 0, True, *FOLD])]}),
        json.dumps({**good, "classes": [_class_entry(["t", "stop", 0, 0, *FOLD])] * 2}),  # duplicate class
        json.dumps({**good, "classes": [_class_entry(["t", "stop", 0, 0, *FOLD], {"events": [1] * 3, "censored": []})]}),
        json.dumps({**good, "classes": [_class_entry(["t", "stop", 0, 0, *FOLD], {"events": [[1]] * NUM_BINS,
                                                                              "censored": [0] * NUM_BINS})]}),
        json.dumps({**good, "classes": [_class_entry(["t", "stop", 0, 0, *FOLD], {"events": [-1] * NUM_BINS,
                                                                              "censored": [0] * NUM_BINS})]}),
        # Counts near the float limit: their sums overflow to inf, which /wa/params cannot answer.
        json.dumps({**good, "classes": [_class_entry(["t", "stop", 0, 0, *FOLD], {"events": [1e308] * NUM_BINS,
                                                                              "censored": [0] * NUM_BINS})]}),
        # A version past 2**63 - 1 cannot cross vLLM's msgpack channel to the API server.
        json.dumps({**good, "params": {**good["params"], "version": 2**64}}),
        # One within that range but leaving no room for the next swap's version.
        json.dumps({**good, "params": {**good["params"], "version": 2**63 - 1}}),
        json.dumps({**good, "classes": [_class_entry([f"t{i}", "stop", 0, 0, *FOLD]) for i in range(6000)]}),
        json.dumps({**good, "classes": {"not": "a list"}}),
        json.dumps({**good, "active": ["unhashable"]}),
        json.dumps({**good, "params": {"a": {"x": 1}, "p": {"x": 7}}}),
        json.dumps({**good, "params": [1, 2]}),
        json.dumps({**good, "version": 99}),
        json.dumps({**good, "surprise": 1}),
        # The real-cache check's overstatements: a fraction per candidate name.
        json.dumps({**good, "overstated": [0.1]}),
        json.dumps({**good, "overstated": {"tag/hyper/posterior/L10": 1.5}}),
        json.dumps({**good, "overstated": {"tag/hyper/posterior/L10": -0.1}}),
        json.dumps({**good, "overstated": {"tag/hyper/posterior/L10": "0.1"}}),
        json.dumps({**good, "overstated": {"": 0.1}}),
        json.dumps({**good, "overstated": {"x" * 1000: 0.1}}),
        json.dumps({**good, "overstated": {f"c{i}": 0.1 for i in range(1000)}}),
        '{"version": 2, "classes": [], "params": {"a": {}, "p": {}}, "overstated": {"c": Infinity}}',
        # What drifts forgot: a key of distinct features, a class name, counts.
        json.dumps({**good, "drift_cuts": {"not": "a list"}}),
        json.dumps({**good, "drift_cuts": [{"key": ["tag", "tag"], "class": "c", "data": _class_entry([])["data"]}]}),
        json.dumps({**good, "drift_cuts": [{"key": ["colour"], "class": "c", "data": _class_entry([])["data"]}]}),
        json.dumps({**good, "drift_cuts": [{"key": ["tag"], "class": "", "data": _class_entry([])["data"]}]}),
        json.dumps({**good, "drift_cuts": [{"key": ["tag"], "class": "x" * 1000, "data": _class_entry([])["data"]}]}),
        json.dumps({**good, "drift_cuts": [{"key": ["tag"], "class": "c", "data": {"events": [-1] * NUM_BINS,
                                                                                 "censored": [0] * NUM_BINS}}]}),
        json.dumps({**good, "drift_cuts": [{"key": ["tag"], "class": "c", "data": _class_entry([])["data"]}] * 2}),
        json.dumps({**good, "drift_cuts": [{"key": ["tag"], "class": f"c{i}", "data": _class_entry([])["data"]}
                                           for i in range(6000)]}),
        json.dumps([1, 2, 3]),
        json.dumps(None),
        '{"version": 2, "classes": [], "params": {"a": {}, "p": {}, "L": NaN}}',
    ]


def test_a_restart_keeps_what_drifts_forgot(tmp_path):
    """A drift cuts a key's class in that key's view only; the finest classes
    are never cut, so the checkpoint keeps the cut, and a restarted
    controller pools each key's classes as before the restart."""
    clock = [0.0]
    c = controller(lambda: clock[0])
    clock[0] = feed(c.sink, 0.0)
    c.refit()
    key = next(k for k in c._drift if k.features == ("tag", "outcome"))
    c._drift[key].update = lambda name, gaps: True  # its next lookups' classes are cut
    clock[0] = feed(c.sink, clock[0])
    c.refit()
    assert c._drift[key].cut_classes()
    path = tmp_path / "ckpt.json"
    assert c.save_checkpoint(str(path))
    assert json.loads(path.read_text())["drift_cuts"]
    fresh = controller(lambda: clock[0])
    assert fresh.load_checkpoint(str(path))
    for k in c._key_classes:
        before, after = c._class_data(k, None), fresh._class_data(k, None)
        assert before.keys() == after.keys()
        for name in before:
            assert after[name].events.tolist() == pytest.approx(before[name].events.tolist())
            assert after[name].censored.tolist() == pytest.approx(before[name].censored.tolist())
            if name in c._drift[k].cut_classes():  # the lookups a drift forgot too (others: see below)
                assert after[name].groups == pytest.approx(before[name].groups)
    cut = c._class_data(key, None)
    assert sum(d.n_events for d in cut.values()) < sum(row.n_events for row in c._bank.rows)
    # (A class no drift cut restarts from its finest classes' lookups, at most
    # one per finest class a lookup spanned: the checkpoint keeps no more.)


def test_crafted_checkpoints_give_the_prior_and_a_warning(saved, tmp_path, caplog):
    _, path, data = saved
    for i, content in enumerate(_crafted(data)):
        path.write_text(content)
        c = controller()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert c.load_checkpoint(str(path)) is False, i
        assert "ignoring checkpoint" in caplog.text, i
        assert c.params.source == "prior" and not len(c._bank) and c.version == 0, i


def test_oversized_checkpoint_file_is_not_read(saved, monkeypatch):
    from vllm_wa.controller import checkpoint

    _, path, _ = saved
    monkeypatch.setattr(checkpoint, "MAX_CHECKPOINT_BYTES", 100)
    with pytest.raises(CheckpointError, match="bytes"):
        read_checkpoint(str(path), max_classes=1024)


def test_missing_checkpoint_is_a_cold_start_without_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert controller().load_checkpoint(str(tmp_path / "none.json")) is False
    assert "checkpoint" not in caplog.text


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30,
)


@given(
    classes=st.lists(st.fixed_dictionaries({"components": _json, "data": _json}), max_size=4) | _json,
    active=_json,
    extra=st.dictionaries(st.sampled_from(["version", "params", "classes", "active", "overstated"]), _json, max_size=2),
)
def test_any_json_content_is_parsed_or_refused_with_checkpoint_error(classes, active, extra):
    data = {"version": 2, "active": active, "params": {"a": {}, "p": {}}, "classes": classes, **extra}
    try:
        ckpt = parse_checkpoint(data, max_classes=1024)
    except CheckpointError:
        return
    for comps, _ in ckpt.classes:
        hash(comps)
        assert len(comps) == 8


@given(pos=st.integers(0, 7), value=_json, changed=st.booleans())
def test_a_class_with_one_component_changed_is_parsed_or_refused(pos, value, changed):
    """Near-valid classes: every unchanged one parses as saved; a changed one parses
    into a hashable 8-component class or is refused with CheckpointError."""
    comps = ["t", "stop", 0, 0, *FOLD]
    if changed:
        comps[pos] = value
    data = {"version": 2, "active": None, "params": {"a": {}, "p": {}}, "classes": [_class_entry(comps)]}
    try:
        ckpt = parse_checkpoint(data, max_classes=1024)
    except CheckpointError:
        assert changed
        return
    [(parsed, _)] = ckpt.classes
    hash(parsed)
    assert len(parsed) == 8
    if not changed:
        assert list(parsed) == comps


def test_engine_starts_with_a_crafted_checkpoint(saved, tmp_path, monkeypatch, caplog):
    """The engine core's set-up (not just the controller) survives any checkpoint."""
    from conftest import make_manager

    from vllm_wa.serving import engine_side
    from vllm_wa.serving.settings import ServingSettings

    _, path, data = saved
    path.write_text(json.dumps({**data, "classes": [_class_entry([["x"], "stop", 0, 0, *FOLD])]}))
    cfg = tmp_path / "wa.toml"
    cfg.write_text(f'[controller]\ncheckpoint_path = "{path}"\n')
    monkeypatch.setattr(ServingSettings, "from_env", classmethod(lambda cls: ServingSettings(online=True, config_path=str(cfg))))
    sched = SimpleNamespace(kv_cache_manager=make_manager(20))
    with caplog.at_level(logging.WARNING, logger="vllm_wa"):
        engine_side._attach(sched)
    ewa = sched._vllm_wa_engine
    try:
        # Read, refused with a warning that names it, and the prior used.
        assert ewa.controller.params.source == "prior"
        assert any("ignoring checkpoint" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
    finally:
        ewa.stop()


# ---- write failures (defect 3) ----------------------------------------------------------------


def test_write_failures_are_counted_shown_and_warned_once_per_cause(tmp_path, caplog):
    missing = tmp_path / "gone" / "wa.json"
    clock = [0.0]
    c = controller(lambda: clock[0], checkpoint_path=str(missing), checkpoint_interval_s=1.0)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            clock[0] += 2.0
            c.refit()
    assert c.errors == 0
    assert c.checkpoint_failures.count == 3
    st = c.state()
    assert st["checkpoint_errors"] == 3 and "No such file" in st["last_checkpoint_error"]
    assert caplog.text.count("cannot write checkpoint") == 1
    # A different cause warns again, once.
    (tmp_path / "gone").write_text("a file where the directory should be")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            clock[0] += 2.0
            c.refit()
    assert c.checkpoint_failures.count == 5
    assert caplog.text.count("cannot write checkpoint") == 1
    # Restored: written again, and the counter keeps its total.
    os.unlink(tmp_path / "gone")
    os.mkdir(tmp_path / "gone")
    clock[0] += 2.0
    c.refit()
    assert missing.exists() and c.checkpoint_failures.count == 5
    assert json.loads(missing.read_text())["version"] == 2


def test_checkpoint_keeps_lookup_counts_and_reads_older_checkpoints():
    d = SurvivalData()
    d.add_event(3.0)
    d.groups = 1.0
    ckpt = Checkpoint(None, WAParams.lru(), ((FINEST.components(RequestTags("r", "chat", "stop"), 0, 0), d),))
    raw = json.loads(json.dumps(ckpt.to_json()))
    assert parse_checkpoint(raw, max_classes=8).classes[0][1].groups == 1.0
    del raw["classes"][0]["data"]["groups"]  # written before lookups were counted
    assert parse_checkpoint(raw, max_classes=8).classes[0][1].groups == 0.0
    for bad in (-1.0, float("nan"), "2", True):
        raw["classes"][0]["data"]["groups"] = bad
        with pytest.raises(CheckpointError):
            parse_checkpoint(raw, max_classes=8)


def test_a_state_past_the_readers_cap_is_written_trimmed_and_read_back(saved, tmp_path, monkeypatch, caplog):
    """The writer wrote whatever the state held: a full finest-class table with
    a drift cut in every class came to 110 MB, over the reader's 32 MiB, so
    the next start refused the file and lost everything learned.  Now the
    smallest cuts, then the smallest classes, are left out to fit."""
    from vllm_wa.controller import checkpoint

    c, path, _ = saved
    for key, kc in c._key_classes.items():  # a drift cut in every class of every key
        kc.extend(c._fine)
        for j, name in enumerate(kc.names):
            c._drift_of(key).cut(name, c._bank.sum_rows(kc.rows(j)), 0.0)
    whole = tmp_path / "whole.json"
    assert c.save_checkpoint(str(whole))
    all_cuts = read_checkpoint(str(whole), max_classes=1024).drift_cuts
    cuts = len(all_cuts)
    assert cuts > 4
    limit = whole.stat().st_size - 2 * len(json.dumps(json.loads(whole.read_text())["drift_cuts"][0]))
    monkeypatch.setattr(checkpoint, "MAX_CHECKPOINT_BYTES", limit)
    with caplog.at_level(logging.WARNING):
        assert c.save_checkpoint(str(path)) and c.checkpoint_failures.count == 0
    assert "left out" in caplog.text and c.state()["checkpoint_trims"] == 1
    assert path.stat().st_size <= limit
    kept = read_checkpoint(str(path), max_classes=1024)
    assert 0 < len(kept.drift_cuts) < cuts and len(kept.classes) == len(c._bank)
    # The smallest cuts went: every one kept holds at least what any left out held.
    kept_n = sorted(d.n for _, _, d in kept.drift_cuts)
    gone_n = sorted(d.n for _, _, d in all_cuts)[: len(all_cuts) - len(kept.drift_cuts)]
    assert max(gone_n) <= min(kept_n)
    assert controller().load_checkpoint(str(path))
    # Tighter: every cut and the smallest classes go; the rest still reads back.
    no_cuts = len(json.dumps({k: v for k, v in json.loads(whole.read_text()).items() if k != "drift_cuts"}))
    monkeypatch.setattr(checkpoint, "MAX_CHECKPOINT_BYTES", no_cuts - 300)
    assert c.save_checkpoint(str(path)) and path.stat().st_size <= no_cuts - 300
    kept = read_checkpoint(str(path), max_classes=1024)
    assert not kept.drift_cuts and 0 < len(kept.classes) < len(c._bank)
    fresh = controller()
    assert fresh.load_checkpoint(str(path)) and len(fresh._bank) == len(kept.classes)
    assert c.state()["checkpoint_trims"] == 2 and caplog.text.count("left out") == 1  # warned once
    # Past what trimming can shed (the parameters alone): a counted failure, the old file kept.
    monkeypatch.setattr(checkpoint, "MAX_CHECKPOINT_BYTES", 100)
    assert not c.save_checkpoint(str(path)) and c.checkpoint_failures.count == 1
    assert path.stat().st_size > 100

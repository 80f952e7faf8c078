"""benchmarks/tuner_paths.py: recorded miniature-cache hits replayed through the tuner."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import asdict

import pytest

from vllm_wa.controller.tuner import LRU, PairedHits, TunerSettings
from vllm_wa.replay.no_signal import no_signal_trace

from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("tuner_paths")


def recording(lead_from: float, seed: int = 0) -> dict:
    """Two requests a second for an hour; candidate ``a`` hits 10 points more than LRU from ``lead_from``."""
    rng = random.Random(seed)
    rows = []
    t = 0.0
    while t < 3600.0:
        p_lru = 0.30
        p_a = 0.40 if t >= lead_from else 0.30
        u = [rng.random() for _ in range(10)]
        rows.append([t, 10, sum(x < p_lru for x in u), sum(x < p_a for x in u)])
        t += 0.5
    settings = TunerSettings(min_requests=50)
    return {
        "names": [LRU, "a"], "rows": rows, "eval_start": 1800.0,
        "decisions": [(2 * k * 5, 5.0 * k) for k in range(1, 720)],  # every 5 s
        "settings": asdict(settings), "token_hit_rate": 0.0,
    }


def test_a_lead_is_followed_and_the_score_is_the_running_candidates(bench):
    doc = recording(lead_from=600.0)
    path = bench.replay(doc, bench.settings_from(doc, {}))
    assert [sw.reason for sw in path.switches] == ["promote"]
    assert 600.0 < path.switches[0].time < 1800.0
    # On "a" for the whole evaluation window: its rate, 10 points over LRU's (up to noise).
    assert path.score - path.lru == pytest.approx(10.0, abs=1.0)
    # A margin no lead clears keeps LRU: the score is LRU's, exactly.
    never = bench.replay(doc, bench.settings_from(doc, {"margin": 0.5, "full_window_margin": 0.5}))
    assert never.switches == [] and never.score == never.lru


def test_settings_overrides_are_checked(bench):
    assert bench.parse_overrides(["replace_confidence=0.99"]) == {"replace_confidence": 0.99}
    # A switch reads true or false (float("false") would fail, bool("false") would be True).
    assert bench.parse_overrides(["real_check=false"]) == {"real_check": False}
    assert bench.parse_overrides(["real_check=True"]) == {"real_check": True}
    for bad in ("no_such_knob=1", "margin", "real_check=0", "margin=true"):
        with pytest.raises(SystemExit):
            bench.parse_overrides([bad])


def test_record_writes_what_replay_reads(bench, tmp_path, monkeypatch):
    """A real (tiny) wa-online replay: the recorded rows replayed with the
    recorded settings take the real run's switches at the same times."""
    trace = no_signal_trace(0, conversations=120)
    monkeypatch.setattr(bench, "load_trace_cached", lambda *a, **k: trace)
    out = tmp_path / "rec.json.gz"
    cfg = tmp_path / "c.toml"
    # Loose bars (no class test, no margin), so that this small trace switches.
    cfg.write_text(
        "[controller]\nsample_rate = 1.0\nmin_samples = 5\nclass_confidence = 0.0\n"
        "[tuner]\nmin_requests = 20\nmargin = 0.0\nfull_window_margin = 0.0\n"
        "confidence = 0.6\nfull_window_confidence = 0.6\n"
    )
    line = bench.record(bench.RecordJob("unused", "60", None, str(cfg), str(out)))
    assert str(out) in line
    with gzip.open(out, "rt") as f:
        doc = json.load(f)
    assert doc["names"][0] == LRU and len(doc["rows"]) > 100
    assert all(len(r) == 2 + len(doc["names"]) for r in doc["rows"])
    assert doc["switches"]
    # Every request is sampled (sample_rate 1): each one is a row, the last
    # refit interval's too (the replay ends between refits).
    assert len(doc["rows"]) == len(trace.requests)
    assert len(doc["rows"]) > doc["decisions"][-1][0]  # rows after the last refit
    path = bench.replay(doc, bench.settings_from(doc, {}))
    assert [(round(sw.time, 3), sw.to_candidate) for sw in path.switches] == [
        (round(s["time"], 3), s["to"]) for s in doc["switches"]
    ]


def test_a_dropped_candidate_is_left_out_of_the_path(bench):
    """``--drop``: the path of a smaller candidate set is the recording's
    other columns; with the leader dropped the tuner stays on LRU."""
    doc = recording(lead_from=600.0)
    doc["names"] = [LRU, "a", "b"]
    doc["rows"] = [row + [row[2]] for row in doc["rows"]]  # b: hits exactly as LRU does
    both = bench.replay(doc, bench.settings_from(doc, {}))
    assert [sw.to_candidate for sw in both.switches] == ["a"]
    without_a = bench.replay(doc, bench.settings_from(doc, {}), drop=("a",))
    assert without_a.switches == [] and without_a.score == without_a.lru == both.lru
    for bad in (("lru",), ("c",)):
        with pytest.raises(ValueError, match="cannot drop"):
            bench.replay(doc, bench.settings_from(doc, {}), drop=bad)


def test_window_leads_are_the_tuners_comparisons_over_each_window(bench):
    """``leads``: the lead and error the tuner itself would compute over each
    window; a window before the lead begins reads none, one after it reads it."""
    doc = recording(lead_from=1800.0)
    looks = bench.window_leads(doc, "a", LRU, 900.0, 300.0)
    assert [end for end, _ in looks] == [900.0 + 300.0 * k for k in range(10)]
    by_end = dict(looks)
    assert by_end[1800.0].lead == 0.0 and by_end[1800.0].lower(2.33) <= 0.0  # the same hits until 1,800 s
    assert by_end[3600.0].lead == pytest.approx(0.10, abs=0.02) and by_end[3600.0].lower(2.33) > 0.05
    # The same numbers as the tuner's own paired comparison over that window.
    hits = PairedHits([LRU, "a"], doc["settings"]["batch_s"], 900.0)
    for t, n, *h in doc["rows"]:
        if t >= 2700.0:
            break
        hits.add(t, n, h)
    assert hits.compare("a", LRU, 1800.0) == by_end[2700.0]
    with pytest.raises(ValueError, match="no candidate"):
        bench.window_leads(doc, "b", LRU, 900.0, 300.0)
    last = doc["rows"][-1][0]
    assert bench.window_leads(doc, "a", LRU, last + 1.0, 300.0) == []  # no window of that length is full


def test_leads_prints_each_window_and_the_best_bound(bench, tmp_path, capsys):
    path = tmp_path / "r.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(recording(lead_from=1800.0), f)
    assert bench.main(["leads", str(path), "--a", "a", "--b", LRU, "--windows", "600,900"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:2] == ["600", "s"] and out[2].split()[:2] == ["900", "s"]
    assert out[-1].startswith("best bound +") and "ending at" in out[-1]
    for bad in (["--windows", "30m"], ["--confidence", "1.5"], ["--b", "nobody"]):
        with pytest.raises(SystemExit):
            bench.main(["leads", str(path), "--a", "a", "--b", LRU, *bad])

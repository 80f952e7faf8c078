"""The shipped Prometheus alerting rules: valid, reading only exported series, and firing
on the failure each one names (``promtool test rules`` on generated series)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from vllm_wa.serving import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = os.path.join(ROOT, "dashboards", "vllm-wa-alerts.yml")
# The API server's own counters (serving/api_metrics.py), beside the collector's.
API_SERVER_COUNTERS = {"vllm_wa_api_outcome_reports", "vllm_wa_api_outcome_hints"}


def _promtool() -> str:
    tool = shutil.which("promtool")
    assert tool, "Debian's prometheus package (with promtool) is part of the test set-up (make test installs it)"
    return tool


def _rules() -> list[dict]:
    with open(RULES) as f:
        return [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]


def test_the_rules_file_is_valid():
    out = subprocess.run([_promtool(), "check", "rules", RULES], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_series_an_alert_reads_is_exported():
    exported = set(API_SERVER_COUNTERS)
    for table in (metrics.ENGINE_COUNTERS, metrics.ENGINE_GAUGES, metrics.CLASS_COUNTERS, metrics.CLASS_GAUGES,
                  metrics.TAG_COUNTERS, metrics.SWITCH_COUNTERS, metrics.CANDIDATE_COUNTERS, metrics.CANDIDATE_GAUGES):
        exported |= {name for name, _ in table.values()}
    counters = {name for t in (metrics.ENGINE_COUNTERS, metrics.SWITCH_COUNTERS) for name, _ in t.values()}
    counters |= API_SERVER_COUNTERS
    for rule in _rules():
        for name in re.findall(r"vllm_wa_[a-z_]+", rule["expr"]):
            base = name.removesuffix("_total")
            assert base in exported, f"{rule['alert']} reads {name}, which /metrics does not export"
            assert (base in counters) == name.endswith("_total"), f"{rule['alert']}: {name} is not named as exported"


# One engine ("0") fails in every way an alert names; the other ("1") is healthy.
# Samples are a minute apart (promtool's expanding notation: 'a+bxN', 'axN').
SERIES = {
    'vllm_wa_controller_errors_total{engine="0"}': "0 0 0 1x37",
    'vllm_wa_controller_errors_total{engine="1"}': "0x40",
    'vllm_wa_refits_total{engine="0"}': "0+12x10 120x30",  # the controller stops at 10 min
    'vllm_wa_refits_total{engine="1"}': "0+12x40",
    'vllm_wa_events_dropped_total{engine="0"}': "0 0 5x38",
    'vllm_wa_events_dropped_total{engine="1"}': "0x40",
    'vllm_wa_events_failed_total{engine="0"}': "0 0 1x38",
    'vllm_wa_events_failed_total{engine="1"}': "0x40",
    'vllm_wa_hook_errors_total{engine="0"}': "0 0 2x38",
    'vllm_wa_hook_errors_total{engine="1"}': "0x40",
    'vllm_wa_checkpoint_errors_total{engine="0"}': "0 0 1x38",
    'vllm_wa_checkpoint_errors_total{engine="1"}': "0x40",
    'vllm_wa_api_outcome_reports_total{result="sent"}': "0+10x40",
    'vllm_wa_api_outcome_reports_total{result="dropped"}': "0 0 3x38",
    'vllm_wa_outcome_reports_dropped_total{engine="1"}': "0x40",
    'vllm_wa_tags_over_class_cap_total{engine="0"}': "0 0 4x38",
    'vllm_wa_tags_over_class_cap_total{engine="1"}': "0x40",
    'vllm_wa_tuner_switches_total{engine="0",reason="promote"}': "0 1x39",
    'vllm_wa_tuner_switches_total{engine="0",reason="real-check"}': "0 0 1x38",
    'vllm_wa_tuner_switches_total{engine="1",reason="promote"}': "0 1x39",
    'vllm_wa_tuner_switches_total{engine="1",reason="real-check"}': "0x40",
}
# alert -> labels of the alerts expected at 5 minutes (beyond alertname and severity).
AT_5M = {
    "VllmWaControllerErrors": [{"engine": "0"}],
    "VllmWaControllerStalled": [],
    "VllmWaEventsDropped": [{"engine": "0"}],
    "VllmWaEventsFailed": [{"engine": "0"}],
    "VllmWaHookErrors": [{"engine": "0"}],
    "VllmWaCheckpointErrors": [{"engine": "0"}],
    "VllmWaOutcomeReportsLost": [{}],
    "VllmWaTagsOverCap": [{"engine": "0"}],
    "VllmWaRealCheckDemotion": [{"engine": "0", "reason": "real-check"}],
}
# At 25 minutes the controller of engine "0" has been stalled for 15; the
# 10-minute alerts have cleared (their counters stopped moving at 2 to 3 minutes).
AT_25M = {
    "VllmWaControllerStalled": [{"engine": "0"}],
    "VllmWaControllerErrors": [],
    "VllmWaEventsDropped": [],
}


def test_each_alert_fires_on_its_failure_and_not_on_a_healthy_engine(tmp_path):
    rules = _rules()
    assert {r["alert"] for r in rules} == set(AT_5M)
    severity = {r["alert"]: r["labels"]["severity"] for r in rules}
    # promtool compares annotations too: test the expressions on a copy without them
    # (`promtool check rules` above checks that the annotation templates parse).
    stripped = {"groups": [{"name": "vllm-wa", "rules": [{k: v for k, v in r.items() if k != "annotations"}
                                                         for r in rules]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(stripped))

    def expect(at: str, table: dict[str, list[dict]]) -> list[dict]:
        return [
            {"eval_time": at, "alertname": name,
             "exp_alerts": [{"exp_labels": {**labels, "severity": severity[name]}} for labels in alerts]}
            for name, alerts in table.items()
        ]

    test = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in SERIES.items()],
            "alert_rule_test": expect("5m", AT_5M) + expect("25m", AT_25M),
        }],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    out = subprocess.run([_promtool(), "test", "rules", "test.yml"], capture_output=True, text=True, timeout=60, check=False,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("alert", sorted(AT_5M))
def test_every_alert_says_what_to_look_at(alert):
    rule = next(r for r in _rules() if r["alert"] == alert)
    assert rule["labels"]["severity"] in {"info", "warning", "critical"}
    assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 40

"""``vllm-wa check``: the server's files, read by the server's own parsers ahead of a deploy."""

from __future__ import annotations

import json

import pytest

from vllm_wa.cli import main
from vllm_wa.controller.config import ControllerConfig
from vllm_wa.controller.controller import WAController
from vllm_wa.engine_patch.events import EventSink
from vllm_wa.serving.preflight import preflight

CANDIDATE = "tag+outcome/hyper/posterior/L10"


def write_checkpoint(path, overstated: dict[str, float]) -> None:
    c = WAController(ControllerConfig(), 200, lambda params, key: None, EventSink())
    c.tuner.overstated.update(overstated)
    assert c.save_checkpoint(str(path))


def test_good_files_are_described_and_the_checkpoints_findings_counted_against_the_config(tmp_path, capsys):
    ckpt = tmp_path / "ckpt.json"
    write_checkpoint(ckpt, {CANDIDATE: 0.02, "gone/exp/pr/L5": 0.1})
    config = tmp_path / "wa.toml"
    config.write_text(f'[controller]\ncheckpoint_path = "{ckpt}"\n')
    params = tmp_path / "params.json"
    params.write_text(json.dumps({"a": {"chat": 0.01}, "p": {"chat": 0.6}, "mode": "ttl"}))

    findings = preflight(str(config), str(params))
    assert [(f.what, f.ok) for f in findings] == [("controller config", True), ("checkpoint", True), ("params", True)]
    assert "starts on lru" in findings[0].detail
    assert "for 2 candidate(s) (1 would apply with this config)" in findings[1].detail
    assert "1 classes, mode ttl" in findings[2].detail
    # With the real-cache check off, none would.
    config.write_text(f'[controller]\ncheckpoint_path = "{ckpt}"\n[tuner]\nreal_check = false\n')
    assert "(0 would apply" in preflight(str(config))[1].detail
    assert main(["check", "--controller-config", str(config)]) == 0
    assert "ok  checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize(
    "what, content, reason",
    [
        ("config", "[controller]\nrefit_interval_s = -1\n", "would not start"),
        ("config", "[controler]\n", "would not start"),
        ("params", '{"a": {"chat": 0.01}, "p": {"chat": 1.5}}', "would not start"),
        ("params", json.dumps({"a": {f"c{i}": 0.1 for i in range(65)}, "p": {f"c{i}": 0.5 for i in range(65)}}),
         "65 classes, more than the class cap (64)"),
        ("checkpoint", "{not json", "would warn and start from its prior"),
        ("checkpoint", json.dumps({"version": 2, "classes": [], "params": {"a": {}, "p": {}}, "overstated": [1]}),
         "would warn and start from its prior"),
    ],
)
def test_a_file_the_server_would_refuse_or_ignore_is_named_with_the_reason(tmp_path, capsys, what, content, reason):
    path = tmp_path / what
    path.write_text(content)
    flag = {"config": "--controller-config", "params": "--params", "checkpoint": "--checkpoint"}[what]
    assert main(["check", flag, str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("REFUSED") and reason in out


def test_a_missing_checkpoint_is_a_cold_start_and_nothing_to_check_is_an_error(tmp_path):
    assert [f.ok for f in preflight(checkpoint_path=str(tmp_path / "none.json"))] == [True]
    with pytest.raises(SystemExit):
        main(["check"])

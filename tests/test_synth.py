"""The synthetic Bailian trace generator: format, calibration, prefixes, config."""

from __future__ import annotations

import gzip
import json
import math
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import replace
from itertools import islice
from pathlib import Path

import pytest

from vllm_wa.replay.loaders import BAILIAN_BLOCK, MOONCAKE_BLOCK, load_bailian, load_mooncake
from vllm_wa.replay.synth import SynthClass, SynthConfig, as_mooncake, generate, write_trace

CONFIG_TOML = Path(__file__).resolve().parents[1] / "configs" / "synth-bailian-a.toml"


def _short(duration_s: float = 600.0, **kw) -> SynthConfig:
    return replace(SynthConfig.bailian_a(), duration_s=duration_s, **kw)


def _read_lines(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_written_trace_loads_and_is_synthetic(tmp_path: Path, name: str) -> None:
    cfg = _short(600.0)
    path = tmp_path / name
    n = write_trace(cfg, str(path))
    assert n > 1000
    trace = load_bailian(str(path))
    assert trace.synthetic is True
    assert len(trace.requests) == n
    assert {r.tag.split("_")[0] for r in trace.requests} == {"text", "search", "image", "file"}
    recs = _read_lines(path)
    assert len(recs) == n
    stamps = [r["timestamp"] for r in recs]
    assert stamps == sorted(stamps)
    assert 0.0 <= stamps[0] and stamps[-1] < cfg.duration_s
    for r in recs:
        assert r["synthetic"] is True
        assert len(r["hash_ids"]) == math.ceil(r["input_length"] / 16)
        assert r["input_length"] <= cfg.max_input_tokens
        assert r["output_length"] >= 1
    assert len({r["chat_id"] for r in recs}) == n
    # Steady state: some turns continue conversations that began in the warm-up.
    ids = {r["chat_id"] for r in recs}
    assert any(r["parent_chat_id"] >= 0 and r["parent_chat_id"] not in ids for r in recs)


def test_cold_start_has_no_orphan_turns() -> None:
    recs = list(generate(_short(300.0, warmup_s=0.0)))
    ids = {r["chat_id"] for r in recs}
    assert recs[0]["turn"] == 1
    assert all(r["parent_chat_id"] == -1 or r["parent_chat_id"] in ids for r in recs)


def test_class_counts_match_shares() -> None:
    cfg = _short(3600.0, rate_per_s=40.0)
    counts = Counter(r["type"] for r in generate(cfg))
    total = sum(counts.values())
    assert total == pytest.approx(cfg.rate_per_s * cfg.duration_s, rel=0.03)
    for c in cfg.classes:
        expected = c.share * total
        # Small classes have few conversations of geometric length: allow more noise.
        tol = 0.03 if c.share > 0.1 else 0.08
        assert counts[c.name] == pytest.approx(expected, rel=tol), (c.name, counts[c.name], expected)


def test_median_reuse_gap_per_class() -> None:
    base = SynthConfig.bailian_a()
    classes = tuple(replace(c, share=1.0 / len(base.classes)) for c in base.classes)
    cfg = replace(base, classes=classes, rate_per_s=8.0, duration_s=4 * 3600.0)
    seen: dict[int, float] = {}
    gaps: dict[str, list[float]] = defaultdict(list)
    for r in generate(cfg):
        seen[r["chat_id"]] = r["timestamp"]
        parent = seen.get(r["parent_chat_id"])
        if parent is not None:
            gaps[r["type"]].append(r["timestamp"] - parent)
    for c in cfg.classes:
        assert len(gaps[c.name]) > 2000
        med = statistics.median(gaps[c.name])
        assert med == pytest.approx(c.gap_median_s, rel=0.15), (c.name, med)


def test_turns_extend_previous_prompt() -> None:
    cfg = _short(900.0)
    by_id: dict[int, dict] = {}
    checked = 0
    for r in generate(cfg):
        by_id[r["chat_id"]] = r
        p = by_id.get(r["parent_chat_id"])
        if p is None:
            continue
        checked += 1
        assert r["type"] == p["type"] and r["turn"] == p["turn"] + 1
        assert r["input_length"] > p["input_length"] + p["output_length"]
        full = p["input_length"] // 16
        assert r["hash_ids"][:full] == p["hash_ids"][:full]
        if p["input_length"] % 16:
            # The parent's partial last block now holds more tokens: a new id.
            assert r["hash_ids"][full] != p["hash_ids"][full]
    assert checked > 500


def test_hash_id_implies_its_prefix() -> None:
    """An id always sits at the same position after the same id, so it names its whole prefix."""
    where: dict[int, tuple[int, int]] = {}
    for r in generate(_short(600.0)):
        prev = -1
        for j, h in enumerate(r["hash_ids"]):
            assert where.setdefault(h, (j, prev)) == (j, prev)
            prev = h


def test_system_prompts_are_shared_across_conversations() -> None:
    cfg = _short(600.0, warmup_s=0.0)
    sys_blocks = {c.name: c.system_prompt_tokens // 16 for c in cfg.classes}
    groups: dict[tuple[str, tuple[int, ...]], list[list[int]]] = defaultdict(list)
    for r in generate(cfg):
        if r["turn"] == 1:
            n = sys_blocks[r["type"]]
            groups[(r["type"], tuple(r["hash_ids"][:n]))].append(r["hash_ids"])
    for c in cfg.classes:
        mine = {k: v for k, v in groups.items() if k[0] == c.name}
        assert 1 < len(mine) <= c.system_prompts
        # Zipf-like: the most popular system prompt serves many conversations.
        biggest = max(mine.values(), key=len)
        assert len(biggest) >= 5
        # Their prompts diverge right after the shared system prompt.
        n = sys_blocks[c.name]
        assert len({h[n] for h in biggest}) == len(biggest)
    # Different classes never share a system prompt block.
    firsts = [k[1][0] for k in groups]
    assert len(firsts) == len(set(firsts))


def test_same_seed_same_trace_other_seed_differs(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_trace(_short(300.0, seed=7), str(a))
    write_trace(_short(300.0, seed=7), str(b))
    write_trace(_short(300.0, seed=8), str(c))
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_generation_is_lazy() -> None:
    """Records stream out; nothing is built for the whole duration up front
    (a billion seconds would not fit), and the duration does not change the start."""
    endless = list(islice(generate(replace(SynthConfig.bailian_a(), duration_s=1e9)), 50))
    assert endless == list(islice(generate(replace(SynthConfig.bailian_a(), duration_s=600.0)), 50))


def _one_class(**kw) -> dict:
    return {"classes": [{"name": "text", "share": 1.0, **kw}]}


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"bogus": 1}, "bogus"),
        ({"duration_s": "long"}, "duration_s"),
        ({"rate_per_s": 0}, "rate_per_s must be > 0"),
        ({"seed": 1.5}, "seed"),
        ({"warmup_s": -1.0}, "warmup_s"),
        ({"classes": "text"}, "classes"),
        ({"classes": []}, "classes"),
        (_one_class(bogus=2), "classes[0].bogus"),
        (_one_class(share=-0.5), "classes[0].share"),
        (_one_class(turns_mean=0.5), "classes[0].turns_mean"),
        (_one_class(gap_sigma=-1.0), "classes[0].gap_sigma"),
        (_one_class(system_prompts=2.5), "classes[0].system_prompts"),
        (_one_class(first_prompt_tokens=True), "classes[0].first_prompt_tokens"),
        ({"classes": [{"name": "video", "share": 1.0}]}, "classes[0].turns_mean is required"),
        (
            {"classes": [{"name": "text", "share": 0.5}, {"name": "search", "share": 0.3},
                         {"name": "file", "share": 0.2, "gap_median_s": 0}]},
            "classes[2].gap_median_s must be > 0",
        ),
        ({"classes": [{"name": "text", "share": 0.5}, {"name": "search", "share": 0.3}]}, "share must sum to 1"),
        ({"classes": [{"name": "text", "share": 0.5}, {"name": "text", "share": 0.5}]}, "classes[1].name"),
        ({"max_input_tokens": 100}, "classes[0].system_prompt_tokens"),
    ],
)
def test_bad_config_names_the_key(raw: dict, key: str) -> None:
    with pytest.raises(ValueError, match=re.escape(key)):
        SynthConfig.from_dict(raw)


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ValueError, match=re.escape("classes[0].reply_tokens")):
        SynthConfig(classes=(replace(SynthConfig.bailian_a().classes[0], share=1.0, reply_tokens=-3),))


def test_missing_keys_default_to_bailian_a() -> None:
    cfg = SynthConfig.from_dict({"duration_s": 60, "classes": [{"name": "search", "share": 1.0}]})
    default = SynthConfig.bailian_a()
    assert cfg.rate_per_s == default.rate_per_s and cfg.seed == default.seed
    assert cfg.classes == (replace(default.classes[1], share=1.0),)
    assert SynthConfig.from_dict({}) == default


def test_bailian_a_matches_published_figures() -> None:
    cfg = SynthConfig.bailian_a()
    published = {"text": (31744, 47.7), "search": (8187, 111.8), "image": (1617, 4.8), "file": (1510, 152.4)}
    total = sum(n for n, _ in published.values())
    assert cfg.rate_per_s * cfg.duration_s == pytest.approx(total, rel=0.01)
    for c in cfg.classes:
        n, gap = published[c.name]
        assert c.share == pytest.approx(n / total, abs=1e-4)
        assert c.gap_median_s == gap


def test_toml_default_equals_bailian_a() -> None:
    cfg = SynthConfig.from_toml(str(CONFIG_TOML))
    default = SynthConfig.bailian_a()
    assert [(c.name, c.share, c.gap_median_s) for c in cfg.classes] == [
        (c.name, c.share, c.gap_median_s) for c in default.classes
    ]
    assert cfg == default
    assert all(isinstance(c, SynthClass) for c in cfg.classes)


def test_the_shared_templates_config_reads_and_makes_mostly_single_turn_templated_traffic() -> None:
    """configs/synth-shared-templates.toml (docs/results.md, "Frequency") is
    read as written: its two classes, and a short trace of it is mostly
    single-turn requests whose prompts start with one of its templates."""
    cfg = SynthConfig.from_toml(str(CONFIG_TOML.with_name("synth-shared-templates.toml")))
    assert [(c.name, c.share, c.system_prompts, c.system_prompt_tokens) for c in cfg.classes] == [
        ("text", 0.8, 300, 2500), ("file", 0.2, 20, 800),
    ]
    recs = list(generate(replace(cfg, duration_s=600.0)))
    assert recs and sum(r["turn"] == 1 for r in recs) > 0.7 * len(recs)
    firsts = Counter(tuple(r["hash_ids"][:150]) for r in recs if r["type"] == "text" and len(r["hash_ids"]) > 150)
    assert firsts.most_common(1)[0][1] > 10  # the most popular template's blocks, shared


def test_synth_refuses_an_output_it_cannot_write_before_generating(tmp_path, monkeypatch):
    from vllm_wa import cli
    from vllm_wa.replay import synth

    generated = []
    monkeypatch.setattr(synth, "write_trace", lambda cfg, out, fmt: generated.append(out) or 0)
    for out, says in ((f"{tmp_path}/", "names a directory"), (str(tmp_path / "no" / "t.jsonl"), "not a writable")):
        with pytest.raises(SystemExit, match=says):
            cli.main(["synth", "--out", out])
    assert generated == []
    assert cli.main(["synth", "--out", str(tmp_path / "t.jsonl")]) == 0 and generated == [str(tmp_path / "t.jsonl")]


def _mooncake_blocks_equal(a: list[int], b: list[int], k: int) -> bool:
    """Whether 512-token block ``k`` of two prompts holds the same tokens after the same prefix
    (the same 16-token ids up to its end; a partial block only where both prompts end alike)."""
    end = (k + 1) * (MOONCAKE_BLOCK // BAILIAN_BLOCK)
    return a[:end] == b[:end]


def test_mooncake_format_shares_a_block_exactly_when_its_tokens_and_prefix_are_shared() -> None:
    """Every Mooncake id stands for 32 Bailian blocks and everything before
    them: two prompts share block k's id iff they share those 16-token ids
    (a partial last block only with a prompt that ends at the same place)."""
    cfg = _short(300.0)
    small = list(generate(cfg))
    big = list(as_mooncake(iter(small)))
    assert len(big) == len(small)
    for s, m in zip(small, big):
        assert set(m) == {"timestamp", "input_length", "output_length", "hash_ids", "synthetic"}
        assert m["timestamp"] == round(s["timestamp"] * 1000)
        assert len(m["hash_ids"]) == math.ceil(s["input_length"] / 512)
    # Pairs that share a first block (same system prompt), and later turns of one conversation.
    by_first = defaultdict(list)
    for i, m in enumerate(big):
        by_first[m["hash_ids"][0]].append(i)
    pairs = [(g[0], j) for g in by_first.values() for j in g[1:4]]
    parent = {s["chat_id"]: i for i, s in enumerate(small)}
    pairs += [(parent[s["parent_chat_id"]], i) for i, s in enumerate(small) if s["parent_chat_id"] in parent]
    assert len(pairs) > 100
    shared_somewhere = 0
    for i, j in pairs:
        a, b = small[i]["hash_ids"], small[j]["hash_ids"]
        ma, mb = big[i]["hash_ids"], big[j]["hash_ids"]
        for k in range(min(len(ma), len(mb))):
            assert (ma[k] == mb[k]) == _mooncake_blocks_equal(a, b, k), (i, j, k)
            shared_somewhere += k > 0 and ma[k] == mb[k]
    assert shared_somewhere > 100


def test_a_mooncake_format_trace_loads_as_a_synthetic_mooncake_trace(tmp_path: Path) -> None:
    from vllm_wa import cli

    path = tmp_path / "m.jsonl.gz"
    assert cli.main(["synth", "--duration", "120", "--format", "mooncake", "--out", str(path)]) == 0
    trace = load_mooncake(str(path))
    assert trace.synthetic is True and trace.fmt == "mooncake" and trace.block_size == 512
    recs = _read_lines(path)
    assert len(trace.requests) == len(recs) > 100
    assert not trace.conversations and {r.tag for r in trace.requests} == {trace.requests[0].tag}
    assert max(len(r["hash_ids"]) for r in recs) < max(len(s["hash_ids"]) for s in generate(_short(120.0)))


def test_a_mooncake_record_with_a_bad_synthetic_flag_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    path.write_text(json.dumps({**good, "synthetic": "yes"}) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match="'synthetic' must be true or false"):
        load_mooncake(str(path))
    trace = load_mooncake(str(path), skip_bad=True)
    assert len(trace.requests) == 1 and trace.synthetic is False


def test_the_toolagent_config_reads_and_makes_long_shared_prompts_in_agent_loops() -> None:
    """configs/synth-toolagent.toml (docs/results.md, "Mooncake-format stress
    traces"): its two classes, agent loops of several turns, and prompts near
    the 8.6k tokens Mooncake reports for its tool-and-agent trace."""
    cfg = SynthConfig.from_toml(str(CONFIG_TOML.with_name("synth-toolagent.toml")))
    assert [(c.name, c.share, c.turns_mean, c.system_prompt_tokens) for c in cfg.classes] == [
        ("agent", 0.7, 3.0, 4000), ("tool", 0.3, 1.1, 3000),
    ]
    recs = list(generate(replace(cfg, duration_s=900.0)))
    mean_in = statistics.fmean(r["input_length"] for r in recs)
    assert 6000 < mean_in < 11000
    assert sum(r["turn"] > 1 for r in recs if r["type"] == "agent") > 0.4 * sum(r["type"] == "agent" for r in recs)

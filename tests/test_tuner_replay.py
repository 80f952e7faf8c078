"""The tuner on generated traces, through the replay (the same controller as in serving)."""

from __future__ import annotations

import random
from array import array

from vllm_wa.controller.config import ControllerConfig
from vllm_wa.replay.runner import ReplayConfig, make_policy, prepare, run_one
from vllm_wa.replay.trace import Trace, TraceRequest

BLOCK = 16


def uninformative_trace(seed: int = 0, conversations: int = 600) -> Trace:
    """Conversations whose next turn comes back after a delay no feature predicts.

    Tags, outcomes and turn gaps are drawn independently, and the gaps are
    memoryless (exponential, one mean for every request), so every class a
    candidate can form has the same reuse law and the chance of a reuse only
    falls with a block's idle time: a workload-aware order can only match
    LRU's up to the noise of its fits, never lead it.
    """
    rng = random.Random(seed)
    reqs: list[TraceRequest] = []
    next_id = 0
    for c in range(conversations):
        t = rng.uniform(0, 6000.0)
        prompt: list[int] = []
        for k in range(rng.randint(3, 8)):
            grow = rng.randint(2, 5)
            prompt = prompt + list(range(next_id, next_id + grow))
            next_id += grow
            reqs.append(TraceRequest(
                request_id=f"c{c}t{k}", arrival=t, hash_ids=array("q", prompt), input_tokens=len(prompt) * BLOCK,
                output_tokens=8, tag=rng.choice(("chat", "agent")), conversation=c,
                outcome=rng.choice(("tool", "stop")),
            ))
            t += rng.expovariate(1 / 120.0)
    reqs.sort(key=lambda r: r.arrival)
    return Trace("uninformative", BLOCK, reqs, "generated", synthetic=True)


def test_on_a_trace_no_feature_predicts_the_tuner_stays_on_lru():
    """On traffic where no candidate has a real lead, ``wa-online`` is LRU.

    Issue 8's bounds: at most 5 % of the trace off LRU, and ``wa-online``
    within 0.2 points of ``lru``. Every class a candidate forms here has one
    reuse law, so none rejects the pooled model (``class_confidence``) and
    every candidate orders blocks as LRU does: no lead to promote on. Before
    that test, one promotion on a 3.7 % miniature-cache lead that held for
    15 minutes (noisy per-class fits) cost 0.63 points.
    """
    trace = uninformative_trace()
    config = ControllerConfig(
        refit_interval_s=5.0, fit_interval_s=5.0, min_samples=5, tuner_batch_s=30.0, tuner_window_s=900.0,
        tuner_demote_window_s=300.0, tuner_min_requests=50, sample_rate=1.0,
    )
    cfg = ReplayConfig(controller_config=config)
    setup = prepare(trace, ["lru", "wa-online"], cfg)
    lru = run_one(setup.trace, make_policy("lru", setup), 300, cfg, setup.eval_start)
    wa = run_one(setup.trace, make_policy("wa-online", setup), 300, cfg, setup.eval_start)
    assert wa.extra["refits"] > 1000 and wa.extra["errors"] == 0
    on = wa.extra["seconds_on_candidate"]
    total = sum(on.values())
    assert total > 0.95 * (trace.end - trace.start)
    off_lru = total - on.get("lru", 0.0)
    assert off_lru <= 0.05 * total, (off_lru, total, wa.extra["switches"])
    # Every switch away from LRU came back (a demotion follows each promotion).
    reasons = [s["reason"] for s in wa.extra["switches"]]
    assert reasons.count("promote") == reasons.count("demote")
    assert wa.token_hit_rate >= lru.token_hit_rate - 0.002

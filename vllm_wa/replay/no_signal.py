"""A generated trace with (almost) nothing for a class key to read: the guard-rail's test bed.

Issue 8's "every WA candidate loses" case. Tags, outcomes and turn gaps are
drawn independently, and the gaps are memoryless (exponential, one mean for
every request), so a class formed by tag, outcome or think time has the same
reuse law as any other and the chance of a reuse only falls with a block's
idle time: on those keys a workload-aware order can only match LRU's up to the
noise of its fits. The one signal left is a conversation's length (3 to 8
turns), which a key with the turn count can read a little of: with a looser
class test such keys ended up to 0.40 points above LRU here (docs/results.md, "No
signal"). A tuner that promotes on the default class test promoted on noise.
With geometric lengths (``lengths="geometric"``) that signal is gone too.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import replace

from vllm_wa.controller.config import ControllerConfig
from vllm_wa.replay.trace import Trace, TraceRequest

BLOCK_SIZE = 16
LENGTHS = ("uniform", "geometric")
CONVERSATIONS = 600  # the default trace's; CACHE_BLOCKS is sized for it
GEOMETRIC_MEAN_TURNS = 5.5  # the uniform lengths' mean


def no_signal_trace(
    seed: int = 0, conversations: int = CONVERSATIONS, mean_gap_s: float = 120.0, lengths: str = "uniform"
) -> Trace:
    """``conversations`` conversations starting over 6,000 s.

    Each turn's prompt is the previous one plus 2 to 5 new blocks; the next
    turn comes an exponential gap (mean ``mean_gap_s``) later. ``lengths``:
    ``"uniform"``, 3 to 8 turns (a little signal for a turn-count key); or
    ``"geometric"``, another turn with the same chance after every turn (mean
    :data:`GEOMETRIC_MEAN_TURNS`), so the turn count tells nothing either.
    """
    if lengths not in LENGTHS:
        raise ValueError(f"lengths must be one of {LENGTHS}, got {lengths!r}")
    rng = random.Random(seed)
    reqs: list[TraceRequest] = []
    next_id = 0
    for c in range(conversations):
        t = rng.uniform(0, 6000.0)
        prompt: list[int] = []
        turns = rng.randint(3, 8) if lengths == "uniform" else 0
        k = 0
        while True:
            grow = rng.randint(2, 5)
            prompt = prompt + list(range(next_id, next_id + grow))
            next_id += grow
            reqs.append(
                TraceRequest(
                    request_id=f"c{c}t{k}",
                    arrival=t,
                    hash_ids=array("q", prompt),
                    input_tokens=len(prompt) * BLOCK_SIZE,
                    output_tokens=8,
                    tag=rng.choice(("chat", "agent")),
                    conversation=c,
                    outcome=rng.choice(("tool", "stop")),
                )
            )
            t += rng.expovariate(1 / mean_gap_s)
            k += 1
            last = k == turns if lengths == "uniform" else rng.random() < 1 / GEOMETRIC_MEAN_TURNS
            if last:
                break
    reqs.sort(key=lambda r: r.arrival)
    return Trace("no-signal", BLOCK_SIZE, reqs, "generated", synthetic=True)


# The cache size the trace is replayed at (blocks), and the controller scaled
# to it: every block watched, fits and tuner evidence sized for a few hundred
# requests per window instead of thousands.
CACHE_BLOCKS = 300


def scaled_cache_blocks(conversations: int) -> int:
    """The cache for a trace of ``conversations`` (``CACHE_BLOCKS`` at the default ``CONVERSATIONS``)."""
    return max(1, round(CACHE_BLOCKS * conversations / CONVERSATIONS))


def small_trace_controller(base: ControllerConfig | None = None, **overrides: object) -> ControllerConfig:
    """The controller config of the no-signal runs: ``base`` (default: the
    defaults) scaled to the small trace, then ``overrides`` (any other field)."""
    scaled: dict[str, object] = {
        "refit_interval_s": 5.0,
        "fit_interval_s": 5.0,
        "min_samples": 5,
        "tuner_batch_s": 30.0,
        "tuner_window_s": 900.0,
        "tuner_demote_window_s": 300.0,
        "tuner_min_requests": 50,
        "sample_rate": 1.0,
    }
    scaled.update(overrides)
    return replace(base or ControllerConfig(), **scaled)  # type: ignore[arg-type]

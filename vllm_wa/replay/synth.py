"""Synthetic Bailian-format traces, for runs where the real trace is unavailable.

The generator models what matters for KV-cache eviction: which prompt blocks
are shared, and how long a block waits before it is reused.

* Conversations of each workload class start as a Poisson process; a
  conversation has a geometric number of turns (mean ``turns_mean``).
* The next turn of a conversation arrives a lognormal *reuse gap* after the
  previous one (median ``gap_median_s``, heavy tailed through ``gap_sigma``).
* Turn ``k``'s prompt is turn ``k-1``'s prompt + its reply + new user tokens,
  so it repeats every *full* 16-token block of turn ``k-1``'s prompt; the last
  partial block gets a new id because its content changed.
* Each conversation starts with one of its class's shared system prompts
  (chosen Zipf-like), whose full blocks have fixed ids, so different
  conversations share prefix blocks.

Hash ids come from one global counter: an id names a block together with its
whole prefix, as vLLM's chained block hashes do.  Every record carries
``"synthetic": true`` so :func:`vllm_wa.replay.loaders.load_bailian` flags the
trace as synthetic.

Only the class shares and median reuse gaps of :meth:`SynthConfig.bailian_a`
are published figures; token lengths, turn counts and spreads are guesses.

:func:`as_mooncake` rewrites the records in Mooncake's format (512-token
blocks, millisecond timestamps, no workload type and no conversation ids),
so the same traffic can be replayed with only what a Mooncake trace tells a
policy: Mooncake's tool-and-agent trace, for one, is not here.
"""

from __future__ import annotations

import bisect
import gzip
import heapq
import json
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_wa.fileio import atomic_write, opener_for, read_toml
from vllm_wa.replay.loaders import BAILIAN_BLOCK, MOONCAKE_BLOCK
from vllm_wa.validation import check_number

FORMATS = ("bailian", "mooncake")


@dataclass(frozen=True)
class SynthClass:
    """One workload type (Bailian ``type``) and how its conversations behave."""

    name: str
    share: float  # fraction of all requests (all turns) of this type
    turns_mean: float  # mean turns per conversation; geometric on {1, 2, ...}
    first_prompt_tokens: float  # median new tokens of turn 1 after the system prompt (lognormal)
    prompt_sigma: float  # lognormal sigma of first-prompt and later-turn user tokens
    turn_input_tokens: float  # median new user tokens of each later turn (lognormal)
    reply_tokens: float  # median reply length, output_length (lognormal)
    reply_sigma: float  # lognormal sigma of the reply length
    gap_median_s: float  # median time from a request's arrival to its conversation's next turn
    gap_sigma: float  # lognormal sigma of that gap; larger = heavier tail
    system_prompts: int  # distinct shared system prompts of this type (0 = none)
    system_prompt_tokens: int  # length of each system prompt
    zipf_exponent: float = 1.0  # system prompt of rank r is picked with weight 1 / r**zipf_exponent


@dataclass(frozen=True)
class SynthConfig:
    """A whole synthetic trace: duration, total rate and the workload mix.

    Validated on construction; a bad value raises ``ValueError`` naming its
    key (``classes[2].gap_median_s must be > 0``).
    """

    duration_s: float = 7200.0  # requests at or after this time are not emitted
    rate_per_s: float = 5.98  # total request rate, all classes and turns
    classes: tuple[SynthClass, ...] = field(default_factory=lambda: _BAILIAN_A_CLASSES)
    seed: int = 0
    # Conversations are simulated from -warmup_s so the trace starts in steady
    # state (in-flight conversations, per-class shares right from t=0), like a
    # window cut out of a real trace.  Turns whose parent arrived before 0 keep
    # their parent_chat_id although the parent is not in the file.  0 = cold start.
    warmup_s: float = 1800.0
    # A prompt is never longer than this: a first prompt is clipped to it, and
    # a conversation whose next prompt would exceed it ends there.
    max_input_tokens: int = 131072

    def __post_init__(self) -> None:
        if isinstance(self.classes, list):
            object.__setattr__(self, "classes", tuple(self.classes))
        _validate(self)

    @classmethod
    def bailian_a(cls) -> SynthConfig:
        """The default: Bailian trace A's published class mix and reuse gaps."""
        return cls()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SynthConfig:
        """Build from a mapping (parsed TOML); missing keys default to :meth:`bailian_a`.

        A ``classes`` list replaces the default list; an entry named like a
        default class takes that class's values for its missing keys, any
        other entry must give every key.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"config must be a table, got {type(d).__name__}")
        top = {f.name for f in fields(cls)}
        for key in d:
            if key not in top:
                raise ValueError(f"{key}: unknown key")
        kwargs = {k: v for k, v in d.items() if k != "classes"}
        if "classes" in d:
            raw = d["classes"]
            if not isinstance(raw, list):
                raise ValueError(f"classes must be a list of tables, got {type(raw).__name__}")
            kwargs["classes"] = tuple(_class_from_dict(c, f"classes[{i}]") for i, c in enumerate(raw))
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str) -> SynthConfig:
        """Read a TOML config (see ``configs/synth-bailian-a.toml``)."""
        return cls.from_dict(read_toml(path))


# ---- Bailian trace A --------------------------------------------------------------------------
# Published for trace A (two hours): 31,744 text / 8,187 search / 1,617 image /
# 1,510 file requests (43,058 in all, 5.98 req/s) and median reuse gaps text
# 47.7 s, image 4.8 s, search 111.8 s, file 152.4 s.  Everything else below
# (turn counts, token lengths, spreads, system prompts) is a plausible guess.
_BAILIAN_A_CLASSES: tuple[SynthClass, ...] = (
    SynthClass(
        name="text", share=0.7372, turns_mean=2.5,
        first_prompt_tokens=800, prompt_sigma=1.0, turn_input_tokens=200,
        reply_tokens=350, reply_sigma=0.8, gap_median_s=47.7, gap_sigma=1.5,
        system_prompts=50, system_prompt_tokens=600,
    ),
    SynthClass(
        name="search", share=0.1901, turns_mean=1.6,
        first_prompt_tokens=1800, prompt_sigma=0.7, turn_input_tokens=1500,
        reply_tokens=500, reply_sigma=0.7, gap_median_s=111.8, gap_sigma=1.5,
        system_prompts=10, system_prompt_tokens=1000,
    ),
    SynthClass(
        name="image", share=0.0376, turns_mean=2.0,
        first_prompt_tokens=1500, prompt_sigma=0.6, turn_input_tokens=300,
        reply_tokens=250, reply_sigma=0.8, gap_median_s=4.8, gap_sigma=1.5,
        system_prompts=10, system_prompt_tokens=300,
    ),
    SynthClass(
        name="file", share=0.0351, turns_mean=1.8,
        first_prompt_tokens=12000, prompt_sigma=1.0, turn_input_tokens=300,
        reply_tokens=600, reply_sigma=0.8, gap_median_s=152.4, gap_sigma=1.5,
        system_prompts=10, system_prompt_tokens=400,
    ),
)
_DEFAULT_BY_NAME = {c.name: c for c in _BAILIAN_A_CLASSES}


# ---- validation -------------------------------------------------------------------------------


def _integer(where: str, v: Any, *, ge: int | None = None) -> None:
    if not isinstance(v, int):  # an integral float would be accepted by check_number
        raise ValueError(f"{where} must be an integer, got {v!r}")
    check_number(where, v, ge=ge, integer=True)


def _validate_class(c: SynthClass, where: str, max_input_tokens: int) -> None:
    if not isinstance(c, SynthClass):
        raise ValueError(f"{where} must be a SynthClass, got {type(c).__name__}")
    if not isinstance(c.name, str) or not c.name:
        raise ValueError(f"{where}.name must be a non-empty string, got {c.name!r}")
    check_number(f"{where}.share", c.share, gt=0, le=1)
    check_number(f"{where}.turns_mean", c.turns_mean, ge=1)
    for key in ("first_prompt_tokens", "turn_input_tokens", "reply_tokens", "gap_median_s"):
        check_number(f"{where}.{key}", getattr(c, key), gt=0)
    for key in ("prompt_sigma", "reply_sigma", "gap_sigma", "zipf_exponent"):
        check_number(f"{where}.{key}", getattr(c, key), ge=0)
    _integer(f"{where}.system_prompts", c.system_prompts, ge=0)
    _integer(f"{where}.system_prompt_tokens", c.system_prompt_tokens, ge=0)
    if c.system_prompt_tokens >= max_input_tokens:
        raise ValueError(
            f"{where}.system_prompt_tokens must be < max_input_tokens ({max_input_tokens}), got {c.system_prompt_tokens}"
        )


def _validate(cfg: SynthConfig) -> None:
    check_number("duration_s", cfg.duration_s, gt=0)
    check_number("rate_per_s", cfg.rate_per_s, gt=0)
    check_number("warmup_s", cfg.warmup_s, ge=0)
    _integer("seed", cfg.seed)
    _integer("max_input_tokens", cfg.max_input_tokens, ge=1)
    if not isinstance(cfg.classes, tuple) or not cfg.classes:
        raise ValueError("classes must be a non-empty list of classes")
    names: set[str] = set()
    for i, c in enumerate(cfg.classes):
        _validate_class(c, f"classes[{i}]", cfg.max_input_tokens)
        if c.name in names:
            raise ValueError(f"classes[{i}].name {c.name!r} is used twice")
        names.add(c.name)
    total = math.fsum(c.share for c in cfg.classes)
    if abs(total - 1.0) > 0.01:
        raise ValueError(f"classes[*].share must sum to 1 (within 0.01), got {total:g}")


def _class_from_dict(d: Any, where: str) -> SynthClass:
    if not isinstance(d, Mapping):
        raise ValueError(f"{where} must be a table, got {type(d).__name__}")
    known = [f.name for f in fields(SynthClass)]
    for key in d:
        if key not in known:
            raise ValueError(f"{where}.{key}: unknown key")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name must be a non-empty string, got {name!r}")
    base = _DEFAULT_BY_NAME.get(name)
    kwargs: dict[str, Any] = {}
    for f in fields(SynthClass):
        if f.name in d:
            kwargs[f.name] = d[f.name]
        elif base is not None:
            kwargs[f.name] = getattr(base, f.name)
        elif f.name == "zipf_exponent":
            continue  # has a dataclass default
        else:
            raise ValueError(f"{where}.{f.name} is required (no default class named {name!r})")
    return SynthClass(**kwargs)


# ---- generation -------------------------------------------------------------------------------


def _lognormal_tokens(rng: random.Random, mu: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(mu, sigma)))


def generate(config: SynthConfig) -> Iterator[dict]:
    """Yield Bailian records in timestamp order, ``0 <= timestamp < duration_s``.

    One heap holds the next conversation start of each class and the pending
    next turn of each live conversation; a finished conversation is dropped,
    so memory follows the number of live conversations, not the duration.
    Deterministic for a given ``config.seed``.
    """
    rng = random.Random(config.seed)
    classes = config.classes
    total_share = math.fsum(c.share for c in classes)
    max_in = config.max_input_tokens

    next_hash = 0
    sys_blocks: list[list[list[int]]] = []  # [class][prompt] -> ids of its full blocks
    cum_weights: list[list[float]] = []
    for c in classes:
        n_full = c.system_prompt_tokens // BAILIAN_BLOCK
        prompts = []
        for _ in range(c.system_prompts):
            prompts.append(list(range(next_hash, next_hash + n_full)))
            next_hash += n_full
        sys_blocks.append(prompts)
        acc, cw = 0.0, []
        for r in range(1, c.system_prompts + 1):
            acc += r ** -c.zipf_exponent
            cw.append(acc)
        cum_weights.append(cw)

    # Conversation start rate: requests of the class per second / turns per conversation.
    start_rate = [config.rate_per_s * c.share / total_share / c.turns_mean for c in classes]
    p_next = [1.0 - 1.0 / c.turns_mean for c in classes]
    mu_first = [math.log(c.first_prompt_tokens) for c in classes]
    mu_turn = [math.log(c.turn_input_tokens) for c in classes]
    mu_reply = [math.log(c.reply_tokens) for c in classes]
    mu_gap = [math.log(c.gap_median_s) for c in classes]

    # Heap entries: (time, seq, class index, conversation state or None for "start one").
    t0 = -float(config.warmup_s)
    heap: list[tuple[float, int, int, tuple | None]] = []
    seq = 0
    for i, rate in enumerate(start_rate):
        heap.append((t0 + rng.expovariate(rate), seq, i, None))
        seq += 1
    heapq.heapify(heap)

    chat_id = 0
    end = float(config.duration_s)
    while heap:
        t, _, i, state = heapq.heappop(heap)
        if t >= end:
            break  # every later event is later still
        c = classes[i]
        if state is None:
            heapq.heappush(heap, (t + rng.expovariate(start_rate[i]), seq, i, None))
            seq += 1
            prefix: list[int] = []
            if c.system_prompts:
                k = bisect.bisect_left(cum_weights[i], rng.random() * cum_weights[i][-1])
                prefix = sys_blocks[i][min(k, c.system_prompts - 1)]
            n_in = min(c.system_prompt_tokens + _lognormal_tokens(rng, mu_first[i], c.prompt_sigma), max_in)
            parent, turn = -1, 1
        else:
            parent, prev_hashes, prev_in, prev_out, prev_turn = state
            n_in = prev_in + prev_out + _lognormal_tokens(rng, mu_turn[i], c.prompt_sigma)
            if n_in > max_in:
                continue  # context full: the conversation ends
            prefix = prev_hashes[: prev_in // BAILIAN_BLOCK]
            turn = prev_turn + 1
        n_new = -(-n_in // BAILIAN_BLOCK) - len(prefix)
        hashes = prefix + list(range(next_hash, next_hash + n_new))
        next_hash += n_new
        n_out = _lognormal_tokens(rng, mu_reply[i], c.reply_sigma)
        me = chat_id
        chat_id += 1
        if t >= 0.0:
            yield {
                "chat_id": me,
                "parent_chat_id": parent,
                "timestamp": round(t, 3),
                "input_length": n_in,
                "output_length": n_out,
                "type": c.name,
                "turn": turn,
                "hash_ids": list(hashes),
                "synthetic": True,
            }
        if rng.random() < p_next[i]:
            gap = rng.lognormvariate(mu_gap[i], c.gap_sigma)
            heapq.heappush(heap, (t + gap, seq, i, (me, hashes, n_in, n_out, turn)))
            seq += 1


def as_mooncake(records: Iterator[dict]) -> Iterator[dict]:
    """Bailian records as Mooncake records: 512-token blocks, ms, no type or ids.

    A 512-token block is 32 of the 16-token blocks; its id names it together
    with its prefix (the id of the block before it and its own 32 ids), so
    two prompts share a Mooncake block exactly when they share its tokens and
    everything before them.  The last block may be partial, as in Mooncake's
    traces (``ceil(input_length / 512)`` ids).  The id table holds one entry
    per distinct block, as the trace itself does.
    """
    per = MOONCAKE_BLOCK // BAILIAN_BLOCK
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    for rec in records:
        small = rec["hash_ids"]
        prev = -1
        out = []
        for i in range(0, len(small), per):
            prev = ids.setdefault((prev, tuple(small[i : i + per])), len(ids))
            out.append(prev)
        yield {
            "timestamp": round(rec["timestamp"] * 1000),
            "input_length": rec["input_length"],
            "output_length": rec["output_length"],
            "hash_ids": out,
            "synthetic": True,
        }


def write_trace(config: SynthConfig, path: str, fmt: str = "bailian") -> int:
    """Write :func:`generate`'s records as JSON lines, compressed as the name
    says (.gz, .xz, .bz2; the loaders read those by name too), in ``fmt``:
    ``bailian`` or ``mooncake`` (:func:`as_mooncake`).

    Written to a temporary file and renamed, so a failed run leaves no
    partial trace behind.  Returns the number of records.
    """
    if fmt not in FORMATS:
        raise ValueError(f"trace format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    records = generate(config) if fmt == "bailian" else as_mooncake(generate(config))
    n = 0
    opener = opener_for(path)
    level = {"compresslevel": 6} if opener is gzip.open else {}
    with atomic_write(path, "wt", opener=opener, encoding="utf-8", **level) as f:
        dumps = json.JSONEncoder(separators=(",", ":")).encode
        for rec in records:
            f.write(dumps(rec))
            f.write("\n")
            n += 1
    return n

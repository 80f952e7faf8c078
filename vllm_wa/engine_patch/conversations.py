"""Conversations, as the engine sees them: from the prefix chain alone.

A request that continues a conversation carries the previous turn's prompt
as its own prefix.  When a request finishes, the hashes of its prompt's last
full blocks become *tips*; a later prompt that contains a tip continues that
turn.  Found by a bounded backward scan of the new prompt's block hashes (a
continuation's previous tip sits just before the new input), it works whether
or not the previous turn's blocks are still cached.

From the link the engine knows, with no client change: the conversation's
turn count, the *think time* (from the previous turn's finish to this
lookup), the prompt's growth since then, and, once the request finishes, the
reply's length.  A conversation is named by a content-derived key, the hash
of the first block where its first prompt left what was already cached (a
shared system prompt stays outside it), so every turn of it samples alike.

A finished prompt's tips are its last full block and, when the request
computed it itself, the full block before it: a client that rewrote the end
of its last block still continues, once.  The earlier tip is never a block
the request found cached, and serves one continuation only: it may be a
shared system prompt's last block (a first request computes it on a cold
cache, or after an eviction), which every other user's first request holds
too, and reading those as turn 2 of this conversation would give them
another user's think time.  A first prompt that found all its full blocks
cached (a system prompt and a message shorter than the rest of a block)
leaves no tip at all: its last full block is the system prompt's, so any
tip there would be taken by the next user's first request, not by its own
turn 2, which reads as a new conversation instead.  A later turn's last full
block is its conversation's own even when cached (vLLM caches the reply's
blocks too), and stays a tip.

A known mislink, kept because undoing it measured worse: a first request
that computed a shared system prompt itself (a cold cache, or after an
eviction) with a message too short to fill a block past it leaves the
system prompt's last block as its last tip, so every later first request on
that system prompt reads as its next turn (another user's think time, a
turn count that climbs) until the tip ages out.  Making a first turn's tips
serve one continuation each, and leaving no tip before a continuation's own
blocks, fixed that, and cost Mooncake's conversation trace (512-token
blocks, where such links join the requests that share a document) up to
1.57 points at 10 % (docs/results.md, "Frequency"); the tuner weighs the
features by measurement, so a mislink costs what the features it skews were
worth, and LRU stays the floor.

A tip that ages out, is pushed out of the bounded index, or whose hashes a
later prompt's tips take over, without a continuation, is counted as
censored (``counters``).

State is bounded: ``capacity`` tips (at most two per finished request), expired
after ``max_age_s``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, NamedTuple

from vllm_wa.engine_patch.events import hash_sample_value


class TurnTiming(NamedTuple):
    """A request's place in its conversation, known at its prefix lookup.

    Immutable (it rides in events to the controller's thread); a named tuple
    because one is built at every lookup, in 0.22 µs against a frozen
    dataclass's 0.55.
    """

    conversation: int  # 64-bit content-derived key
    start: int  # position of the conversation's first own block
    turn: int  # 1 for a conversation's first request
    think_s: float | None  # previous turn's finish -> this lookup; None on turn 1
    growth: float | None  # prompt blocks added since the previous turn, relative to its prompt


@dataclass(slots=True)
class _Tip:
    timing: TurnTiming
    prompt_blocks: int
    finished: float
    resolved: bool = False  # continued, or counted as censored
    held: int = 0  # hashes in the index that name it
    once: Any = None  # the earlier tip's hash: it serves one continuation


@dataclass
class ConversationCounters:
    continuations: int = 0
    new_conversations: int = 0
    censored: int = 0


class ConversationTracker:
    """Links each prompt to the turn it continues (see the module docstring).

    Args:
        capacity: tips kept (at most two per finished request).
        max_age_s: a tip older than this is dropped (counted as censored).
        max_scan: block hashes probed per lookup, from the prompt's end.
        key_of: a conversation's 64-bit key from the hash of its first own
            block (the event sink's ``sample_value``, so that chain sampling
            picks conversations as the sink picks blocks).
    """

    def __init__(
        self,
        capacity: int = 1 << 16,
        max_age_s: float = 7200.0,
        max_scan: int = 8192,
        key_of: Callable[[Any], int] = hash_sample_value,
    ) -> None:
        self.capacity = max(2, int(capacity))
        self.max_age_s = float(max_age_s)
        self.max_scan = max(1, int(max_scan))
        self.key_of = key_of
        self.tips: OrderedDict[Any, _Tip] = OrderedDict()
        self.counters = ConversationCounters()

    def lookup(self, hashes: Sequence[Any], n_hit: int, now: float) -> TurnTiming:
        """The timing of a prompt with block ``hashes``, ``n_hit`` of them cached."""
        # Tips past max_age_s are censored, not continued, even after a stretch
        # with no finish (which is where they are otherwise expired).
        self.expire(now)
        found = self.continued(hashes)
        n = len(hashes)
        if found is None:
            self.counters.new_conversations += 1
            # Its own part starts where the cache's ends; a prompt that found
            # every block cached has none (``start == n``: no tip, no chain).
            start = min(n_hit, n)
            key = self.key_of(hashes[min(start, n - 1)]) if n else 0
            return TurnTiming(key, start, 1, None, None)
        h, prev = found
        if h == prev.once:
            del self.tips[h]
            prev.held -= 1
        self.counters.continuations += 1
        think = max(0.0, now - prev.finished)
        prev.resolved = True
        p = prev.timing
        growth = (n - prev.prompt_blocks) / max(1, prev.prompt_blocks)
        return TurnTiming(p.conversation, p.start, p.turn + 1, think, growth)

    def continued(self, hashes: Sequence[Any]) -> tuple[Any, _Tip] | None:
        """The tip a prompt of block ``hashes`` continues and the hash that
        found it, None for none; reads only (``lookup`` resolves it)."""
        tips = self.tips
        if tips:
            get = tips.get
            for h in islice(reversed(hashes), self.max_scan):
                tip = get(h)
                if tip is not None:
                    return h, tip
        return None

    @staticmethod
    def tips_of(hashes: Sequence[Any], n_hit: int, full_blocks: int | None = None, own_from: int = 0) -> tuple:
        """The tips a prompt of block ``hashes`` leaves, the one-shot earlier
        tip first (see the module docstring).

        ``n_hit``: its blocks found cached; ``full_blocks``: how many of
        ``hashes`` are full blocks (a trace may list a partial last block,
        which no continuation holds; None: all are full, as in vLLM);
        ``own_from``: where its conversation's own blocks start (its lookup's
        ``TurnTiming.start``): a last full block before that is shared with
        other conversations and is no tip.
        """
        n = len(hashes) if full_blocks is None else max(0, min(len(hashes), full_blocks))
        if n == 0 or n - 1 < own_from:
            return ()
        if n >= 2 and n - 2 >= n_hit:
            return (hashes[n - 2], hashes[n - 1])
        return (hashes[n - 1],)

    def finished(self, timing: TurnTiming, tip_hashes: Sequence[Any], prompt_blocks: int, now: float) -> None:
        """A request released its blocks: ``tip_hashes`` (``tips_of`` its prompt) become tips."""
        self.expire(now)
        tip = _Tip(timing, prompt_blocks, now, once=tip_hashes[0] if len(tip_hashes) > 1 else None)
        tips = self.tips
        for h in tip_hashes:
            old = tips.get(h)
            if old is not tip:
                if old is not None:
                    self._drop(old)  # a later prompt holding the block finished: its tip now
                tip.held += 1
                tips[h] = tip
            tips.move_to_end(h)
        while len(tips) > self.capacity:
            _, old = tips.popitem(last=False)
            self._drop(old)

    def expire(self, now: float) -> None:
        """Drop tips older than ``max_age_s`` (censored at that age)."""
        tips = self.tips
        limit = now - self.max_age_s
        while tips:
            h, tip = next(iter(tips.items()))
            if tip.finished > limit:
                break
            del tips[h]
            self._drop(tip)

    def _drop(self, tip: _Tip) -> None:
        """One of ``tip``'s hashes left the index (or now names a later tip):
        censored once none is left, unless it was continued."""
        tip.held -= 1
        if tip.held > 0 or tip.resolved:
            return
        tip.resolved = True
        self.counters.censored += 1

    def __len__(self) -> int:
        return len(self.tips)

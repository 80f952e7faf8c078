"""Which request last used each block, and so which class it is freed into.

The engine hooks (and the replay drivers, through the same object) call
:meth:`BlockTagger.on_lookup` when a request's prompt is matched against the
prefix cache and :meth:`BlockTagger.on_free` just before its blocks go back
to the pool.  At the lookup the request is placed in its conversation
(:mod:`vllm_wa.engine_patch.conversations`: turn, think time, growth); at
the free every block is filed under the class computed by a replaceable
class-key function of the request (tag, outcome, timing, reply length), the
block's position in it and how often the block has been reused, and the
per-request events are emitted.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Any, Protocol

import numpy as np
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.engine_patch.conversations import ConversationTracker, TurnTiming
from vllm_wa.engine_patch.events import (
    EventKind,
    EventSink,
    FinishedEvent,
    FreedEvent,
    LookupEvent,
    OutcomeEvent,
)
from vllm_wa.engine_patch.free_queue import WorkloadAwareFreeQueue
from vllm_wa.workload_classes import DEFAULT_CLASS, OTHER_CLASS, OTHER_ID, ClassRegistry, TagCounters, normalize_tag

_block_id = attrgetter("block_id")

# Reply outcomes, known to the engine (stop, length, abort) or reported to it
# after the API server parsed the reply (tool).
OUTCOMES = ("tool", "stop", "length", "abort", "error")
# Outcomes the engine observes that no late report may change: a report
# refines how a reply ended (a tool call behind a plain stop, or a trace's
# outcome behind the length limit that ignore_eos forces), it cannot turn an
# aborted or failed request into a finished one.
ENGINE_FINAL_OUTCOMES = ("abort", "error")
# Requests whose tags are remembered until they finish (each is counted once);
# past this many unfinished requests the oldest is forgotten.
MAX_LIVE_REQUESTS = 1 << 16
# Reported blocks (about 100 bytes each) the remembered releases keep for late
# outcomes, all together; past it the oldest releases' are dropped (a late
# outcome then refiles the live queue's blocks but not the controller's view).
MAX_REPORTED_BLOCKS = 1 << 16
# Releases remembered under one request id (a client may reuse its id): past
# this many the key starts again.
MAX_RELEASES_PER_ID = 16
# Block ids (and hashes) the remembered releases keep, all together, in pool
# sizes: only a block's last release can refile it, so at most one pool's worth
# is ever useful, and prompts of any length keep the memory to this bound.
REMEMBERED_BLOCKS_PER_POOL_BLOCK = 2
# Releases are remembered for late outcomes under request ids of at most this
# many characters: vLLM bounds neither a client's X-Request-Id nor a body's
# request_id, and 4,096 remembered releases of 1-MB ids would hold 8 GB.
MAX_LATE_FACT_ID = 256


@dataclass(frozen=True, slots=True)
class RequestTags:
    """What the class key may know about a request.

    ``timing`` is filled in by the tagger from the request's lookup;
    ``outcome`` and ``reply_tokens`` are known when it finishes.
    """

    request_id: str
    tag: str = DEFAULT_CLASS
    outcome: str | None = None
    reply_tokens: int = 0
    timing: TurnTiming | None = None


class ClassKeyFunction(Protocol):
    """Class name of a block from its request, position and reuse count.

    ``uses_block_features`` False promises the result depends on the request
    only, so it is computed once per request instead of once per block.
    """

    uses_block_features: bool

    def __call__(self, request: RequestTags, position: int, reuse_count: int) -> str: ...


class TagClassKey:
    """The PR's class key: the client's tag alone."""

    uses_block_features = False

    def __call__(self, request: RequestTags, position: int, reuse_count: int) -> str:
        return request.tag


@dataclass
class _FreedRequest:
    tags: RequestTags
    serial: int
    # The freed blocks' ids, one list per KV-cache group (hybrid models have
    # several), each in prompt order (-1 for a null block, so that positions
    # stay those of the release), and the hash each held: a late outcome
    # refiles every block that still holds it.
    block_ids: list[list[int]]
    block_hashes: list[list[Any]]
    freed_at: float
    # (position, hash, reuse count) of the blocks reported in FREED events:
    # a late outcome moves their observations too (OutcomeEvent).
    reported: tuple[tuple[int, Any, int], ...]


@dataclass(slots=True)
class _Lookup:
    """A looked-up request until it frees its blocks."""

    at: float  # when its prompt was looked up
    timing: TurnTiming | None  # None without a conversation tracker
    tips: tuple  # ConversationTracker.tips_of its prompt
    prompt_blocks: int
    # Looked up again after a preemption: it held blocks until then, whether
    # or not the resume finds room (``forget``).
    resumed: bool = False


class BlockTagger:
    """Assigns classes to blocks on behalf of one :class:`WorkloadAwareFreeQueue`.

    Args:
        queue: the queue whose ``block_class`` array is written.
        blocks: all blocks of the pool, indexed by ``block_id``.
        sink: where lookup and finished events go (None: none).
        class_key: the class-key function (default: the tag alone).
        remember_finished: how many freed requests :meth:`reclassify` can reach
            (0: none, for a queue that is never told late facts, such as a
            miniature cache; its releases then skip that bookkeeping).
        conversations: the conversation tracker (None: requests get no turn
            timing, as in the miniature caches, which are told it).
        tags: the registry of workload tags for hit accounting (default: one
            with the cap and retire time of the queue's class registry).
    """

    def __init__(
        self,
        queue: WorkloadAwareFreeQueue,
        blocks: Sequence[KVCacheBlock],
        *,
        sink: EventSink | None = None,
        class_key: ClassKeyFunction | None = None,
        remember_finished: int = 4096,
        conversations: ConversationTracker | None = None,
        tags: ClassRegistry | None = None,
    ) -> None:
        # (Blocks' hashes are read as wa_block_hash: ``queue`` named the slot so.)
        self.queue = queue
        self.blocks = blocks
        self.sink = sink
        self.class_key: ClassKeyFunction = class_key if class_key is not None else TagClassKey()
        self.tag_counters = TagCounters()
        classes = queue.registry
        self.tags = tags if tags is not None else ClassRegistry(classes.max_classes, classes.retire_after_s)
        # Releases whose blocks went to ``other`` because every class slot was
        # taken, and late outcomes whose refiled blocks did.
        self.releases_over_class_cap = 0
        self.refiles_over_class_cap = 0
        # Tag of each request seen and not finished: counted once, at first sight.
        self._live_tags: OrderedDict[str, str] = OrderedDict()
        retire_s = min(classes.retire_after_s, self.tags.retire_after_s)
        self._retire_every = max(1.0, retire_s / 10.0)
        self._next_retire = -math.inf
        # When the class key last changed, and the change the last reclaim was for.
        self._key_changed_at = self._reclaimed_for = -math.inf
        n = len(queue.block_class)
        self.reuse_count = [0] * n
        # The hash a block had when its reuse count was last updated: a block
        # that was evicted and refilled starts counting again.
        self._counted_hash: list[Any] = [None] * n
        self._owner = [0] * n
        self._serial = 0
        # The remembered releases (all keys together) and the block ids they keep.
        self._remembered_releases = 0
        self._remembered_blocks = 0
        self._max_remembered_blocks = REMEMBERED_BLOCKS_PER_POOL_BLOCK * max(1, n)
        self._looked_up: dict[str, _Lookup] = {}
        # Lookups of preempted requests, restored when they are looked up again.
        self._preempted: OrderedDict[str, _Lookup] = OrderedDict()
        self.conversations = conversations
        # Freed requests by the key late facts arrive under (see request_key);
        # several engine requests (n > 1) can share one key.
        self._finished: OrderedDict[str, list[_FreedRequest]] = OrderedDict()
        # Maps an engine request id to the id late facts are reported under
        # (the API server knows its own, external id).
        self.request_key: Callable[[str], str] = str
        # Maps an engine request id to the one request (API call) it belongs
        # to: the children of an ``n > 1`` request share it, and two clients
        # that send the same id do not (see reclassify).
        self.request_group: Callable[[str], str] = str
        # Releases not remembered because their request id was over MAX_LATE_FACT_ID.
        self.long_request_ids = 0
        self.hit_blocks_by_tag = [0] * self.tags.max_classes
        # Prompt tokens looked up, per tag: every token, as vLLM's
        # prefix_cache_queries counts them (hits are whole blocks).
        self.queried_tokens_by_tag = [0] * self.tags.max_classes
        # Outcomes reported before their request released its blocks, by key,
        # with the API call that took it (None until a release does): every
        # child of that ``n > 1`` call takes it, a later call under the same id does not.
        self._pending_outcome: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._remember = max(0, int(remember_finished))
        # Remembered releases that keep reported blocks, oldest first, and how many they keep.
        self._reporting: deque[_FreedRequest] = deque()
        self._reported_blocks = 0
        self.reclassified_requests = 0

    # ---- tags ----------------------------------------------------------------------

    def request_tags(
        self, request_id: str, raw_tag: Any, outcome: str | None = None, reply_tokens: int = 0
    ) -> RequestTags:
        """Validated tags of a request (bad tags are counted, never raised).

        The first call for a request checks its tag and claims it a slot in
        the tag registry (``other`` when full), counting a missing, invalid
        or over-cap tag once; later calls, until the request finishes, reuse
        that result.
        """
        live = self._live_tags
        tag = live.get(request_id)
        if tag is None:
            counters = self.tag_counters
            tag = normalize_tag(raw_tag, counters)
            now = self.queue.clock()
            self.retire_idle(now)
            if self.tags.claim(tag, now) is None:
                counters.over_cap += 1
                tag = OTHER_CLASS
            live[request_id] = tag
            if len(live) > MAX_LIVE_REQUESTS:
                live.popitem(last=False)
        look = self._looked_up.get(request_id)
        return RequestTags(request_id, tag, outcome, reply_tokens, look.timing if look is not None else None)

    def retire_idle(self, now: float) -> None:
        """Give back the slots of tags and classes unused for their retire time (throttled)."""
        if now < self._next_retire:
            return
        self._next_retire = now + self._retire_every
        for tid in self.tags.retire_idle(now):
            self.hit_blocks_by_tag[tid] = self.queried_tokens_by_tag[tid] = 0
        self.queue.retire_idle_classes(now)

    def remember_finished(self, n: int) -> None:
        """From now on keep the last ``n`` releases for late facts (0: none)."""
        self._remember = max(0, int(n))

    def set_class_key(self, class_key: ClassKeyFunction) -> None:
        """Swap the class-key function (takes effect at the next free).

        The earlier key's classes keep their ids, and their free blocks their
        class, until they retire; if the new key's classes then find the
        registry full, the earlier key's are retired at once (see
        :meth:`_claim_after_key_change`).  Meanwhile the new parameters score
        those classes by their default model.  Re-filing the remembered
        releases' free blocks under the new key at the switch (as a late
        outcome re-files one request's) was measured and not kept: -0.04 to
        +0.08 points on the agentic split and the Mooncake trace (2026-12-05),
        for a pass over up to 180,000 blocks on the engine thread per switch.
        """
        if class_key != self.class_key:
            self._key_changed_at = self.queue.clock()
        self.class_key = class_key

    def _claim_after_key_change(self, now: float) -> bool:
        """A release found the class registry full: if the class key changed
        since the last such reclaim, retire every class unused since the
        change (the earlier key's: the tagger names only the current key's
        classes) and say so, so the release claims again.

        Without it, a key with many classes (the six request features) held
        every slot for the retire time after a switch, and the new key's
        blocks all went to ``other``, in LRU order (synthetic Bailian trace
        at 2 % of unique blocks: the real cache ran as LRU for the last
        1,050 s while the candidate's miniature cache led it by 1 to 1.6 points).
        """
        if self._key_changed_at <= self._reclaimed_for:
            return False
        self._reclaimed_for = self._key_changed_at
        return bool(self.queue.retire_idle_classes(now, unused_since=self._key_changed_at))

    # ---- hooks -----------------------------------------------------------------------

    def on_lookup(
        self,
        req: RequestTags,
        hit_blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[Any],
        now: float | None = None,
        to_key: Callable[[Any], Any] | None = None,
        extra_hits: Sequence[Sequence[KVCacheBlock]] = (),
        prompt_tokens: int = 0,
        full_blocks: int | None = None,
        cached_blocks: int | None = None,
    ) -> None:
        """A request's prompt was matched: ``hit_blocks`` is its cached prefix.

        ``prompt_tokens``: the prompt's length, for the per-tag hit accounting
        (a partial last block is looked up too, and never hit).
        ``full_blocks``: how many of ``block_hashes`` are full blocks (a
        replayed trace lists a partial last block; None: all, as in vLLM).
        ``cached_blocks``: how many of them the cache held, where vLLM's hit
        stops short of that (EAGLE drops the last matched block; a prompt of
        whole blocks recomputes its last token); the conversation tracker
        reads it, to tell a prompt's own blocks from a shared prefix's.
        None: ``len(hit_blocks)``.

        ``block_hashes`` are the prompt's block hashes; ``to_key`` maps the
        ones reported in the event to the form blocks hold (vLLM adds the
        KV-cache group id); ``extra_hits``: the hit blocks of further KV-cache
        groups (hybrid models), whose reuse counts move with the first's.

        Counted once per request until it finishes: the scheduler may look a
        waiting request up several times, and a preempted request resumes as
        the request it was (its first lookup's time and turn, nothing counted
        or reported again: its hits on its own blocks are no reuse).
        """
        rid = req.request_id
        if rid in self._looked_up:
            return
        resumed = self._preempted.pop(rid, None)
        if resumed is not None:
            resumed.resumed = True
            self._looked_up[rid] = resumed
            return
        if now is None:
            now = self.queue.clock()
        convs = self.conversations
        timing = None
        if convs is not None:
            cached = len(hit_blocks) if cached_blocks is None else cached_blocks
            timing = convs.lookup(block_hashes, cached, now)
            tips = convs.tips_of(block_hashes, cached, full_blocks, timing.start)
            self._looked_up[rid] = _Lookup(now, timing, tips, len(block_hashes))
        else:
            self._looked_up[rid] = _Lookup(now, None, (), len(block_hashes))
        if len(self._looked_up) > MAX_LIVE_REQUESTS:
            # A request whose free never reached the tagger (a hook failed)
            # would stay forever: the oldest lookup goes (its release, if it
            # comes, is filed without one).
            del self._looked_up[next(iter(self._looked_up))]
        self.count_reuse(hit_blocks, now, free_hits=True)
        for group in extra_hits:
            self.count_reuse(group, now)
        # Hit accounting is per workload tag (the outcome is not known yet).
        tag_id = self.tags.id_of(req.tag, now)
        self.hit_blocks_by_tag[tag_id] += len(hit_blocks)
        self.queried_tokens_by_tag[tag_id] += prompt_tokens
        sink = self.sink
        if sink is None:
            return
        hashes, real_hits = self._sampled_hashes(hit_blocks, block_hashes)
        chain: tuple = ()
        if timing is not None and sink.chain_sampled(timing.conversation):
            chain = tuple(block_hashes[timing.start :])
        if to_key is not None:
            hashes = tuple(map(to_key, hashes))
            chain = tuple(map(to_key, chain))
        sink.emit(LookupEvent(EventKind.LOOKUP, now, rid, req.tag, hashes, chain, real_hits))

    def _sampled_hashes(self, hit_blocks: Sequence[KVCacheBlock], block_hashes: Sequence[Any]) -> tuple[tuple, int]:
        """The sampled prompt blocks' hashes, and how many of them (the first)
        are in the cached prefix: that prefix by its blocks' flags (set once
        per hash a block holds), the rest by hashing."""
        if block_hashes and type(block_hashes[0]) is int:
            # Trace ids: the whole prompt in one numpy pass (a hit block holds
            # its prompt position's id, so its flag would say the same).
            # The prefix and the rest apart: one pass over the prompt in all.
            k = len(hit_blocks)
            head = self.sink.sampled_from(block_hashes[:k], 0) if k else []
            return tuple(head + self.sink.sampled_from(block_hashes, k)), len(head)
        sampled, flagged = self.queue.sampled, self.queue.sampled_hash
        is_sampled = self.sink.is_sampled
        out = []
        for i, b in enumerate(hit_blocks):
            h = b.wa_block_hash
            bid = b.block_id
            if flagged[bid] is not h:
                flagged[bid] = h
                sampled[bid] = h is not None and is_sampled(h)
            if sampled[bid]:
                out.append(block_hashes[i])
        hits = len(out)
        out += self.sink.sampled_from(block_hashes, len(hit_blocks))
        return tuple(out), hits

    def count_reuse(self, hit_blocks: Sequence[KVCacheBlock], at: float, *, free_hits: bool = False) -> None:
        """One more prefix hit, looked up at ``at``, on each of ``hit_blocks``;
        with ``free_hits``, also count per class the hits on blocks that sat in
        the free list.

        A hit dates the block's last use as :meth:`file_blocks` does at the
        release, so a hit block freed before the request's release without a
        hook (one that leaves a sliding window) is stamped by this lookup,
        not by its previous user's.
        """
        counts, counted = self.reuse_count, self._counted_hash
        cls_of, reused = self.queue.block_class, self.queue.counters.reused
        lookup_time = self.queue.lookup_time
        num_classes = len(reused)
        for b in hit_blocks:
            bid = b.block_id
            h = b.wa_block_hash
            if counted[bid] != h:
                counted[bid] = h
                counts[bid] = 0
            counts[bid] += 1
            if lookup_time[bid] < at:  # noqa: PLR1730 - no call per block
                lookup_time[bid] = at
            if free_hits and b.ref_cnt == 0 and b.next_free_block is not None:
                c = cls_of[bid]
                if c < num_classes:
                    reused[c] += 1

    def started_at(self, request_id: str) -> float | None:
        """When a request that holds blocks was looked up (None: not known)."""
        look = self._looked_up.get(request_id)
        return look.at if look is not None else None

    def on_free(
        self,
        req: RequestTags,
        blocks: Sequence[KVCacheBlock],
        now: float | None = None,
        *,
        finished: bool = True,
        extra_groups: Sequence[Sequence[KVCacheBlock]] = (),
    ) -> None:
        """``blocks`` (in allocation order) are about to be released by ``req``.

        ``finished`` is False for a preempted request: it will be looked up
        again and keeps its (counted) tag and its lookup.  ``extra_groups``:
        the blocks of further KV-cache groups (hybrid models).  They take the
        same classes and move with a late outcome, but report no FREED
        events: lookups report only the hashes of the group in ``blocks``
        (the engine hooks pass the first full-attention group), so another
        group's block would never be seen reused, and its events would be
        censored observations that pull every class's reuse model down.
        """
        rid = req.request_id
        look = self._looked_up.pop(rid, None)
        if finished:
            self._live_tags.pop(rid, None)
        elif look is not None:
            self._preempted[rid] = look
            if len(self._preempted) > MAX_LIVE_REQUESTS:
                self._preempted.popitem(last=False)
        if now is None:
            now = self.queue.clock()
        key = self.request_key(rid)
        pending = self._take_pending(key, rid) if finished else None
        if pending is not None and pending != req.outcome and req.outcome not in ENGINE_FINAL_OUTCOMES:
            # A reported fact (the reply called a tool) beats the engine's own
            # stop or length (such replies end with a plain stop).
            req = replace(req, outcome=pending)
            self.reclassified_requests += 1
        if look is not None and look.timing is not None and req.timing is None:
            req = replace(req, timing=look.timing)
        started = look.at if look is not None else None
        reported, over_cap = self.file_blocks(req, blocks, now, started, report=True)
        for group in extra_groups:
            over_cap |= self.file_blocks(req, group, now, started, report=False)[1]
        if over_cap:  # once per release, however many KV-cache groups it holds
            self.releases_over_class_cap += 1
        if not finished:
            # Preempted: the request goes on. A late outcome waits for its real
            # release, and consumers (the miniature caches) still hold it.
            return
        if self._remember:
            if len(key) <= MAX_LATE_FACT_ID:
                self._remember_freed(key, req, [blocks, *extra_groups], now, reported)
            else:
                self.long_request_ids += 1
        self._finish_turn(look, now)
        if self.sink is not None:
            self.sink.emit(FinishedEvent(EventKind.FINISHED, now, rid, req))

    def _finish_turn(self, look: _Lookup | None, now: float) -> None:
        """A looked-up request's prompt was in the cache: its last blocks become its conversation's tips."""
        if look is not None and look.timing is not None and self.conversations is not None:
            self.conversations.finished(look.timing, look.tips, look.prompt_blocks, now)

    def _remember_freed(
        self, key: str, req: RequestTags, groups: Sequence[Sequence[KVCacheBlock]], now: float, reported: tuple
    ) -> None:
        """Keep which blocks ``req`` freed in each KV-cache group (and reported), so a late outcome can refile them."""
        self._serial += 1
        serial = self._serial
        owner = self._owner
        ids = [[-1 if b.is_null else b.block_id for b in blocks] for blocks in groups]
        for group in ids:
            for bid in group:
                if bid >= 0:
                    owner[bid] = serial
        hashes = [[b.wa_block_hash for b in blocks] for blocks in groups]
        recs = self._finished.get(key)
        if recs is None or len(recs) >= MAX_RELEASES_PER_ID:
            if recs:
                self._forget(recs)
            recs = self._finished[key] = []
        rec = _FreedRequest(req, serial, ids, hashes, now, reported)
        recs.append(rec)
        self._remembered_releases += 1
        self._remembered_blocks += sum(len(group) for group in ids)
        self._finished.move_to_end(key)
        # Bounded by releases (not ids: a client cycling its ids would keep
        # MAX_RELEASES_PER_ID times as many) and by blocks (a release keeps
        # every block of its prompt): the oldest releases go first.
        finished = self._finished
        while self._remembered_releases > self._remember or self._remembered_blocks > self._max_remembered_blocks:
            oldest = next(iter(finished))
            old = finished[oldest]
            if old[0] is rec:
                break  # the release just made stays (it fits: one pool at most)
            self._forget([old.pop(0)])
            if not old:
                del finished[oldest]
        reporting = self._reporting
        if reported:
            reporting.append(rec)
            self._reported_blocks += len(reported)
        while reporting and (self._reported_blocks > MAX_REPORTED_BLOCKS or not reporting[0].reported):
            old = reporting.popleft()
            self._reported_blocks -= len(old.reported)
            old.reported = ()

    def _forget(self, recs: list[_FreedRequest]) -> None:
        """Drop releases no late fact can reach any more: their blocks and
        their share of the reported ones (they leave ``_reporting`` when they
        reach its head)."""
        for rec in recs:
            self._reported_blocks -= len(rec.reported)
            self._remembered_releases -= 1
            self._remembered_blocks -= sum(len(group) for group in rec.block_ids)
            rec.reported = ()
            rec.block_ids = rec.block_hashes = []

    def file_blocks(
        self,
        req: RequestTags,
        blocks: Sequence[KVCacheBlock],
        now: float | None,
        started: float | None,
        *,
        report: bool,
    ) -> tuple[tuple[tuple[int, Any, int], ...], bool]:
        """Write the class (and sampling flag) each block is freed into.

        ``started``: when the releasing request was looked up (default:
        ``now``); a queue that stamps at the lookup stamps each block with
        the latest such start of the requests that held it.  Returns the
        ``(position, hash, reuse count)`` of the blocks reported in FREED
        events when late facts can reach this tagger (else ``()``), and
        whether a block went to ``other`` (the registry full; the caller
        counts that once per release, whatever its KV-cache groups).  With
        ``report`` False (a hybrid model's further KV-cache groups) the
        blocks make no events: no FREED now and, under hash sampling, no EVICTED later.
        """
        queue = self.queue
        sink = self.sink
        key = self.class_key
        now = queue.clock() if now is None else now
        # The latest start among the block's users: a prefix that a later
        # request shared is as recent as that request's lookup, whichever of
        # them releases it last.  Written whatever the queue stamps by now: a
        # deferred free (vLLM's ``pop_blocks_for_free``) appends the blocks
        # later, after a swap may have turned lookup stamps on.
        at = now if started is None else started
        lookup_time = queue.lookup_time
        for b in blocks:
            if lookup_time[b.block_id] < at:  # noqa: PLR1730 - no call per block
                lookup_time[b.block_id] = at
        self.retire_idle(now)
        over_cap = self._mark_classes(key, req, blocks, now)
        if over_cap and self._claim_after_key_change(now):
            over_cap = self._mark_classes(key, req, blocks, now)
        if sink is None:
            return (), over_cap
        if not report:
            sampled, flagged = queue.sampled, queue.sampled_hash
            for b in blocks:
                # Flagged as not sampled under the hash it holds, until it holds another.
                flagged[b.block_id] = b.wa_block_hash
                sampled[b.block_id] = 0
            return (), over_cap
        return self._emit_freed(req, blocks, now, [] if self._remember else None), over_cap

    def _mark_classes(self, key: ClassKeyFunction, req: RequestTags, blocks: Sequence[KVCacheBlock], now: float) -> bool:
        """Mark each released block with its class id; True when one went to ``other`` (registry full)."""
        queue = self.queue
        cls_of = queue.block_class
        claim = queue.registry.claim
        counts, counted = self.reuse_count, self._counted_hash
        over_cap = False
        if not key.uses_block_features:
            cid = claim(key(req, 0, 0), now)
            if cid is None:
                cid, over_cap = OTHER_ID, True
            for b in blocks:
                cls_of[b.block_id] = cid
        else:
            for pos, b in enumerate(blocks):
                bid = b.block_id
                h = b.wa_block_hash
                if counted[bid] != h:
                    counted[bid] = h
                    counts[bid] = 0
                cid = claim(key(req, pos, counts[bid]), now)
                if cid is None:
                    cid, over_cap = OTHER_ID, True
                cls_of[bid] = cid
        return over_cap

    def _emit_freed(
        self, req: RequestTags, blocks: Sequence[KVCacheBlock], now: float, reported: list | None
    ) -> tuple[tuple[int, Any, int], ...]:
        """A FREED event for each sampled block this release puts on the free list.

        Blocks that hold a new hash get their sampling flag on the way (one
        pass over the release: it runs for every block the engine frees); a
        replay's trace ids are sampled for the whole release in one call.
        ``reported`` (None: not kept) collects what the events said of each block.
        """
        sink = self.sink
        sampled, flagged = self.queue.sampled, self.queue.sampled_hash
        all_ = sink.samples_all
        is_sampled = sink.is_sampled
        counts, counted = self.reuse_count, self._counted_hash
        if not all_ and blocks and type(blocks[0].wa_block_hash) is int:
            mask = sink.sampled_ids([b.wa_block_hash for b in blocks])
            if mask is not None:
                # Trace ids: every flag at once, then only the sampled blocks
                # (each with the hash its flag is for, as the eviction checks).
                ids = np.fromiter(map(_block_id, blocks), dtype=np.intp, count=len(blocks))
                np.frombuffer(sampled, dtype=np.uint8)[ids] = mask
                for pos in np.flatnonzero(mask).tolist():
                    b = blocks[pos]
                    h, bid = b.wa_block_hash, b.block_id
                    flagged[bid] = h
                    if b.ref_cnt == 1:
                        reuse = counts[bid] if counted[bid] == h else 0
                        sink.emit(FreedEvent(EventKind.FREED, now, h, req, pos, reuse))
                        if reported is not None:
                            reported.append((pos, h, reuse))
                return tuple(reported) if reported else ()
        for pos, b in enumerate(blocks):
            h = b.wa_block_hash
            bid = b.block_id
            if flagged[bid] is not h:  # with every block sampled too: the eviction checks the hash
                flagged[bid] = h
                sampled[bid] = h is not None and (all_ or is_sampled(h))
            if h is not None and b.ref_cnt == 1 and sampled[bid]:
                reuse = counts[bid] if counted[bid] == h else 0
                sink.emit(FreedEvent(EventKind.FREED, now, h, req, pos, reuse))
                if reported is not None:
                    reported.append((pos, h, reuse))
        return tuple(reported) if reported else ()

    # ---- late facts --------------------------------------------------------------------

    def _take_pending(self, key: str, request_id: str) -> str | None:
        """The outcome reported under ``key`` before this release, if it is this call's.

        The first release takes it for its API call (:attr:`request_group`);
        the other children of an ``n > 1`` call find it there, and a release
        of another call under the same id drops it.  The entries stay bounded
        by the number of remembered releases (:meth:`reclassify`).
        """
        entry = self._pending_outcome.get(key)
        if entry is None:
            return None
        outcome, call = entry
        group = self.request_group(request_id)
        if call is None:
            self._pending_outcome[key] = (outcome, group)
            return outcome
        if call == group:
            return outcome
        del self._pending_outcome[key]
        return None

    def expect_outcome(self, request_id: str, outcome: str) -> None:
        """A fact about the reply of the next call released under ``request_id``.

        For a fact sent before its request (a benchmark outcome hint): kept
        and applied at that release (:meth:`_take_pending`), never to a
        release already made under the same id, whose blocks may be another
        client's (an id reused).  At most as many pending facts are kept as
        releases are remembered, the oldest dropped first.
        """
        if len(request_id) > MAX_LATE_FACT_ID:
            return
        self._pending_outcome[request_id] = (outcome, None)
        self._pending_outcome.move_to_end(request_id)
        while len(self._pending_outcome) > self._remember:
            self._pending_outcome.popitem(last=False)

    def reclassify(self, request_id: str, outcome: str, *, pending: bool = True) -> int:
        """Record a late fact about a request's reply and refile its free blocks.

        ``request_id`` is the key of :attr:`request_key` (the external id when
        the API server reports).  If the request has not released its blocks
        yet, the outcome is kept and applied when it does (unless ``pending``
        is False).  It replaces the engine's own ``stop`` or ``length``, never
        an ``abort`` or ``error`` (:data:`ENGINE_FINAL_OUTCOMES`).  A released
        request's change reaches the consumers as an OUTCOME event, since its
        FREED and FINISHED events carried the outcome it had then.  Returns
        the number of blocks moved.
        """
        if len(request_id) > MAX_LATE_FACT_ID:
            return 0  # no release is remembered under such an id (on_free)
        recs = self._finished.get(request_id)
        if recs is None:
            if pending:
                self.expect_outcome(request_id, outcome)
            return 0
        # The fact is about the request released last under this id: its
        # reply has just ended.  Earlier releases under the same id from other
        # requests (clients that reuse an id) keep their outcome; the children
        # of one n > 1 request share the group and move together.
        group = self.request_group
        latest = group(recs[-1].tags.request_id)
        # A fact it already carries changes nothing (the same report twice, or the engine's own outcome).
        moved, over_cap = 0, False
        for rec in recs:
            if (
                group(rec.tags.request_id) == latest
                and rec.tags.outcome not in ENGINE_FINAL_OUTCOMES
                and rec.tags.outcome != outcome
            ):
                n, over = self._reclassify(rec, outcome)
                moved += n
                over_cap |= over
        if over_cap:  # once per report, however many children of an n > 1 request it moved
            self.refiles_over_class_cap += 1
        return moved

    def _reclassify(self, rec: _FreedRequest, outcome: str) -> tuple[int, bool]:
        """Refile one remembered release; returns the blocks moved and whether one went to ``other``."""
        req = replace(rec.tags, outcome=outcome)
        rec.tags = req
        self.reclassified_requests += 1
        queue = self.queue
        if self.sink is not None:
            self.sink.emit(OutcomeEvent(EventKind.OUTCOME, queue.clock(), req, rec.freed_at, rec.reported))
        owner = self._owner
        blocks = self.blocks
        key = self.class_key
        now = queue.clock()
        by_class: dict[int, list[KVCacheBlock]] = {}
        over_cap = False
        for ids, hashes in zip(rec.block_ids, rec.block_hashes):
            for pos, (bid, h) in enumerate(zip(ids, hashes)):
                if bid < 0 or owner[bid] != rec.serial:
                    continue
                b = blocks[bid]
                if b.wa_block_hash != h:
                    # Evicted since, and reused where no remembered release
                    # saw it (a sliding-window group frees blocks mid-request).
                    continue
                cid = self._refile_class(key(req, pos, self.reuse_count[bid]), now)
                if cid is None:
                    cid, over_cap = OTHER_ID, True
                if b.next_free_block is None:
                    # Still held (a deferred free): it is filed at its release.
                    queue.block_class[bid] = cid
                else:
                    by_class.setdefault(cid, []).append(b)
        moved = 0
        for cid, bs in by_class.items():
            # Refile in free order (oldest first) so scans from the tail stay short.
            bs.sort(key=lambda b: queue.stamp[b.block_id])
            moved += queue.refile(bs, cid)
        return moved, over_cap

    def _refile_class(self, name: str, now: float) -> int | None:
        """The id of a refiled block's class; None when the registry is full,
        after giving back the earlier key's classes if the key changed (as a
        release does: :meth:`_claim_after_key_change`)."""
        claim = self.queue.registry.claim
        cid = claim(name, now)
        if cid is None and self._claim_after_key_change(now):
            cid = claim(name, now)
        return cid

    def forget(self, request_id: str, now: float | None = None) -> None:
        """A request left without holding blocks (it did not fit, or was aborted
        while waiting): drop its lookup and tell consumers it is finished.

        One preempted before it was aborted did hold blocks (it released them
        at its preemption, filed under its tag): it finishes as filed there,
        not as one that held none, so the real-cache check keeps its hits,
        and its prompt's tips stay, whether or not the scheduler looked it up
        again to resume it.
        """
        tag = self._live_tags.pop(request_id, None)
        preempted = self._preempted.pop(request_id, None)
        look = self._looked_up.pop(request_id, None)
        if look is not None and look.resumed:
            preempted = look  # looked up again to resume, and aborted before it found room
        if look is None and preempted is None:
            return
        t = self.queue.clock() if now is None else now
        self._finish_turn(preempted, t)  # a preempted one's prompt was in the cache
        sink = self.sink
        if sink is not None:
            held = None if preempted is None or tag is None else RequestTags(request_id, tag, timing=preempted.timing)
            sink.emit(FinishedEvent(EventKind.FINISHED, t, request_id, held))

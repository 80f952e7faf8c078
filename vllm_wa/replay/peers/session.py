"""``session``: vLLM's Session-Aware Eviction (SAE) policy.

Source: https://github.com/vllm-project/vllm/pull/50422 ("[kv_offload] Session
Aware Eviction Policy"), ``vllm/v1/kv_offload/cpu/policies/sae.py``
(``SAECachePolicy``, read at commit 26f9d5960b8dc1d3d83350085a5d5bfb017c0031).
Blocks stored by a request form a *session*; eviction walks sessions worst
score first and takes each one's idle blocks from its tail, so a
conversation's prefix outlives its suffix.

What it reproduces, call by call, as the offloading connector drives it:

* lookup (``record_lookup``): a request whose lookup finds a resident block
  remembers that block's session (the deepest hit's) as its merge target,
  when the request continues that session (see below);
* ``touch`` (all the prompt's keys, at every lookup and again right after
  each store the connector makes for the request, as vLLM's offloading
  scheduler of that time does in ``get_num_new_matched_tokens`` and
  ``_get_reqs_to_store``; vllm-project/vllm#45405 has the maintainers on
  these repeated touches): the logical clock ticks;
  each key's ghost score grows by ``weight / log2(position + 2)`` (12 for a
  resident key, 1 for a miss); every session owning a touched resident key
  gets ``hits += 1`` and ``last_touch = now``; every 500 touches session hits
  and ghost scores decay by 0.9 and non-resident ghost scores under 0.01 are
  dropped;
* store (``open_session``/``insert``): the request's new blocks join its merge
  target (a continuation) or a fresh session with ``prefix_depth`` = the
  number of hit blocks, whose ``hits`` start from the new keys' ghost scores
  divided by 12;
* admission gate (``evict``): when the store needs an eviction and is not a
  continuation, it is declined unless ``logical_time + bonus(prefix_depth)``
  reaches the worst session's score;
* score: ``last_touch + 1500 * hits + 30000 / (1 + prefix_depth / 8)``.

GPU-side translation: a block is "stored" when its request is admitted and
"evictable" while free; the store's touch follows (its new blocks are not
ready yet: misses for the ghost scores).  The source's lookups are the CPU
tier's: they start after the prefix the GPU still caches
(``OffloadingConnectorScheduler.get_num_new_matched_tokens``), so a prefix
every conversation shares (a system prompt), hot on the GPU, never names a
merge target there; the source's own comment on ``record_lookup`` says why
it must not (it would collapse many logical sessions into one).  Here every
lookup sees the whole prompt, so a hit names its session as the merge
target only when the request hit every block that session still holds: a
next turn extends its conversation's stored prompt, while a request that
shares only a prefix with it opens a session of its own, of that prefix's
depth. The replay caches no reply blocks,
so the touches the connector sends as each decoded block is stored are not
made. A store the gate declines cannot be refused here (the
prompt must be computed), so its blocks join no session and are reused first,
least recently freed first. Sessions come from lookups, not from a client's
conversation id: no client hints. Ghost-score decay is applied lazily (same
values and same pruning, without a sweep over every key). Knobs: none (the
source's constants).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from vllm_wa.replay.peers.base import PeerQueue, RequestHints, ResidentKeys

PREFIX_DEPTH_BONUS_SCALE = 30000.0
PREFIX_DEPTH_HALF_LIFE = 8.0
TOUCH_WEIGHT = 1500.0
GHOST_PRUNE_THRESHOLD = 0.01
_POS_WEIGHTS = [1.0 / math.log2(i + 2.0) for i in range(1024)]


def _position_weights(n: int) -> list[float]:
    """``1 / log2(position + 2)`` for positions below ``n`` (the source's table, grown on demand)."""
    if n > len(_POS_WEIGHTS):
        _POS_WEIGHTS.extend(1.0 / math.log2(i + 2.0) for i in range(len(_POS_WEIGHTS), n))
    return _POS_WEIGHTS


@dataclass
class Session:
    """Blocks stored together (in order) and their access statistics."""

    hits: float
    last_touch: int
    prefix_depth: int
    # Evictable blocks, newest stored first, as ``-(store sequence << id_bits | block id)``;
    # entries of blocks pinned or gone since are skipped when popped.
    free_heap: list[int] = field(default_factory=list)
    live: int = 0  # blocks still in this session
    free: int = 0  # of which evictable

    def score(self) -> float:
        return (
            self.last_touch
            + self.hits * TOUCH_WEIGHT
            + PREFIX_DEPTH_BONUS_SCALE / (1.0 + self.prefix_depth / PREFIX_DEPTH_HALF_LIFE)
        )


class GhostScores:
    """Per-key popularity with SAE's periodic decay and pruning, applied lazily.

    The source multiplies every score by ``factor`` each tick and drops
    non-resident scores under the threshold. Here a score is kept as
    ``[value, tick written, tick evicted]`` and decayed when read; it reads as
    pruned (zero) if, at some tick since it was written, it was both
    non-resident and under the threshold: the key became non-resident when
    evicted and stayed so (a key is touched, which reads it, before it is
    stored again).
    """

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.tick = 0
        self.entries: dict[Any, list] = {}

    def read(self, key: Any, resident: bool) -> float:
        e = self.entries.get(key)
        if e is None:
            return 0.0
        v, written, evicted = e
        m = self.tick - written
        if m <= 0:
            return v
        if not resident:
            first = max(written, evicted) + 1  # first non-resident tick since written
            if first <= self.tick and v * self.factor**m < GHOST_PRUNE_THRESHOLD:
                # Under the threshold by now; was it already, at a non-resident tick?
                if max(written + self._ticks_until_below(v), first) <= self.tick:
                    del self.entries[key]
                    return 0.0
        return v * self.factor**m

    def _ticks_until_below(self, v: float) -> int:
        m, f = 1, self.factor
        x = v * f
        while x >= GHOST_PRUNE_THRESHOLD:
            x *= f
            m += 1
        return m

    def add(self, key: Any, resident: bool, amount: float) -> None:
        v = self.read(key, resident) + amount
        e = self.entries.get(key)
        if e is None:
            self.entries[key] = [v, self.tick, -1]
        else:
            e[0], e[1] = v, self.tick

    def evicted(self, key: Any) -> None:
        e = self.entries.get(key)
        if e is not None:
            e[2] = self.tick

    def __len__(self) -> int:
        return len(self.entries)


class SessionQueue(PeerQueue):
    """SAE over cached blocks.

    Args:
        blocks: the free blocks.
        num_block_ids: size of the per-block arrays.
        decay_interval, decay_factor, ghost_hit_weight, ghost_miss_weight,
            ghost_norm: the source's tunables, with its defaults.
    """

    def __init__(
        self,
        blocks: list[KVCacheBlock],
        num_block_ids: int | None = None,
        *,
        decay_interval: int = 500,
        decay_factor: float = 0.9,
        ghost_hit_weight: float = 12.0,
        ghost_miss_weight: float = 1.0,
        ghost_norm: float = 12.0,
    ) -> None:
        if decay_interval < 1 or not 0.0 < decay_factor <= 1.0 or ghost_norm <= 0:
            raise ValueError("session: decay_interval >= 1, 0 < decay_factor <= 1 and ghost_norm > 0 are required")
        self.decay_interval = decay_interval
        self.ghost_hit_weight = ghost_hit_weight
        self.ghost_miss_weight = ghost_miss_weight
        self.ghost_norm = ghost_norm
        self._hit_amount: list[float] = []
        self._miss_amount: list[float] = []
        self.ghost = GhostScores(decay_factor)
        self.resident = ResidentKeys()
        self.sessions: dict[int, Session] = {}
        self.logical_time = 0
        self.touches = 0
        self._next_session = 0
        self._merge_target: int | None = None
        self._evicted_this_request = False
        # The admission gate, as the source evaluates it: before this
        # request's first eviction, on its hits (None: not evaluated, for a
        # request that evicted nothing or continues a session).
        self._admits_new_session: bool | None = None
        self._lookup_hits = 0
        # Blocks of declined stores: no session, reused first, LRU among them.
        self._sessionless = FreeKVCacheBlockQueue([])
        n = max((b.block_id for b in blocks), default=-1) + 1 if num_block_ids is None else num_block_ids
        self.session_of = [-1] * n
        self.stored_seq = [0] * n  # order of storing, newest last
        self._seq = 0
        self.id_bits = max(1, n.bit_length())
        super().__init__(blocks, num_block_ids)

    # ---- lookup and touch -----------------------------------------------------------------

    def on_lookup(
        self, req: RequestHints, hit_blocks: Sequence[KVCacheBlock], hashes: Sequence[Any], now: float,
        full_blocks: int | None = None,
    ) -> None:
        session_of = self.session_of
        # record_lookup: the last resident hit names the merge target, if
        # the request continues its session (it hit all the session holds).
        self._merge_target = None
        if hit_blocks:
            sid = session_of[hit_blocks[-1].block_id]
            s = self.sessions.get(sid) if sid >= 0 else None
            if s is not None and s.live == sum(1 for b in hit_blocks if session_of[b.block_id] == sid):
                self._merge_target = sid
        self._evicted_this_request = False
        self._admits_new_session = None
        self._lookup_hits = len(hit_blocks)
        self._touch(hashes, hit_blocks)

    def _touch(
        self, hashes: Sequence[Any], hit_blocks: Sequence[KVCacheBlock], stored: Sequence[KVCacheBlock] = ()
    ) -> None:
        """The source's ``touch`` over a request's keys; ``stored``: its blocks not yet ready."""
        session_of, sessions = self.session_of, self.sessions
        self.logical_time += 1
        primary, ghost = self.resident.primary, self.ghost
        n, n_hit = len(hashes), len(hit_blocks)
        hit_amount, miss_amount = self._amounts(n)
        # Resident block of each key: the hit prefix's blocks are the ones
        # lookups find; past it, whichever block holds the key (or None).
        bids = [b.block_id for b in hit_blocks]
        bids.extend(map(primary.get, hashes[n_hit:]))
        touched = set(map(session_of.__getitem__, [b for b in bids if b is not None]))
        touched.discard(-1)
        # Each key's ghost score grows by its position's weight, times the hit
        # weight when resident and ready (the hit prefix always is).
        amounts = hit_amount[:n_hit]
        if n > n_hit:
            not_ready = {b.block_id for b in stored}
            amounts += [
                m if bid is None or bid in not_ready else h
                for bid, h, m in zip(bids[n_hit:], hit_amount[n_hit:n], miss_amount[n_hit:n])
            ]
        # Fast paths of GhostScores.add where there is nothing to decay.
        entries, tick, get, add = ghost.entries, ghost.tick, ghost.entries.get, ghost.add
        for key, amount, bid in zip(hashes, amounts, bids):
            e = get(key)
            if e is None:
                entries[key] = [amount, tick, -1]
            elif e[1] == tick:
                e[0] += amount
            else:
                add(key, bid is not None, amount)
        t = self.logical_time
        for sid in touched:
            s = sessions[sid]
            s.hits += 1
            s.last_touch = t
        self.touches += 1
        if self.touches % self.decay_interval == 0:
            f = ghost.factor
            for s in sessions.values():
                s.hits *= f
            ghost.tick += 1

    def _amounts(self, n: int) -> tuple[list[float], list[float]]:
        """Ghost-score increments by position for a resident (hit) and a missing key."""
        k = len(self._hit_amount)
        if n > k:  # grown like _position_weights: only the new positions
            weights = _position_weights(n)[k:n]
            self._hit_amount += [w * self.ghost_hit_weight for w in weights]
            self._miss_amount += [w * self.ghost_miss_weight for w in weights]
        return self._hit_amount, self._miss_amount

    def forget(self, request_id: str, now: float) -> None:
        self._merge_target = None

    # ---- store ------------------------------------------------------------------------------

    def _admission_allows_new_session(self, prefix_depth: int) -> bool:
        if not self.sessions:
            return True
        baseline = self.logical_time + PREFIX_DEPTH_BONUS_SCALE / (1.0 + prefix_depth / PREFIX_DEPTH_HALF_LIFE)
        return baseline >= min(s.score() for s in self.sessions.values())

    def on_admitted(self, req: RequestHints, blocks: Sequence[KVCacheBlock], n_hit: int, now: float) -> None:
        hashes, key_of, resident = req.hashes, self.key_of, self.resident
        setdefault = resident.primary.setdefault
        for b, key in zip(blocks[n_hit:], hashes[n_hit:]):
            bid = b.block_id
            key_of[bid] = key
            if setdefault(key, bid) != bid:
                resident.add(key, bid)  # a second block holding the key (rare)
        target = self._merge_target
        self._merge_target = None
        if n_hit == len(blocks):
            return
        if target is not None and target not in self.sessions:
            target = None
        if target is None and self._admits_new_session is False:
            return  # declined: the new blocks join no session
        if target is not None:
            s = self.sessions[target]
            s.last_touch = self.logical_time
            sid = target
        else:
            sid = self._next_session
            self._next_session += 1
            s = self.sessions[sid] = Session(hits=0.0, last_touch=self.logical_time, prefix_depth=n_hit)
            ghost, norm = self.ghost, self.ghost_norm
            for j in range(n_hit, len(blocks)):
                s.hits += ghost.read(hashes[j], True) / norm
        session_of, stored_seq, seq = self.session_of, self.stored_seq, self._seq
        for j in range(n_hit, len(blocks)):
            bid = blocks[j].block_id
            session_of[bid] = sid
            seq += 1
            stored_seq[bid] = seq
        self._seq = seq
        s.live += len(blocks) - n_hit
        # The connector touches all the request's keys again right after a
        # store it accepted: the new blocks are not ready yet (a miss for
        # their ghost scores) but their session, fresh or merged, is touched.
        self._touch(hashes, blocks[:n_hit], blocks[n_hit:])

    # ---- queue ------------------------------------------------------------------------------

    def _free_cached(self, blocks: list[KVCacheBlock]) -> None:
        session_of, sessions, stored_seq, shift = self.session_of, self.sessions, self.stored_seq, self.id_bits
        loose = []
        for b in blocks:
            bid = b.block_id
            sid = session_of[bid]
            if sid >= 0:
                s = sessions[sid]
                s.free += 1
                heapq.heappush(s.free_heap, -((stored_seq[bid] << shift) | bid))
                if len(s.free_heap) > 2 * s.live + 256:  # stale entries: at most `live` stay
                    self._compact(sid, s)
            else:
                loose.append(b)
        if loose:
            self._sessionless.append_n(loose)

    def _unfree_cached(self, block: KVCacheBlock) -> None:
        sid = self.session_of[block.block_id]
        if sid >= 0:
            self.sessions[sid].free -= 1
        else:
            self._sessionless.remove(block)

    def _unfree_cached_n(self, blocks: list[KVCacheBlock]) -> None:
        # A prompt's hits come from few sessions: count them per session.
        session_of = self.session_of
        counts = Counter(session_of[b.block_id] for b in blocks)
        loose = counts.pop(-1, 0)
        for sid, k in counts.items():
            self.sessions[sid].free -= k
        if loose:
            for b in blocks:
                if session_of[b.block_id] < 0:
                    self._sessionless.remove(b)

    def _forget_keys(self, victims: list[KVCacheBlock]) -> None:
        """The victims are no longer cached: their keys leave the index, ghosts note it."""
        key_of, resident, entries, tick = self.key_of, self.resident, self.ghost.entries, self.ghost.tick
        primary, others = resident.primary, resident._others
        for b in victims:
            bid = b.block_id
            key = key_of[bid]
            key_of[bid] = None
            if others and key in others:
                if not resident.discard(key, bid):
                    continue
            else:
                del primary[key]
            e = entries.get(key)
            if e is not None:
                e[2] = tick

    def _evict(self, n: int) -> list[KVCacheBlock]:
        if not self._evicted_this_request and self._merge_target is None:
            # SAECachePolicy.evict declines a new session before it collects
            # victims: against the sessions as they stand, the worst included
            # (a continuation is never declined).
            self._admits_new_session = self._admission_allows_new_session(self._lookup_hits)
        self._evicted_this_request = True
        out: list[KVCacheBlock] = []
        loose = self._sessionless
        if loose.num_free_blocks:
            out = loose.popleft_n(min(n, loose.num_free_blocks))
        if len(out) < n:
            sessions = self.sessions
            candidates = [item for item in sessions.items() if item[1].free > 0]
            candidates.sort(key=lambda item: item[1].score())
            is_free, session_of, stored_seq, block = self.is_free, self.session_of, self.stored_seq, self.block
            heappop = heapq.heappop
            shift = self.id_bits
            mask = (1 << shift) - 1
            for sid, s in candidates:
                heap = s.free_heap
                taken = 0
                want = min(n - len(out), s.free)
                while taken < want:
                    e = -heappop(heap)
                    bid = e & mask
                    if session_of[bid] != sid or stored_seq[bid] != e >> shift or not is_free[bid]:
                        continue
                    out.append(block[bid])
                    is_free[bid] = 0
                    session_of[bid] = -1
                    taken += 1
                s.live -= taken
                s.free -= taken
                if s.live == 0:
                    del sessions[sid]
                if len(out) == n:
                    break
        if len(out) < n:
            raise RuntimeError("session: fewer evictable blocks than the queue counts")
        self._forget_keys(out)
        return out

    def _compact(self, sid: int, s: Session) -> None:
        session_of, stored_seq, is_free = self.session_of, self.stored_seq, self.is_free
        shift = self.id_bits
        mask = (1 << shift) - 1
        live = {
            k for k in s.free_heap if session_of[-k & mask] == sid and stored_seq[-k & mask] == -k >> shift and is_free[-k & mask]
        }
        s.free_heap = sorted(live)

"""Peer policies: each one on a small hand-made sequence where it differs from LRU."""

from __future__ import annotations

import random
import re
from array import array

import pytest

from vllm_wa.kv_block import set_hash
from vllm_wa.replay.engines import FastEngine, make_engine
from vllm_wa.replay.peers import PEERS
from vllm_wa.replay.peers.session import GhostScores
from vllm_wa.replay.peers.ttl_tool import best_ttl, exponential_ttl
from vllm_wa.replay.policies import PeerPolicy, ReplayPolicy
from vllm_wa.replay.trace import TraceRequest
from vllm_wa.sim.clock import SettableClock

BS = 16


class Harness:
    """A fast-engine pool of ``usable`` blocks driven request by request."""

    def __init__(self, policy: ReplayPolicy, usable: int) -> None:
        self.policy = policy
        self.clock = SettableClock(0.0)
        self.engine = FastEngine(None, policy, usable + 1, self.clock)  # + vLLM's null block
        self.live: dict[str, TraceRequest] = {}
        self.n = 0

    def admit(self, hashes, t, conversation=-1, outcome=None, output_tokens=5) -> tuple[str, int]:
        self.n += 1
        req = TraceRequest(
            f"r{self.n}", t, array("q", hashes), len(hashes) * BS, output_tokens,
            conversation=conversation, outcome=outcome,
        )
        self._at(t)
        hits = self.engine.admit(self.n, req)
        assert hits >= 0, "did not fit"
        self.live[req.request_id] = req
        return req.request_id, hits

    def release(self, rid: str, t: float) -> None:
        self._at(t)
        self.engine.release(self.live.pop(rid))

    def run(self, hashes, t, **kw) -> int:
        """Admit and release at once; the prompt's hit blocks."""
        rid, hits = self.admit(hashes, t, **kw)
        self.release(rid, t)
        return hits

    def _at(self, t: float) -> None:
        self.clock.t = t
        self.policy.advance(t)


def peer(name: str, setting=None, conversations: bool = True) -> PeerPolicy:
    spec = PEERS[name]
    if setting is None and spec.knob is not None:
        setting = spec.knob.default
    return PeerPolicy(name, spec=spec, setting=setting, block_size=BS, conversations=conversations)


def both(name: str, usable: int, script, **kw) -> tuple[int, int]:
    """``script(harness)``'s result under LRU and under the peer."""
    return script(Harness(ReplayPolicy("lru"), usable)), script(Harness(peer(name, **kw), usable))


def scan_after_reuse(h: Harness) -> int:
    """[1,2] is used by two requests, then a scan of one-time prompts; is it still cached?"""
    h.run([1, 2, 3], 1.0)
    h.run([1, 2, 4], 2.0)
    h.run([10, 11, 12], 3.0)
    h.run([20, 21, 22], 4.0)
    return h.run([1, 2, 9], 5.0)


def test_arc_keeps_blocks_used_twice_through_a_scan():
    lru, arc = both("arc", 6, scan_after_reuse)
    assert (lru, arc) == (0, 2)


def test_arc_ghost_hits_grow_t1_target():
    h = Harness(peer("arc"), 4)
    h.run([1, 2, 3], 1.0)  # T1 = {1,2,3}, head most recent once it finished
    h.run([5, 6, 7], 2.0)  # evicts from T1, tail first: 3, 2 go to the ghost list B1
    q = h.policy.queue
    assert set(q.b1) == {2, 3} and q.target_t1_size == 0
    assert h.run([1, 2, 3, 8], 3.0) == 1  # store misses 2, 3 are ghosts in B1
    assert q.target_t1_size == 2


def test_arc_evicts_a_prompt_tail_before_its_head():
    # vLLM 0.32 ARCCachePolicy.on_request_finished walks the request's keys in
    # reverse, so its head ends most recent; evicting the head first would
    # orphan the whole chain (no later prompt could reach its tail).
    lru, arc = both("arc", 4, lambda h: (h.run([1, 2, 3], 1.0), h.run([5, 6], 2.0), h.run([1, 2, 3], 3.0))[-1])
    assert lru == arc == 2


def test_arc_store_is_not_a_frequency_hit_reuse_is():
    h = Harness(peer("arc"), 8)
    q = h.policy.queue
    rid, _ = h.admit([1, 2, 3], 1.0)
    h.release(rid, 1.0)
    assert (q.t1_size, q.t2_size) == (3, 0)  # inserted only: stays in T1
    rid, hits = h.admit([1, 2, 4], 2.0)
    assert hits == 2 and (q.t1_size, q.t2_size) == (4, 0)  # promoted when it finishes
    h.release(rid, 2.0)
    assert (q.t1_size, q.t2_size) == (2, 2)


def looping_hot_set_with_scans(h: Harness) -> int:
    """Each round: two hot prompts, each used twice, then a scan of one-time prompts."""
    hits, key = 0, 1000
    for r in range(10):
        t = 10.0 * r
        for i, hot in enumerate(([1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6])):
            hits += h.run(hot, t + i)
        for i in range(3):  # 9 new blocks: the cache (9) cannot also keep the hot set
            hits += h.run([key, key + 1, key + 2], t + 5 + i)
            key += 3
    return hits


def test_arc_beats_lru_on_a_scan_pattern():
    # A prompt hit in full still recomputes its last block: 2 hit blocks a use.
    # LRU: the scan flushes the hot set every round, so it hits on its second
    # use only (4 blocks a round). ARC: reuse moved it to T2, the scan only
    # cycles through T1 (its target stays 0), so from round 2 on all 4 uses hit.
    lru, arc = both("arc", 9, looping_hot_set_with_scans)
    assert (lru, arc) == (4 * 10, 4 + 8 * 9)


def test_arc_evicts_each_list_in_stamp_order():
    """Each list's victims are its least recently stamped free blocks (through
    re-filed reused blocks, concurrent requests and a compaction)."""
    pol = peer("arc")
    h = Harness(pol, 24)
    q = pol.queue
    evict = q._evict

    def checked_evict(n):
        free = [bid for bid in range(q.num_block_ids) if q.is_free[bid] and q.where[bid]]
        before = {bid: (q.where[bid], q.stamp[bid]) for bid in free}
        victims = evict(n)
        for lst in (1, 2):
            taken = [before[b.block_id][1] for b in victims if b.block_id in before and before[b.block_id][0] == lst]
            left = [q.stamp[bid] for bid in free if q.is_free[bid] and q.where[bid] == lst]
            assert taken == sorted(taken)
            if taken and left:
                assert max(taken) < min(left)
        return victims

    q._evict = checked_evict
    rng = random.Random(3)
    live: list[str] = []
    t = 0.0
    for step in range(400):
        t += 1.0
        if live and (len(live) >= 3 or rng.random() < 0.45):
            h.release(live.pop(rng.randrange(len(live))), t)
            continue
        # Prompts that share prefixes and repeat keys past a miss (another
        # request's block holds them: ARC re-files that block as reused).
        head = rng.randrange(6)
        prompt = [head * 100 + j for j in range(rng.randrange(1, 5))]
        prompt += [rng.randrange(40) for _ in range(rng.randrange(3))]
        prompt = list(dict.fromkeys(prompt))
        if len(prompt) + sum(len(h.live[r].hash_ids) for r in live) > 20:
            continue
        live.append(h.admit(prompt, t)[0])
        if step == 200:
            q._compact()  # dropping stale entries keeps each run in order
            assert all(list(r) == sorted(r) for r in q._runs)


def test_arc_store_misses_move_the_target_as_the_key_by_key_loop_does():
    """The batched ghost-hit updates (set intersections, one step size per
    list) equal vLLM's per-key loop over the prompt's store misses, last key
    first, on random traffic whose keys come back through both ghost lists;
    and no ghost key is ever resident, which the batching relies on."""
    pol = peer("arc")
    h = Harness(pol, 12)
    q = pol.queue
    lookup = q.on_lookup
    both_lists = [0]

    def reference(hit_blocks, hashes):
        b1, b2 = list(q.b1), list(q.b2)  # a move keeps both lists' sizes
        t = q.target_t1_size
        for key in reversed(hashes[len(hit_blocks):]):
            if key in b1:
                t = min(t + max(1.0, len(b2) / len(b1)), q.capacity)
                b1.remove(key)
                b1.append(key)
            elif key in b2:
                t = max(t - max(1.0, len(b1) / len(b2)), 0.0)
                b2.remove(key)
                b2.append(key)
        return t, b1, b2

    def checked_lookup(req, hit_blocks, hashes, now, full_blocks=None):
        assert not (set(q.b1) | set(q.b2)) & set(q.resident.primary)
        misses = set(hashes[len(hit_blocks):])
        both_lists[0] += bool(misses & set(q.b1) and misses & set(q.b2))
        want = reference(hit_blocks, list(hashes))
        lookup(req, hit_blocks, hashes, now, full_blocks)
        assert (q.target_t1_size, list(q.b1), list(q.b2)) == want

    q.on_lookup = checked_lookup
    rng = random.Random(7)
    for step in range(600):
        prompt = list(dict.fromkeys(rng.randrange(30) for _ in range(rng.randrange(1, 6))))
        h.run(prompt, float(step))
    assert both_lists[0] > 0  # the interleaved path ran too


def test_arc_blocks_filed_out_of_stamp_order_still_leave_in_stamp_order():
    # The engines file a request's blocks right after ARC re-stamps them, in
    # stamp order; a driver that files them later or in another order must get
    # the same victims (those entries wait in the list's heap, not its run).
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from vllm_wa.replay.peers.arc import ARCQueue
    from vllm_wa.replay.peers.base import RequestHints

    blocks = [KVCacheBlock(i) for i in range(7)]
    q = ARCQueue(blocks, capacity=6)
    q.popleft()  # vLLM's null block
    got = q.popleft_n(6)
    for b, key in zip(got, [11, 12, 13, 21, 22, 23]):
        set_hash(b, key)
    a, b = RequestHints("a", [11, 12, 13], 48), RequestHints("b", [21, 22, 23], 48)
    q.on_admitted(a, got[:3], 0, 0.0)
    q.on_admitted(b, got[3:], 0, 0.0)
    q.on_free(a, got[:3], 0.0)  # a's blocks get the older stamps
    q.on_free(b, got[3:], 0.0)
    q.append_n(got[3:][::-1])  # b's filed first, a's after them
    q.append_n(got[:3][::-1])
    assert sum(len(h) for h in q._heaps) == 3
    assert [x.block_id for x in q.popleft_n(6)] == [3, 2, 1, 6, 5, 4]  # a's tail first, then b's


def test_arc_falls_back_to_t1_when_t2_has_nothing_evictable():
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from vllm_wa.replay.peers.arc import ARCQueue
    from vllm_wa.replay.peers.base import RequestHints

    blocks = [KVCacheBlock(i) for i in range(5)]
    q = ARCQueue(blocks, capacity=4)
    q.popleft()  # vLLM's null block
    got = q.popleft_n(4)
    for b, h in zip(got, [11, 12, 13, 14]):
        set_hash(b, h)
    a, b, c = (RequestHints(r, k, 32) for r, k in (("a", [11, 12]), ("b", [13, 14]), ("c", [13, 14])))
    q.on_admitted(a, got[:2], 0, 0.0)  # T1: blocks 1, 2
    q.on_admitted(b, got[2:], 0, 0.0)  # T1: blocks 3, 4
    for r, held in ((a, got[:2]), (b, got[2:])):
        q.on_free(r, held, 0.0)
        q.append_n(held[::-1])
    q.on_lookup(c, got[2:], [13, 14], 0.0)
    q.remove_n(got[2:])  # c reuses 13, 14 and keeps them pinned
    q.on_admitted(c, got[2:], 2, 0.0)
    q.on_free(c, got[2:], 0.0)  # both move to T2
    assert (q.t1_size, q.t2_size) == (2, 2)
    q.target_t1_size = 3.0  # T1 is below its target and T2 is all pinned: vLLM #55461 takes T1's oldest
    assert [b.block_id for b in q.popleft_n(1)] == [2]  # a's tail
    assert 12 in q.b1 and q.t1_size == 1


@pytest.mark.parametrize("name, setting", [("slru", 3), ("lfu", None)])
def test_sglang_frequency_policies_keep_reused_prefix_through_a_scan(name, setting):
    lru, p = both(name, 6, scan_after_reuse, setting=setting)
    assert (lru, p) == (0, 2)


def test_slru_default_threshold_protects_every_finished_prompt():
    # SGLang inserts a path after prefill and at the finish: two hits per request.
    lru, slru = both("slru", 6, scan_after_reuse, setting=2)
    assert (lru, slru) == (0, 0)
    h = Harness(peer("slru", 2), 8)
    h.run([1, 2, 3], 1.0)
    h.run([4, 5], 2.0, output_tokens=1)  # finished at prefill: one insert
    q = h.policy.queue
    ids = {q.key_of[b]: b for b in range(len(q.key_of)) if q.key_of[b] is not None}
    assert q.hit_count[ids[1]] == 2 and q.hit_count[ids[4]] == 1


def out_of_order_finish(h: Harness) -> int:
    """A long request starts first and finishes last; then the pool must evict 3 blocks."""
    long_rid, _ = h.admit([1, 2, 3], 1.0)
    h.run([5, 6, 7], 2.0)
    h.release(long_rid, 3.0)
    h.run([10, 11, 12], 4.0)
    return h.run([5, 6, 9], 5.0)


def test_fifo_evicts_by_creation_not_by_free_time():
    lru, fifo = both("fifo", 6, out_of_order_finish)
    assert (lru, fifo) == (0, 2)


def test_tlru_trims_conversation_tails_before_older_heads():
    # xi - Q_hat = 64 tokens: a 128-token history keeps its first 4 blocks; the
    # rest of each conversation is TEL-safe and goes first.
    def policy_xi(slo_s):
        p = peer("tlru", slo_s)
        p.prefill_tokens_per_s = (64 + 200) / slo_s  # xi = 264 tokens, Q_hat = 200
        return p

    def script(h):
        h.run(list(range(1, 9)), 1.0)
        h.run(list(range(11, 19)), 2.0)
        h.run(list(range(30, 38)), 3.0)  # 2 fresh blocks + 6 evicted
        return h.run([1, 2, 3, 4, 99], 4.0)

    lru = script(Harness(ReplayPolicy("lru"), 18))
    tlru = script(Harness(policy_xi(1.0), 18))
    assert (lru, tlru) == (2, 4)


def tel_safe(h: Harness) -> list[bool]:
    """Whether each cached block of a ``tlru`` harness is TEL-safe (evicted first)."""
    q = h.policy.queue
    return [(q.priority(bid) >> q.id_bits) < (1 << 40) for bid in range(len(q.history_len)) if q.key_of[bid] is not None]


def test_tlru_at_either_end_of_its_budget_marks_every_block_or_none():
    """A budget past every history makes every block TEL-safe (then recency
    decides, as in LRU); a zero budget, none past the prompt's own length."""
    def script(h):
        h.run(list(range(1, 9)), 1.0)
        h.run(list(range(11, 19)), 2.0)
        h.run(list(range(30, 38)), 3.0)
        return h.run([1, 2, 3, 4, 99], 4.0)

    huge = Harness(peer("tlru", 1000.0), 18)  # xi = 10M tokens
    assert script(huge) == 2
    assert all(tel_safe(huge)) and tel_safe(huge)
    none = Harness(peer("tlru", 0.0), 18)
    script(none)
    assert not any(tel_safe(none))


def test_tlru_history_counts_the_tokens_with_kv_prompt_and_output_but_the_last():
    """SGLang's cache_finished_req inserts (prompt + output)[:-1], page-aligned:
    a history of 8 blocks and 16 output tokens (one page exactly) is 8 pages
    long, not 9 (which moved the TEL-safe line one block deeper)."""
    for output, pages, safe in ((15, 8, 4), (16, 8, 4), (17, 9, 3)):
        p = peer("tlru", 1.0)
        p.prefill_tokens_per_s = 64 + 200  # xi - Q_hat = 64 tokens
        h = Harness(p, 18)
        h.run(list(range(1, 9)), 1.0, output_tokens=output)
        assert max(h.policy.queue.history_len) == pages * BS
        assert sum(tel_safe(h)) == safe


def test_session_gates_a_new_session_before_evicting_for_it():
    """SAECachePolicy.evict declines a new session against the sessions as
    they stand, the worst one included; gated after the eviction (which had
    removed that session) it declined more, and a declined store's blocks are
    reused first: here N's blocks, lost to the next request."""
    h = Harness(peer("session"), 44)
    base = list(range(1, 41))
    h.run(base, 1.0)  # 40 blocks, one session
    h.run(base[:39] + [50, 51], 2.0)  # hits 39 of its 40: a fresh session, deep (a small bonus)
    h.run([100, 101], 3.0)
    h.run([200, 201, 202], 4.0)  # N: evicts the worst session for its 3 blocks
    q = h.policy.queue
    assert q._sessionless.num_free_blocks == 0  # admitted as a session of its own
    h.run([300, 301, 302], 5.0)
    assert h.run([200, 201, 202], 6.0) == 1


def test_session_evicts_the_least_touched_session_tail_first():
    def script(h):
        h.run([1, 2, 3], 1.0)  # session A
        h.run([1, 2, 4], 2.0)  # continues A (hits 1, 2): A touched
        h.run([1, 2, 5], 3.0)
        h.run([20, 21, 22], 4.0)  # session B, newer but touched once
        h.run([30, 31, 32, 33, 34, 35], 5.0)  # 8 cached + 6 new in 8 usable: evict 6
        return h.run([1, 2, 9], 6.0)

    lru, session = both("session", 8, script)
    assert (lru, session) == (0, 2)


def test_session_merges_continuations_and_seeds_fresh_sessions_from_ghosts():
    h = Harness(peer("session"), 32)
    h.run([1, 2, 3], 1.0)
    h.run([1, 2, 3, 4], 2.0)
    q = h.policy.queue
    assert len(q.sessions) == 1  # the second turn merged into the first's session
    (s,) = q.sessions.values()
    assert s.prefix_depth == 0 and s.live == 4
    h.run([7, 8], 3.0)
    assert len(q.sessions) == 2
    fresh = q.sessions[max(q.sessions)]
    # Seeded from the ghost scores of 7, 8 (one miss each, at positions 0, 1),
    # plus the touch the connector sends right after the store.
    assert fresh.hits == pytest.approx((1.0 / 1.0 + 1.0 / 1.5849625007211563) / 12.0 + 1.0)
    assert fresh.last_touch == q.logical_time == 6  # two touches per stored request


def test_session_keeps_conversations_that_share_a_system_prompt_apart():
    """Three conversations behind one system prompt are three sessions: each
    hit the prompt's blocks in the first one's session but not the rest of
    it.  Merged into one (as a whole-prompt lookup would merge them), the
    newest conversation's blocks were evicted first, as that session's tail."""
    def script(h):
        system = [1, 2]
        h.run(system + [100, 101, 102], 1.0)
        h.run(system + [200, 201, 202], 2.0)
        h.run(system + [300, 301, 302], 3.0)
        h.run([900, 901, 902], 4.0)  # a one-off request evicts three blocks
        return h.run(system + [300, 301, 302, 303], 5.0)

    h = Harness(peer("session"), 11)
    hits = script(h)
    assert hits == script(Harness(ReplayPolicy("lru"), 11)) == 5
    assert len(h.policy.queue.sessions) >= 3


def test_ghost_scores_decay_and_prune_like_the_source():
    g = GhostScores(0.5)
    g.add("k", False, 0.05)
    g.tick += 1
    assert g.read("k", False) == pytest.approx(0.025)
    g.tick += 2  # 0.00625 < 0.01 at a non-resident tick: pruned
    assert g.read("k", False) == 0.0 and len(g) == 0
    g.add("r", True, 0.05)
    g.tick += 3  # resident all along: decays, never pruned
    assert g.read("r", True) == pytest.approx(0.00625)
    g.evicted("r")
    g.tick += 1
    assert g.read("r", False) == 0.0


def tool_call_then_pressure(h: Harness) -> int:
    h.run([1, 2, 3], 1.0, conversation=7, outcome="tool")  # pinned for the TTL
    h.run([5, 6, 7], 2.0, conversation=8, outcome="stop")
    h.run([10, 11, 12], 3.0, conversation=9, outcome="stop")  # evicts 3 blocks
    return h.run([1, 2, 3, 4], 4.0, conversation=7)  # the tool result comes back


def test_ttl_tool_keeps_the_tool_callers_context_within_the_ttl():
    lru, ttl = both("ttl-tool", 6, tool_call_then_pressure)
    assert (lru, ttl) == (0, 3)


def test_ttl_tool_pin_expires_and_needs_both_hints():
    h = Harness(peer("ttl-tool"), 6)
    h.policy.queue.fixed_ttl_s = 0.5
    assert tool_call_then_pressure(h) == 0  # expired at t=1.5, then LRU
    assert tool_call_then_pressure(Harness(peer("ttl-tool", conversations=False), 6)) == 0
    h = Harness(peer("ttl-tool"), 6)
    h.run([1, 2, 3], 1.0, conversation=7, outcome=None)  # no outcome hint: never pinned
    h.run([5, 6, 7], 2.0, conversation=8)
    h.run([10, 11, 12], 3.0, conversation=9)
    assert h.run([1, 2, 3, 4], 4.0, conversation=7) == 0


def test_ttl_tool_unpins_earliest_deadline_under_pressure():
    h = Harness(peer("ttl-tool"), 6)
    h.policy.queue.fixed_ttl_s = 100.0
    h.run([1, 2, 3], 1.0, conversation=1, outcome="tool")
    h.run([5, 6, 7], 2.0, conversation=2, outcome="tool")
    h.run([10, 11, 12], 3.0, conversation=3, outcome="stop")  # all pinned: unpins conversation 1
    assert h.run([5, 6, 7, 8], 4.0, conversation=2) == 3
    assert h.run([1, 2, 3, 4], 5.0, conversation=1) == 0


def test_ttl_tool_pins_the_tool_callers_blocks_when_a_co_runner_frees_them_and_no_others():
    """A tool call whose blocks another running request still holds frees
    nothing at its release. The pin waited for the next release to take it,
    which was another conversation's (no tool call): that one was pinned in
    its place, and the tool caller's context went to LRU when its co-runner
    freed it."""
    h = Harness(peer("ttl-tool"), 8)
    h.policy.queue.fixed_ttl_s = 100.0
    tool, _ = h.admit([1, 2, 3], 0.0, conversation=0, outcome="tool")
    co, _ = h.admit([1, 2, 3, 4], 1.0, conversation=1, outcome="stop")  # shares the prefix
    h.release(tool, 10.0)  # frees nothing: the co-runner holds 1, 2, 3
    h.run([10, 11, 12], 11.0, conversation=2, outcome="stop")  # no tool call: not pinned
    queue = h.policy.queue
    assert queue.pinned_free == 0
    h.release(co, 21.0)  # 1, 2, 3 join conversation 0's pin; 4 goes to LRU
    assert queue.pinned_free == 3
    h.run([30, 31, 32, 33, 34], 25.0, conversation=3, outcome="stop")  # pressure: evicts 10-12 and 4
    assert h.run([1, 2, 3, 5], 40.0, conversation=0) == 3
    assert queue.pinned_free == 0 and all(m is None for m in queue.member_of)


def test_ttl_choice_maximizes_return_probability_minus_holding_cost():
    assert best_ttl([1.0, 1.0, 1.0, 1.0, 100.0], break_even_s=10.0) == 1.0
    assert best_ttl([1.0, 1.0, 1.0, 1.0, 100.0], break_even_s=1e6) == 100.0
    assert best_ttl([50.0, 60.0], break_even_s=10.0) == 0.0  # never worth holding
    assert exponential_ttl(10.0, 100.0) == pytest.approx(10.0 * 2.302585, rel=1e-5)
    assert exponential_ttl(10.0, 5.0) == 0.0


def test_ttl_tool_learns_durations_from_the_conversation_hint():
    h = Harness(peer("ttl-tool", 100.0), 64)
    for i in range(40):
        t = 10.0 * i
        h.run([1000 * i + 1, 1000 * i + 2], t, conversation=i, outcome="tool")
        h.run([1000 * i + 1, 1000 * i + 2, 1000 * i + 3], t + 2.0, conversation=i, outcome="stop")
    q = h.policy.queue
    assert q.durations == [2.0] * 40 and q.current_ttl() == 2.0


@pytest.mark.parametrize("name", sorted(p for p, spec in PEERS.items() if spec.knob is not None))
def test_knob_values_are_checked(name):
    with pytest.raises(ValueError):
        Harness(peer(name, -1.0), 4)


# ---- knob tuning, progress, CLI --------------------------------------------------------------------

import io
import json

from vllm_wa.bench.results import RequestRecord
from vllm_wa.bench.results import RunResult as ServedRun
from vllm_wa.cli import main as cli_main
from vllm_wa.cli import sample_path
from vllm_wa.replay import runner
from vllm_wa.replay.knobs import choose_settings, profile_setup, tuned_sweep
from vllm_wa.replay.loaders import load_trace
from vllm_wa.replay.progress import ProgressBoard, RunReporter
from vllm_wa.replay.runner import ReplayConfig, Task, make_policy, prepare, resolve_sizes, run_one, run_tasks, sweep
from vllm_wa.replay.served import replay_config

MOONCAKE = sample_path("mooncake-conversation-sample.jsonl.xz")


def test_knobs_are_chosen_on_the_profile_half_only():
    trace = load_trace(MOONCAKE)
    setup = prepare(trace, ["slru", "tlru"], ReplayConfig())
    part = profile_setup(setup)
    assert part.trace.end < setup.eval_start  # never sees the evaluated half
    assert setup.trace.start <= part.eval_start < part.trace.end
    sizes = resolve_sizes("10%,20%", setup.trace, setup.eval_start)
    choices = choose_settings(setup, ["lru", "slru", "tlru"], sizes, jobs=1, hindsight=True)
    assert set(choices) == {"slru", "tlru"}  # lru has no knob
    for name, c in choices.items():
        assert set(c.profile) == set(PEERS[name].knob.values) and set(c.hindsight) == set(c.profile)
        assert c.profile[c.chosen] == max(c.profile.values())
        assert c.hindsight[c.hindsight_best] == max(c.hindsight.values())
        assert setup.peer_settings[name] == c.chosen
        assert c.cache_blocks == max(sizes)  # the middle of two sizes
    # The sweep then runs the chosen setting.
    runs = sweep(setup, ["tlru"], sizes, jobs=1)
    assert {r.extra["setting"] for r in runs} == {choices["tlru"].chosen}


@pytest.mark.parametrize("jobs", [1, 2])
def test_tuned_sweep_runs_as_tuning_then_sweep_in_one_pool(jobs):
    """Knobs chosen on the profile half with the other runs beside them: the same
    choices and hit rates as tuning first and sweeping after, and each tuned
    peer's runs only after all of its profile-half runs."""
    trace = load_trace(MOONCAKE)
    policies = ["lru", "slru", "tlru", "arc"]
    two_phase = prepare(trace, policies, ReplayConfig())
    sizes = resolve_sizes("5%,10%,20%", two_phase.trace, two_phase.eval_start)
    want_choices = choose_settings(two_phase, policies, sizes, jobs=1)
    want = sweep(two_phase, policies, sizes, jobs=1)

    setup = prepare(trace, policies, ReplayConfig())
    order: list[tuple[str, str]] = []
    got, choices = tuned_sweep(
        setup, policies, sizes, jobs=jobs,
        on_tuning=lambda r: order.append(("tuning", r.policy)),
        on_choice=lambda c: order.append(("choice", c.peer)),
        on_result=lambda r: order.append(("run", r.policy)),
    )
    assert {p: c.chosen for p, c in choices.items()} == {p: c.chosen for p, c in want_choices.items()}
    assert {p: c.profile for p, c in choices.items()} == {p: c.profile for p, c in want_choices.items()}
    assert setup.peer_settings == two_phase.peer_settings
    assert [(r.policy, r.cache_blocks, r.hit_tokens, r.extra.get("setting")) for r in got] == [
        (r.policy, r.cache_blocks, r.hit_tokens, r.extra.get("setting")) for r in want
    ]
    for peer in ("slru", "tlru"):
        chosen_at = order.index(("choice", peer))
        assert order.count(("tuning", peer)) == len(PEERS[peer].knob.values)
        assert max(i for i, e in enumerate(order) if e == ("tuning", peer)) < chosen_at
        assert min(i for i, e in enumerate(order) if e == ("run", peer)) > chosen_at


def test_run_tasks_runs_the_tasks_a_finished_run_releases():
    trace = load_trace(MOONCAKE)
    setup = prepare(trace, ["lru", "fifo"], ReplayConfig())
    released: list[Task] = []

    def follow(task, r):
        if task.policy != "lru":
            return []
        nxt = [Task("fifo", task.blocks)]
        released.extend(nxt)
        return nxt

    runs = run_tasks(setup, [Task("lru", 300), Task("lru", 600)], jobs=2, follow=follow)
    got = sorted((r.policy, r.cache_blocks) for r in runs)
    assert got == [("fifo", 300), ("fifo", 600), ("lru", 300), ("lru", 600)]
    assert len(released) == 2


def test_progress_bars_only_on_a_terminal():
    quiet = io.StringIO()
    board = ProgressBoard(quiet)
    assert not board.enabled
    rep = RunReporter(board, 0, "lru @100", 1000)
    rep(500)
    rep.close()
    board.write("done")
    assert quiet.getvalue() == "done\n"

    out = io.StringIO()
    board = ProgressBoard(out, enabled=True)
    rep = RunReporter(board, 0, "lru @100", 1000)
    rep(256)
    board.write("a result line")
    text = out.getvalue()
    assert "lru @100" in text and "256/1000 requests" in text and "left" in text
    assert "a result line\n" in text and "\x1b[1F\x1b[J" in text  # bars redrawn below the line
    rep.new_pass("pass 2")  # drawn at once, counting from zero again
    text = out.getvalue()[len(text):]
    assert "lru @100 (pass 2)" in text and " 0/1000 requests" in text
    rep.close()
    board.close()


def test_cli_replay_peers_with_fixed_settings_and_hints_in_table(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    rc = cli_main([
        "replay", MOONCAKE, "--policies", "lru,tlru,ttl-tool,opt", "--cache-blocks", "400,800",
        "--peer-settings", "tlru=0.8,ttl-tool=100", "--json", str(out_json), "--no-cache", "--jobs", "1",
    ])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ttl-tool*" in text and "slo=0.8 (fixed)" in text and "this trace has no conversation" in text
    data = json.loads(out_json.read_text())
    assert data["meta"]["peer_settings_fixed"] == {"tlru": 0.8, "ttl-tool": 100.0}
    rec = {(r["policy"], r["cache_blocks"]): r for r in data["results"]}
    assert rec[("tlru", 400)]["extra"]["setting"] == 0.8
    assert rec[("ttl-tool", 800)]["extra"]["client_hints"] == ["conversation", "outcome"]
    assert rec[("tlru", 800)]["gap_closed"] is not None


@pytest.mark.parametrize(
    "spec, msg",
    [("tlru=-1", "xi"), ("slru=2.5", "integer"), ("arc=3", "no knob"), ("nope=1", "PEER=VALUE"), ("tlru", "PEER=VALUE"),
     ("ttl-tool=abc", "number"), ("slru=3", "not among")],
)
def test_cli_rejects_bad_peer_settings(spec, msg, capsys):
    with pytest.raises(SystemExit, match=msg):
        policies = "lru,tlru,ttl-tool,arc" + (",slru" if spec == "slru=2.5" else "")
        cli_main(["replay", MOONCAKE, "--policies", policies, "--peer-settings", spec, "--no-cache"])


def test_cli_says_how_to_run_tunable_peers_on_a_trace_with_no_profile_half(tmp_path, capsys):
    """Every request at one time: the profile half is empty, so the knobs cannot be tuned."""
    trace = tmp_path / "same_time.jsonl"
    rows = [{"chat_id": i, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 32, "output_length": 4,
             "type": "text", "turn": 1, "hash_ids": [1, 2 + i]} for i in range(6)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = cli_main(["replay", str(trace), "--policies", "lru,slru", "--cache-blocks", "4", "--no-cache", "--jobs", "1"])
    assert rc == 2
    assert re.search("has 0 request.*--peer-settings.*--profile-fraction 0", capsys.readouterr().err)
    rc = cli_main(["replay", str(trace), "--policies", "lru,slru", "--cache-blocks", "4", "--no-cache", "--jobs", "1",
                   "--profile-fraction", "0"])
    assert rc == 0
    assert "protected_threshold=2 (default)" in capsys.readouterr().out


# ---- a served trace through vLLM's manager ---------------------------------------------------------


def served_result(path, n_conv=6, turns=5, bs=16):
    """A bench-serve result: conversations whose prompts grow by a partly filled block each turn."""
    res = ServedRun(label="x", url="u", trace="t", block_size=bs, time_scale=1.0, max_output_tokens=40)
    i = 0
    for c in range(n_conv):
        ids: list[int] = []
        for k in range(turns):
            ids = ids + [1000 * (c + 1) + len(ids), 1000 * (c + 1) + len(ids) + 1]
            t = c * 0.3 + k * 2.0
            res.requests.append(RequestRecord(
                index=i, request_id=f"c{c}t{k}", conversation=c, tag="tool",
                outcome_hint="tool" if k % 2 == 0 else None, hash_ids=list(ids), input_tokens=len(ids) * bs - 5,
                max_tokens=40, planned=t, sent=t, first_token=t + 0.05, done=t + 0.5,
                prompt_tokens=len(ids) * bs - 5, completion_tokens=40, finish_reason="length",
                server_ttft_ms=20.0, server_queue_ms=1.0, server_generation_ms=400.0))
            i += 1
    res.write(str(path))
    return load_trace(str(path))


def test_served_engine_holds_the_replys_kv_and_keys_its_full_blocks(tmp_path):
    """A served request holds its reply's slots too (every generated token but the last);
    a peer is told its full blocks: the prompt's by hash id, the rest by keys of the request."""
    trace = served_result(tmp_path / "served.json", n_conv=1, turns=1)
    [req] = trace.requests
    assert (req.input_tokens, req.output_tokens) == (27, 40)  # 1 full prompt block of 16 + 11 tokens
    setup = prepare(trace, ["arc"], replay_config(ReplayConfig(engine="vllm")))
    policy = make_policy("arc", setup)
    engine = make_engine("vllm", setup.trace, policy, 30, SettableClock(req.arrival))
    told = []

    class Spy:
        def __getattr__(self, name):
            return getattr(policy.request_hooks, name)

        def on_admitted(self, info, blocks, n_hit, now):
            told.append((list(info.hashes), list(blocks)))
            policy.request_hooks.on_admitted(info, blocks, n_hit, now)

    engine.hooks = Spy()
    assert engine.admit(0, req) == 0
    held = engine.manager.coordinator.get_blocks(req.request_id)[0]
    assert len(held) == -(-(27 + 39) // 16)  # 66 tokens of KV: 5 blocks, the last partly filled
    [(keys, blocks)] = told
    assert keys == [req.hash_ids[0], (req.request_id, 1), (req.request_id, 2), (req.request_id, 3)]
    assert blocks == held[:4] and all(b.block_hash is not None for b in blocks)


def test_a_served_trace_replays_on_vllms_manager_whichever_engine_is_asked(tmp_path):
    """The fast pool caches a prompt's partly filled last block and holds no
    reply slots, so on a served trace (the default engine) it read hits the
    server could not have had."""
    trace = served_result(tmp_path / "served.json", n_conv=2, turns=3)
    fast = sweep(prepare(trace, ["lru"], replay_config(ReplayConfig(engine="fast"))), ["lru"], [12], jobs=1)[0]
    on_vllm = sweep(prepare(trace, ["lru"], replay_config(ReplayConfig(engine="vllm"))), ["lru"], [12], jobs=1)[0]
    assert fast.hit_tokens == on_vllm.hit_tokens > 0


def test_opt_on_a_served_trace_is_scouted_although_its_prompts_alone_fit(tmp_path, replay_passes):
    """A served request also holds its reply's slots, so prompts that never
    fill the pool can still overflow it: the scout must not be skipped there."""
    trace = served_result(tmp_path / "served.json")
    cfg = replay_config(ReplayConfig(engine="vllm"))
    setup = prepare(trace, ["opt"], cfg)
    assert runner.peak_demand(setup.trace, cfg.lifetime.finish_times(setup.trace)) < 22  # prompts fit
    r = run_one(setup.trace, make_policy("opt", setup), 22, cfg, setup.eval_start)
    assert r.overflow > 0 and replay_passes == ["lru", "opt"]


def test_peers_on_a_served_trace_index_only_the_blocks_vllm_caches(tmp_path):
    """Reply slots and partly filled blocks go through the peers too; no key outlives its block."""
    trace = served_result(tmp_path / "served.json")
    assert trace.conversations and trace.has_outcomes
    cfg = replay_config(ReplayConfig(engine="vllm"))
    setup = prepare(trace, ["lru", *PEERS], cfg)
    ample = {p: sweep(setup, [p], [400], jobs=1)[0].hit_tokens for p in ("lru", *PEERS)}
    assert ample["lru"] > 0 and set(ample.values()) == {ample["lru"]}  # nothing evicted: all equal
    for name in PEERS:
        policy = make_policy(name, setup)
        r = run_one(setup.trace, policy, 30, cfg, setup.eval_start)
        assert 0 < r.hit_tokens <= ample["lru"], name
        q = policy.queue
        for bid, key in enumerate(q.key_of):
            if key is not None:
                assert q.block[bid].block_hash is not None, (name, bid, key)
        resident = getattr(q, "resident", None)
        if resident is not None:
            assert all(q.key_of[bid] == key for key, bid in resident.primary.items()), name

"""Check ``opt`` against an exhaustive search on tiny random traces.

``opt`` is Belady's rule under the replay's block semantics (prefix lookups,
the recomputed last block, pinned blocks, requests that do not fit). Whether
it is the best any eviction order can do is checked here by brute force: an
independent model of the replay's block pool (checked first against the
replay's own ``lru``) tries every choice of free blocks at every eviction and
keeps the best total of hit blocks.

    python benchmarks/opt_brute_force.py --seeds 100 --sizes 6,8,10

Cases where some request does not fit are counted apart: there which requests
fit depends on what was evicted, and ``opt`` takes the LRU scout's set as
given, so it is not a bound (README, Known limitations).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from array import array
from dataclasses import dataclass, field

from vllm_wa.replay.lifetime import LifetimeModel
from vllm_wa.replay.runner import ReplayConfig, prepare, sweep
from vllm_wa.replay.trace import Trace, TraceRequest

BLOCK_TOKENS = 512


def random_trace(seed: int) -> Trace:
    """A few conversations growing from shared system prompts, some prompts sent twice."""
    rng = random.Random(seed)
    counter = itertools.count(1001)
    systems = [[next(counter) for _ in range(rng.randint(1, 2))] for _ in range(2)]
    n_conv, max_len = rng.choice([2, 3, 4]), rng.choice([3, 4, 5])
    convs = [list(rng.choice(systems)) for _ in range(n_conv)]
    requests, t, last = [], 0.0, None
    for i in range(rng.choice([8, 10, 14])):
        t += rng.uniform(0.5, rng.choice([2, 4, 8]))
        if last is not None and rng.random() < 0.3:
            ids = last  # the same prompt again: vLLM recomputes its last block
        else:
            c = rng.randrange(n_conv)
            ids = convs[c] + [next(counter) for _ in range(rng.randint(1, 2))]
            if len(ids) > max_len:
                ids = list(rng.choice(systems)) + [next(counter)]
            convs[c] = ids
        last = ids
        tokens = BLOCK_TOKENS * len(ids) - (rng.randrange(BLOCK_TOKENS) if rng.random() < 0.5 else 0)
        requests.append(TraceRequest(f"r{i}", round(t, 3), array("q", ids), tokens, rng.randint(0, 40)))
    return Trace(f"random-{seed}", BLOCK_TOKENS, requests, "mooncake")


@dataclass
class PoolState:
    """The replay's block pool, reduced to what decides hits: block 0 is vLLM's null block."""

    hash_of: list[int | None]
    refs: list[int]
    cached: dict[int, list[int]] = field(default_factory=dict)  # hash -> blocks, the one a lookup finds first
    held: dict[int, list[int]] = field(default_factory=dict)  # request -> its blocks
    finishing: list[tuple[float, int]] = field(default_factory=list)
    lru: list[int] = field(default_factory=list)  # free blocks, least recently freed first

    @classmethod
    def empty(cls, usable: int) -> PoolState:
        return cls([None] * (usable + 1), [0] * (usable + 1), lru=list(range(1, usable + 1)))

    def copy(self) -> PoolState:
        return PoolState(self.hash_of[:], self.refs[:], {h: b[:] for h, b in self.cached.items()},
                         {r: b[:] for r, b in self.held.items()}, self.finishing[:], self.lru[:])

    def key(self, i: int) -> tuple:
        """The state up to a renaming of blocks (the search's memo key)."""
        names: dict[int, int] = {}

        def name(b: int) -> int:
            return names.setdefault(b, len(names))

        held = tuple((r, tuple(name(b) for b in bs)) for r, bs in sorted(self.held.items()))
        cached = tuple((h, tuple(name(b) for b in bs)) for h, bs in sorted(self.cached.items()))
        return i, held, cached, tuple(sorted(self.finishing))

    def release_due(self, now: float) -> None:
        while self.finishing and self.finishing[0][0] <= now:
            _, r = heapq.heappop(self.finishing)
            freed = []
            for b in self.held.pop(r):
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    freed.append(b)
            self.lru.extend(reversed(freed))  # tail first, as vLLM frees

    def plan(self, hashes: list[int]) -> tuple[list[int], list[int], bool]:
        """Hit blocks, missed hashes, and whether the request fits."""
        hits = []
        for h in hashes[:-1]:  # the last block is always recomputed
            blocks = self.cached.get(h)
            if not blocks:
                break
            hits.append(blocks[0])
        misses = hashes[len(hits):]
        free = sum(1 for r in self.refs[1:] if r == 0)
        return hits, misses, len(misses) + [self.refs[b] for b in hits].count(0) <= free

    def admit(self, r: int, hits: list[int], misses: list[int], new: list[int], finish: float) -> None:
        for b in hits:
            if self.refs[b] == 0:
                self.lru.remove(b)
            self.refs[b] += 1
        for b, h in zip(new, misses):
            self.lru.remove(b)
            old = self.hash_of[b]
            if old is not None:
                self.cached[old].remove(b)
                if not self.cached[old]:
                    del self.cached[old]
            self.refs[b], self.hash_of[b] = 1, h
            self.cached.setdefault(h, []).append(b)
        self.held[r] = hits + list(new)
        heapq.heappush(self.finishing, (finish, r))


def lru_hits(trace: Trace, blocks: int) -> int:
    """Hit blocks under LRU in this model (checked against the replay's ``lru``)."""
    finish = LifetimeModel().finish_times(trace)
    s, total = PoolState.empty(blocks - 1), 0
    for i, req in enumerate(trace.requests):
        s.release_due(req.arrival)
        hashes = list(req.hash_ids)
        hits, misses, fits = s.plan(hashes)
        if fits:
            s.admit(i, hits, misses, [b for b in s.lru if b not in hits][: len(misses)], float(finish[i]))
            total += len(hits)
    return total


def best_hits(trace: Trace, blocks: int, max_states: int = 300_000) -> int | None:
    """The most hit blocks any eviction order reaches (None: the search grew past ``max_states``)."""
    finish = LifetimeModel().finish_times(trace)
    requests, memo = trace.requests, {}

    def solve(i: int, s: PoolState) -> int:
        if i == len(requests):
            return 0
        s.release_due(requests[i].arrival)
        key = s.key(i)
        if key in memo:
            return memo[key]
        if len(memo) > max_states:
            raise OverflowError
        hashes = list(requests[i].hash_ids)
        hits, misses, fits = s.plan(hashes)
        if not fits:
            memo[key] = solve(i + 1, s.copy())
            return memo[key]
        free = [b for b in range(1, len(s.refs)) if s.refs[b] == 0 and b not in hits]
        empty = [b for b in free if s.hash_of[b] is None]
        cached = [b for b in free if s.hash_of[b] is not None]
        best = -1
        for k in range(max(0, len(misses) - len(empty)), min(len(misses), len(cached)) + 1):
            for evicted in itertools.combinations(cached, k):
                nxt = s.copy()
                nxt.admit(i, hits, misses, empty[: len(misses) - k] + list(evicted), float(finish[i]))
                best = max(best, len(hits) + solve(i + 1, nxt))
        memo[key] = best
        return best

    try:
        return solve(0, PoolState.empty(blocks - 1))
    except OverflowError:
        return None


@dataclass
class Tally:
    cases: int = 0
    below_best: int = 0
    below_lru: int = 0


def check(seeds: range, sizes: list[int], policies: list[str]) -> dict[bool, dict[str, Tally]]:
    """Per overflow (True: some request did not fit), per policy: cases, and how often it fell short."""
    tallies: dict[bool, dict[str, Tally]] = {o: {p: Tally() for p in policies} for o in (False, True)}
    cfg = ReplayConfig(profile_fraction=0.0)
    for seed in seeds:
        trace = random_trace(seed)
        setup = prepare(trace, policies, cfg)
        results = {(r.policy, r.cache_blocks): r for r in sweep(setup, policies, sizes, jobs=1)}
        for n in sizes:
            lru = results[("lru", n)]
            if lru_hits(trace, n) != lru.hit_blocks:
                raise SystemExit(f"seed {seed}, {n} blocks: this model's LRU disagrees with the replay's")
            best = best_hits(trace, n)
            if best is None:
                continue
            overflow = any(results[(p, n)].overflow for p in policies)
            for p in policies:
                t = tallies[overflow][p]
                t.cases += 1
                t.below_best += results[(p, n)].hit_blocks < best
                t.below_lru += results[(p, n)].hit_blocks < lru.hit_blocks
    return tallies


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=100, help="random traces (seeds 0 .. N-1)")
    ap.add_argument("--sizes", default="6,8,10", help="cache sizes in blocks, the null block included")
    ap.add_argument("--policies", default="lru,opt", help="replay policies to check (lru always)")
    args = ap.parse_args(argv)
    policies = list(dict.fromkeys(["lru", *args.policies.split(",")]))
    tallies = check(range(args.seeds), [int(s) for s in args.sizes.split(",")], policies)
    for overflow, label in ((False, "every request fit"), (True, "some request did not fit")):
        for p, t in tallies[overflow].items():
            print(f"{label}: {p}: {t.cases} cases, below the best order in {t.below_best}, below lru in {t.below_lru}")


if __name__ == "__main__":
    main()

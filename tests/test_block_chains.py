"""Block ids hashed per block read as vLLM's chained hashes (vllm_wa/replay/block_chains.py)."""

from __future__ import annotations

import random
from array import array

from vllm_wa.replay.block_chains import chain_block_ids, chains_hold
from vllm_wa.replay.trace import TraceRequest


def _request(i: int, ids: list[int]) -> TraceRequest:
    return TraceRequest(request_id=str(i), arrival=float(i), hash_ids=array("q", ids), input_tokens=16 * len(ids),
                        output_tokens=1)


def _prompts(seed: int) -> list[list[int]]:
    """Prompts of block contents from a small alphabet: shared prefixes, repeats
    inside a prompt and one content behind many prefixes, as in Bailian's trace A."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(300):
        if prompts and rng.random() < 0.6:  # a later turn or a shared system prompt: some earlier prompt's prefix
            base = rng.choice(prompts)
            p = base[: rng.randint(1, len(base))]
        else:
            p = []
        p = p + [rng.randrange(12) for _ in range(rng.randint(1, 6))]
        prompts.append(p)
    return prompts


def test_chaining_per_block_ids_names_each_block_by_its_whole_prefix():
    """The partition of (request, position) that the chained ids make is the
    one the prefixes make: two blocks share an id exactly when everything up
    to and including them is the same content."""
    for seed in range(5):
        prompts = _prompts(seed)
        reqs = [_request(i, p) for i, p in enumerate(prompts)]
        assert not chains_hold(reqs)
        changed = chain_block_ids(reqs)
        assert 0 < changed < len(reqs) and chains_hold(reqs)
        by_prefix: dict[tuple[int, ...], int] = {}
        for p, r in zip(prompts, reqs, strict=True):
            for j, block in enumerate(r.hash_ids):
                assert by_prefix.setdefault(tuple(p[: j + 1]), block) == block
        assert len(set(by_prefix.values())) == len(by_prefix)
        # The first appearance of a content keeps its id; chaining again changes nothing.
        assert list(reqs[0].hash_ids) == prompts[0]
        before = [list(r.hash_ids) for r in reqs]
        assert chain_block_ids(reqs) == 0 and [list(r.hash_ids) for r in reqs] == before


def test_ids_near_the_top_of_the_range_are_renumbered_not_overflowed():
    """New ids count up from the largest: past 2**63 - 1 every id is first
    renumbered densely, keeping which blocks are the same."""
    top = (1 << 63) - 1
    reqs = [_request(0, [top, 5]), _request(1, [5, top]), _request(2, [top, 5])]
    chain_block_ids(reqs)
    ids = [list(r.hash_ids) for r in reqs]
    assert ids[0] == ids[2] and len({*ids[0], *ids[1]}) == 4 and max(max(i) for i in ids) < 8
    # With room for the new ids the first appearances keep their values.
    reqs = [_request(0, [top - 100, 5]), _request(1, [5, top - 100])]
    chain_block_ids(reqs)
    assert list(reqs[0].hash_ids) == [top - 100, 5] and top - 100 < reqs[1].hash_ids[0] <= top

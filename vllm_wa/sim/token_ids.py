"""Prompt token ids synthesized from a trace's block hash ids.

A trace gives every prompt as one hash id per ``block_size``-token block, and
a block's id implies its whole prefix.  Turning each id into a fixed,
pseudo-random run of ``block_size`` token ids makes vLLM's own chained block
hashing reproduce the trace's prefix sharing exactly: two prompts share their
first ``n`` blocks in vLLM's prefix cache if and only if they share their first
``n`` hash ids.  The benchmark client sends these ids to a real server and the
replay of what the server saw hashes the same ids, so both see the same blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

# Token ids are drawn from [FIRST_TOKEN, FIRST_TOKEN + NUM_TOKENS): above the
# usual special tokens (0-2) and inside the smallest vocabulary we serve (the
# tests' tiny model has 400 tokens; real models have far more).
FIRST_TOKEN = 16
NUM_TOKENS = 368


@lru_cache(maxsize=1 << 18)
def block_token_ids(hash_id: int, block_size: int) -> tuple[int, ...]:
    """The ``block_size`` token ids that stand for the block with ``hash_id``.

    Deterministic across processes and machines (SHAKE-128 of the id), and
    collision-free in practice: ``NUM_TOKENS ** block_size`` possible runs.
    """
    raw = hashlib.shake_128(int(hash_id).to_bytes(16, "little", signed=True)).digest(2 * block_size)
    return tuple(FIRST_TOKEN + int.from_bytes(raw[2 * i : 2 * i + 2], "little") % NUM_TOKENS for i in range(block_size))


def prompt_token_ids(hash_ids: Sequence[int], block_size: int, num_tokens: int) -> list[int]:
    """A prompt of ``num_tokens`` ids: each block's ids, the last block cut short.

    ``num_tokens`` must lie in the last block: ``len(hash_ids) == ceil(num_tokens / block_size)``.
    """
    n_blocks = len(hash_ids)
    if not (n_blocks - 1) * block_size < num_tokens <= n_blocks * block_size:
        raise ValueError(
            f"{num_tokens} tokens do not fill {n_blocks} blocks of {block_size} tokens "
            "(the last block must hold between 1 and block_size tokens)"
        )
    out: list[int] = []
    for h in hash_ids:
        out.extend(block_token_ids(h, block_size))
    del out[num_tokens:]
    return out

"""A cached block's hash, under one name on every supported vLLM.

vLLM 0.32 and 0.33 keep it in the private slot ``_block_hash`` of
``KVCacheBlock``, behind a read-only ``block_hash`` property; 0.34 made
``block_hash`` the slot itself (and has no ``_block_hash``).  The queue, the
tagger and the replay's pools read it for every block they file, where a
property or a ``getattr`` by name costs three to four times a slot read (6 %
of a replay's CPU time, measured with ``attrgetter``).  So the free queues
and the replay's pool call :func:`install_hash_alias` when they are built (a
tagger or Belady's oracle reads blocks only beside its queue): it names that
same slot ``wa_block_hash`` on ``KVCacheBlock`` (the slot's own descriptor
under a second name, so reads and writes cost what the slot's do and
nothing about the block changes).  It is installed by those constructors
only: the queue under ``--wa-online``, the replay's pools, never at import.
:func:`hash_of` and :func:`set_hash` read and write the slot anywhere else.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

HASH_SLOT = "_block_hash" if "_block_hash" in KVCacheBlock.__slots__ else "block_hash"
HASH_ALIAS = "wa_block_hash"

# The block's hash (None: not cached), without the alias.
hash_of = attrgetter(HASH_SLOT)


def set_hash(block: KVCacheBlock, value: Any) -> None:
    """Write the block's hash slot (what ``set_block_hash`` and ``reset_hash`` do, without their check)."""
    setattr(block, HASH_SLOT, value)


def install_hash_alias() -> None:
    """Name the hash slot ``wa_block_hash`` on ``KVCacheBlock`` (idempotent)."""
    if HASH_ALIAS not in KVCacheBlock.__dict__:
        setattr(KVCacheBlock, HASH_ALIAS, KVCacheBlock.__dict__[HASH_SLOT])

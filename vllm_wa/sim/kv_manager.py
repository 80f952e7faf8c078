"""vLLM's real ``KVCacheManager`` with no model and no device.

Block bookkeeping needs neither, as vLLM's own ``tests/v1/core`` show; the
replay's vLLM engines and the tests build it here.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)


def model_free_kv_cache_manager(num_blocks: int, block_size: int, max_model_len: int, **kwargs: Any) -> Any:
    """vLLM's real ``KVCacheManager`` over one attention layer and no tensors.

    Block bookkeeping needs no model and no device, as in vLLM's own
    ``tests/v1/core``; prefix caching is on unless ``enable_caching=False``.
    """
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    kwargs.setdefault("enable_caching", True)
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        **kwargs,
    )

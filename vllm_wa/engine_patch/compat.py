"""The vLLM versions whose block pool this package knows how to patch."""

from __future__ import annotations

import re

# vLLM 0.32, 0.33 and 0.34 share the free-queue interface and the
# KVCacheManager methods we wrap (checked against their sources).  0.34
# renamed KVCacheBlock's hash slot (see vllm_wa.kv_block); `make test` runs the
# tests that need no compiled vLLM op against 0.33.0's and 0.34.0's sources too.
SUPPORTED_VLLM = ((0, 32), (0, 33), (0, 34))
SUPPORTED_RANGE = ">=0.32,<0.35"

_REQUIRED = {
    "vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue": (
        "popleft",
        "popleft_n",
        "remove",
        "append",
        "append_n",
        "prepend_n",
        "get_all_free_blocks",
        "iter_blocks_after",
    ),
    "vllm.v1.core.kv_cache_manager.KVCacheManager": (
        "get_computed_blocks",
        "free",
        "pop_blocks_for_free",
    ),
    "vllm.v1.core.block_pool.BlockPool": ("free_blocks", "touch", "get_new_blocks"),
}


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is outside the range vllm-wa was tested with."""


def parse_version(version: str) -> tuple[int, int]:
    m = re.match(r"^(\d+)\.(\d+)", version)
    if m is None:
        raise UnsupportedVLLMError(f"cannot parse vLLM version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_vllm_version(version: str | None = None) -> str:
    """Return the vLLM version, or raise a clear error if it is not supported."""
    if version is None:
        try:
            import vllm
        except ImportError as e:
            raise UnsupportedVLLMError(f"vllm-wa needs vLLM {SUPPORTED_RANGE}; import failed: {e}") from e
        version = getattr(vllm, "__version__", "unknown")
    if parse_version(version) not in SUPPORTED_VLLM:
        raise UnsupportedVLLMError(
            f"vllm-wa supports vLLM {SUPPORTED_RANGE} (tested on 0.32.0, and on 0.33.0's and 0.34.0's Python sources); "
            f"found {version}. "
            "Install a supported vLLM or run without --wa-online."
        )
    import importlib

    for qualname, methods in _REQUIRED.items():
        module_name, _, cls_name = qualname.rpartition(".")
        cls = getattr(importlib.import_module(module_name), cls_name, None)
        missing = [m for m in methods if cls is None or not callable(getattr(cls, m, None))]
        if missing:
            raise UnsupportedVLLMError(
                f"vLLM {version}: {qualname} lacks {missing}; vllm-wa cannot patch it safely"
            )
    return version

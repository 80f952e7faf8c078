"""Shared builders for tests that drive vLLM's real v1 KV-cache classes."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import pytest
import torch
from hypothesis import settings
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request, RequestStatus

from vllm_wa.replay import runner
from vllm_wa.sim.clock import SettableClock
from vllm_wa.sim.kv_manager import model_free_kv_cache_manager

# CI runs a fixed set of examples (a red run must be reproducible); set
# HYPOTHESIS_PROFILE=explore to search new ones while developing.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# `make test-vllm033` and `test-vllm034` run tests against another vLLM's sources (on PYTHONPATH):
# that they are the ones imported is checked, not assumed.
_EXPECTED_VLLM = os.environ.get("VLLM_WA_EXPECT_VLLM")
if _EXPECTED_VLLM:
    import vllm

    if vllm.__version__ != _EXPECTED_VLLM:
        raise pytest.UsageError(f"expected vLLM {_EXPECTED_VLLM}, imported {vllm.__version__} from {vllm.__file__}")


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _init_none_hash():
    init_none_hash(sha256)


@pytest.fixture
def clock() -> SettableClock:
    return SettableClock()


@pytest.fixture
def replay_passes(monkeypatch) -> list[str]:
    """The name of the policy each replay pass of ``run_one`` runs, in order."""
    passes: list[str] = []
    loop = runner._replay_loop

    def counted(*args, **kwargs):
        passes.append(args[3].name)
        return loop(*args, **kwargs)

    monkeypatch.setattr(runner, "_replay_loop", counted)
    return passes


def make_manager(num_blocks: int, block_size: int = 16, **kwargs) -> KVCacheManager:
    return model_free_kv_cache_manager(num_blocks, block_size, max_model_len=8192, **kwargs)


def make_hybrid_manager(
    num_blocks: int, block_size: int = 16, sliding_window: int = 32, *, window_first: bool = False
) -> KVCacheManager:
    """A hybrid model's manager: one full-attention and one sliding-window KV-cache
    group, in that order unless ``window_first`` (a model whose first layer uses the window)."""
    full = KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))
    window = KVCacheGroupSpec(
        ["swa"],
        SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=sliding_window),
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[window, full] if window_first else [full, window],
    )
    return KVCacheManager(
        config, max_model_len=8192, scheduler_block_size=block_size, hash_block_size=block_size, enable_caching=True
    )


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    block_size: int = 16,
    tag: object = None,
    extra_args: dict | None = None,
) -> Request:
    if extra_args is None and tag is not None:
        extra_args = {"type_info": tag}
    sp = SamplingParams(max_tokens=8, extra_args=extra_args)
    sp.update_from_generation_config({}, eos_token_id=100)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def run_prefill(manager: KVCacheManager, request: Request) -> int:
    """Look the prompt up, allocate it and cache it; returns the hit tokens."""
    blocks, num_hit, _ = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
    assert new is not None, f"{request.request_id} did not fit"
    request.num_computed_tokens = request.num_tokens
    return num_hit


def finish(manager: KVCacheManager, request: Request, status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> None:
    request.status = status
    manager.free(request)

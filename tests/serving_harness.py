"""An API server's ``/wa/params`` routes over real engine-side objects, in one process.

The engine side is what ``--wa-online`` installs in an engine core (vLLM's
``KVCacheManager`` with the workload-aware queue, the controller, the
``wa_*`` utilities); the API side is a FastAPI app with the plugin's router,
reaching the engine through an in-process stand-in for vLLM's utility-call
channel.  Requests go through vLLM's own OpenAI request model
(``CompletionRequest``: ``vllm_xargs`` parsing and ``to_sampling_params``).
"""

from __future__ import annotations

import functools
from argparse import Namespace
from collections import Counter
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request, RequestStatus

from conftest import make_manager
from vllm_wa.controller.config import ControllerConfig
from vllm_wa.controller.controller import start_online
from vllm_wa.engine_patch.install import install_wa_queue
from vllm_wa.serving import api_side, engine_side
from vllm_wa.serving.engine_side import EngineWA, external_request_id
from vllm_wa.serving.params_api import make_router
from vllm_wa.serving.settings import ServingSettings
from vllm_wa.serving.snapshots import EngineSnapshots
from vllm_wa.sim.clock import SettableClock

API_KEY = "test-secret"
BLOCK = 16


class Engine:
    """One engine core's ``--wa-online`` objects over a real ``KVCacheManager``."""

    def __init__(self, config: ControllerConfig, settings: ServingSettings, num_blocks: int = 400, index: int = 0):
        self.clock = SettableClock(1.0)
        self.manager = make_manager(num_blocks, BLOCK)
        handles = []

        def install(sink, registry, key):
            h = install_wa_queue(self.manager.block_pool, None, clock=self.clock, sink=sink, registry=registry,
                                 class_key=key)
            h.tagger.request_key = external_request_id
            handles.append(h)
            return h.queue, h.tagger

        self.controller = start_online(config, num_blocks, install, clock=self.clock)
        self.handle = handles[0]
        ewa = EngineWA(self.handle, self.controller, scheduler=SimpleNamespace(shutdown=lambda wait: None),
                       settings=settings, engine_index=index, block_size=BLOCK)
        self.core = SimpleNamespace(scheduler=SimpleNamespace(_vllm_wa_engine=ewa))
        self.served = 0

    def submit(self, body: dict[str, Any], prompt: list[int]) -> bool:
        """Serve one completion request as vLLM would; False when vLLM's request model refuses it."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError:
            return False  # vLLM answers 400; the engine never sees it
        sp = req.to_sampling_params(max_tokens=1)
        sp.update_from_generation_config({}, eos_token_id=2)
        self.served += 1
        r = Request(request_id=f"cmpl-{self.served}-0a1b2c3d", prompt_token_ids=prompt, sampling_params=sp,
                    pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
        m = self.manager
        blocks, n_hit, _ = m.get_computed_blocks(r)
        if m.allocate_slots(r, r.num_tokens - n_hit, n_hit, blocks) is None:
            m.free(r)
            return True
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.FINISHED_STOPPED
        m.free(r)
        return True


class InProcessEngineClient:
    """Stands in for vLLM's engine client: utility calls run the engine-side functions."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = engines
        self.engine_core = self
        self.calls: Counter[str] = Counter()

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        self.calls[method] += 1
        fn = engine_side._UTILITIES[method]
        return [fn(e.core, *args) for e in self.engines]


def make_app(
    engines: list[Engine], settings: ServingSettings, *, api_key: str | None = API_KEY, max_age_s: float = 60.0,
    clock: Any = None,
) -> tuple[FastAPI, InProcessEngineClient, EngineSnapshots]:
    client = InProcessEngineClient(engines)
    kw = {"clock": clock} if clock is not None else {}
    snapshots = EngineSnapshots(max_age_s, functools.partial(api_side.call_engines, client, "wa_get_snapshot"), **kw)
    app = FastAPI()
    app.state.args = Namespace(api_key=[api_key] if api_key else None)
    app.state.engine_client = client
    max_classes = engines[0].handle.registry.max_classes
    app.include_router(make_router(settings, snapshots, max_classes))
    return app, client, snapshots

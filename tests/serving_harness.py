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
import json
from argparse import Namespace
from collections import Counter
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request, RequestStatus
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from conftest import make_manager
from vllm_wa.controller.config import ControllerConfig
from vllm_wa.controller.controller import start_online
from vllm_wa.engine_patch.install import install_wa_queue
from vllm_wa.serving import api_side, engine_side
from vllm_wa.serving.engine_side import EngineWA, match_api_reports
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

        def install(sink, registry, key, conversations):
            h = install_wa_queue(self.manager.block_pool, None, clock=self.clock, sink=sink, registry=registry,
                                 class_key=key, conversations=conversations)
            match_api_reports(h.tagger)
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

        from vllm.exceptions import VLLMValidationError

        try:
            req = CompletionRequest.model_validate(body)
            sp = req.to_sampling_params(max_tokens=1)
        except (ValidationError, VLLMValidationError):
            return False  # vLLM answers 400; the engine never sees it
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


def over_the_wire(obj: Any) -> Any:
    """``obj`` after vLLM's msgpack channel between API server and engine core
    (what cannot cross it raises here, as it does there)."""
    return MsgpackDecoder().decode(MsgpackEncoder().encode(obj))


class InProcessEngineClient:
    """Stands in for vLLM's engine client: utility calls run the engine-side
    functions, their arguments and results encoded and decoded by vLLM's own
    msgpack serializer on the way."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = engines
        self.engine_core = self
        self.calls: Counter[str] = Counter()

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        self.calls[method] += 1
        fn = engine_side._UTILITIES[method]
        return [over_the_wire(fn(e.core, *over_the_wire(list(args)))) for e in self.engines]


def make_app(
    engines: list[Engine], settings: ServingSettings, *, api_key: str | None = API_KEY, max_age_s: float = 60.0,
    clock: Any = None, api_state: Any = api_side.api_state,
) -> tuple[FastAPI, InProcessEngineClient, EngineSnapshots]:
    client = InProcessEngineClient(engines)
    kw = {"clock": clock} if clock is not None else {}
    snapshots = EngineSnapshots(max_age_s, functools.partial(api_side.call_engines, client, "wa_get_snapshot"), **kw)
    app = FastAPI()
    app.state.args = Namespace(api_key=[api_key] if api_key else None)
    app.state.engine_client = client
    max_classes = engines[0].handle.registry.max_classes
    app.include_router(make_router(settings, snapshots, max_classes, api_state))
    return app, client, snapshots


# ---- generated inputs (the fuzz tests) ---------------------------------------------------------

from hypothesis import strategies as st  # noqa: E402

RESERVED_LOOKALIKES = ["default", "other", "invalid", "default.o:stop", "other.o:tool", "Default", "text_1", "agent_3"]
_json_scalar = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    _json_scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
tag_values = st.one_of(
    st.from_regex(r"[A-Za-z0-9_.:-]{1,70}", fullmatch=True),
    st.sampled_from(RESERVED_LOOKALIKES),
    st.text(max_size=70),
    st.none(),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.lists(st.text(max_size=5), max_size=3),
    json_values,
)
class_names = st.one_of(st.from_regex(r"[A-Za-z0-9_.:-]{1,20}", fullmatch=True), st.text(max_size=20),
                        st.sampled_from(RESERVED_LOOKALIKES))
numbers = st.one_of(st.floats(), st.integers(-5, 5), st.just(10 ** 400), st.text(max_size=3), st.none())


@st.composite
def pin_bodies(draw: Any) -> bytes:
    """PUT /wa/params bodies: well-formed pins with fuzzed fields, arbitrary JSON, and raw bytes."""
    kind = draw(st.integers(0, 11))
    if kind >= 10:  # a valid pin, or back to automatic mode
        if kind == 11:
            return b'{"mode": "auto"}'
        names = draw(st.lists(st.from_regex(r"[a-z0-9_]{1,12}", fullmatch=True), max_size=8, unique=True))
        a = {n: draw(st.floats(0, 10)) for n in names}
        p = {n: draw(st.floats(0, 1)) for n in names}
        feats = draw(st.lists(st.sampled_from(["tag", "outcome", "depth", "reuse"]), unique=True, max_size=4))
        return json.dumps({"params": {"a": a, "p": p}, "features": feats}).encode()
    if kind <= 5:
        names = draw(st.lists(class_names, max_size=6))
        params: dict[str, Any] = {
            "a": {n: draw(numbers) for n in names},
            "p": {n: draw(numbers) for n in names},
        }
        for key in draw(st.sets(st.sampled_from(["L", "mode", "mixture", "default", "version", "junk"]))):
            params[key] = draw(json_values | numbers | st.sampled_from(["pr", "posterior"]))
        body: Any = {"params": params}
        if draw(st.booleans()):
            body["features"] = draw(st.lists(st.sampled_from(["tag", "outcome", "depth", "reuse", "color"]), max_size=5)
                                    | json_values)
        if draw(st.integers(0, 4)) == 0:
            body["mode"] = draw(st.sampled_from(["auto", "pinned", "sideways"]) | json_values)
        return json.dumps(body).encode()
    if kind <= 7:
        return json.dumps(draw(json_values)).encode()
    if kind == 8:
        depth = draw(st.integers(1, 3000) | st.integers(100_000, 200_000))  # deep; past 128 Ki also too big
        return ("[" * depth + "]" * depth).encode()
    return draw(st.binary(max_size=64))


# Mostly the right key (so bodies reach the parser), else anything a header can carry.
bearer_tokens = st.one_of(
    st.just(API_KEY), st.just(API_KEY), st.just(API_KEY),
    st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=20), st.none(),
)


def auth_header(token: str | None) -> dict[str, bytes]:
    return {} if token is None else {"Authorization": f"Bearer {token}".encode("utf-8", "surrogatepass")}

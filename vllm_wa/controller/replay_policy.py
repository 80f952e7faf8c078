"""The ``wa-online`` replay policy: the live controller, driven by trace time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.controller.config import ControllerConfig
from vllm_wa.controller.controller import WAController, sample_rate_for
from vllm_wa.controller.features import FeatureKey
from vllm_wa.engine_patch.block_tagger import BlockTagger
from vllm_wa.engine_patch.events import EventSink
from vllm_wa.engine_patch.free_queue import WorkloadAwareFreeQueue
from vllm_wa.engine_patch.install import install_wa_queue
from vllm_wa.params import WAParams
from vllm_wa.replay.policies import ReplayClock, ReplayPolicy
from vllm_wa.workload_classes import ClassRegistry


@dataclass
class OnlineWAPolicy(ReplayPolicy):
    """Starts from the prior (no profile) and learns during the whole replay."""

    config: ControllerConfig = field(default_factory=ControllerConfig)
    controller: WAController | None = None
    _next_refit: float | None = None

    @classmethod
    def create(cls, config: ControllerConfig | None, trace: Any = None) -> OnlineWAPolicy:
        return cls("wa-online", config=config or ControllerConfig())

    def _build(self, clock: ReplayClock, cache_blocks: int, install: Callable[[EventSink, ClassRegistry, FeatureKey], None]) -> None:
        cfg = self.config
        rate = cfg.sample_rate or sample_rate_for(cache_blocks, cfg.shadow_blocks)
        sink = EventSink(capacity=cfg.event_capacity, sample_rate=rate)
        registry = ClassRegistry(max_classes=cfg.max_classes)
        initial = next(c for c in cfg.all_candidates if c.name == cfg.initial)
        key = FeatureKey(tuple(initial.features)) if not initial.lru else FeatureKey(("tag",))
        install(sink, registry, key)

        def apply(params: WAParams, class_key: FeatureKey | None) -> None:
            if class_key is not None and self.tagger is not None:
                self.tagger.set_class_key(class_key)
            self.queue.set_params(params)

        prior = WAParams.load(cfg.seed_params) if cfg.seed_params else None
        self.controller = WAController(cfg, cache_blocks, apply, sink, clock=clock, prior=prior)

    def queue_factory(self, clock: ReplayClock) -> Callable[[list[KVCacheBlock]], Any]:
        def make(blocks: list[KVCacheBlock]) -> Any:
            def install(sink: EventSink, registry: ClassRegistry, key: FeatureKey) -> None:
                self.queue = WorkloadAwareFreeQueue(blocks, None, clock=clock, registry=registry, sink=sink)
                self.tagger = BlockTagger(self.queue, blocks, sink=sink, class_key=key)

            self._build(clock, len(blocks), install)
            return self.queue

        return make

    def install_vllm(self, block_pool: Any, clock: ReplayClock) -> None:
        def install(sink: EventSink, registry: ClassRegistry, key: FeatureKey) -> None:
            h = install_wa_queue(block_pool, None, clock=clock, sink=sink, registry=registry, class_key=key)
            self.queue, self.tagger = h.queue, h.tagger

        self._build(clock, len(block_pool.blocks), install)

    def advance(self, now: float) -> None:
        nxt = self._next_refit
        if nxt is None:
            self._next_refit = now + self.config.refit_interval_s
            return
        if now >= nxt and self.controller is not None:
            self.controller.refit()
            self._next_refit = max(nxt + self.config.refit_interval_s, now)

    def report(self) -> dict[str, Any]:
        if self.controller is None:
            return {}
        st = self.controller.state()
        return {
            "active_candidate": st["active_candidate"],
            "candidates": st["candidates"],
            "switches": st["switches"],
            "params": st["params"],
            "refits": st["refits"],
            "errors": st["errors"],
            "events_dropped": st["events_dropped"],
            "drift_events": len(st["drift_events"]),
        }

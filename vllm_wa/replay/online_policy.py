"""The ``wa-online`` replay policy: the live controller, driven by trace time.

The controller, queue and tagger are the objects ``vllm serve --wa-online``
runs; :func:`start_online` wires them the same way in both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_wa.controller.config import ControllerConfig
from vllm_wa.controller.controller import WAController, start_online
from vllm_wa.controller.features import FeatureKey
from vllm_wa.engine_patch.block_tagger import BlockTagger
from vllm_wa.engine_patch.conversations import ConversationTracker
from vllm_wa.engine_patch.events import EventSink
from vllm_wa.engine_patch.free_queue import WorkloadAwareFreeQueue
from vllm_wa.engine_patch.install import install_wa_queue
from vllm_wa.replay.policies import NO_LATE_FACTS, ReplayPolicy
from vllm_wa.sim.clock import SettableClock
from vllm_wa.workload_classes import ClassRegistry


@dataclass
class OnlineWAPolicy(ReplayPolicy):
    """Starts from the prior (no profile) and learns during the whole replay."""

    config: ControllerConfig = field(default_factory=ControllerConfig)
    controller: WAController | None = None
    # The trace file's id of each (renumbered) block id; see EventSink.
    source_ids: Any = None
    _next_refit: float | None = None
    _clock: SettableClock | None = None

    @classmethod
    def create(cls, config: ControllerConfig | None, trace: Any = None) -> OnlineWAPolicy:
        source_ids = getattr(trace, "source_ids", None)
        return cls("wa-online", config=config or ControllerConfig(), source_ids=source_ids)

    def queue_factory(self, clock: SettableClock) -> Callable[[list[KVCacheBlock]], Any]:
        self._clock = clock

        def make(blocks: list[KVCacheBlock]) -> Any:
            def install(
                sink: EventSink, registry: ClassRegistry, key: FeatureKey, conversations: ConversationTracker
            ) -> tuple[Any, Any]:
                self.queue = WorkloadAwareFreeQueue(blocks, None, clock=clock, registry=registry, sink=sink)
                self.tagger = BlockTagger(
                    self.queue, blocks, sink=sink, class_key=key, conversations=conversations,
                    remember_finished=NO_LATE_FACTS,
                )
                return self.queue, self.tagger

            self.controller = start_online(
                self.config, len(blocks), install, clock, publish=False, source_ids=self.source_ids
            )
            return self.queue

        return make

    def install_vllm(self, block_pool: Any, clock: SettableClock) -> None:
        self._clock = clock

        def install(
            sink: EventSink, registry: ClassRegistry, key: FeatureKey, conversations: ConversationTracker
        ) -> tuple[Any, Any]:
            h = install_wa_queue(
                block_pool, None, clock=clock, sink=sink, registry=registry, class_key=key, conversations=conversations
            )
            self.queue, self.tagger = h.queue, h.tagger
            return h.queue, h.tagger

        self.controller = start_online(
            self.config, len(block_pool.blocks), install, clock, publish=False, source_ids=self.source_ids
        )

    def advance(self, now: float) -> None:
        """Refit as the server's interval job does: every ``refit_interval_s``
        of trace time, idle stretches included, each refit at its own time.

        (Refitting once at the next event after a gap, as before, recorded the
        events from before it after the whole gap's forgetting.) Past
        ``max_watch_s`` of idleness every watch has expired and a refit changes
        nothing but the forgetting, which composes: the grid then jumps to the
        last refit before ``now``.
        """
        nxt = self._next_refit
        interval = self.config.refit_interval_s
        if nxt is None:
            self._next_refit = now + interval
            return
        if now < nxt or self.controller is None or self._clock is None:
            return
        clock = self._clock
        idle_limit = int(self.config.max_watch_s / interval) + 1
        done = 0
        while nxt <= now:
            if done == idle_limit:
                nxt += math.floor((now - nxt) / interval) * interval
            clock.t = nxt
            self.controller.refit()
            nxt += interval
            done += 1
        clock.t = now
        self._next_refit = nxt

    def report(self) -> dict[str, Any]:
        if self.controller is None:
            return {}
        st = self.controller.state()
        return {
            "active_candidate": st["active_candidate"],
            "candidates": st["candidates"],
            "switches": st["switches"],
            "seconds_on_candidate": st["seconds_on_candidate"],
            "params": st["params"],
            "refits": st["refits"],
            "errors": st["errors"],
            "events_dropped": st["events_dropped"],
            "drifts": sum(st["drifts"].values()),
            "finest_classes": st["finest_classes"],
            # Per candidate that ran, over the whole run: the real cache's hit
            # rate on the sampled blocks beside the candidate's prediction.
            "calibration": st["calibration"]["total"],
        }

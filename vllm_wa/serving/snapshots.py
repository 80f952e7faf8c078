"""The API server's copy of every engine core's state and metrics.

One poller fetches ``wa_get_snapshot`` from the engine cores once per
interval; ``GET /wa/params`` and ``/metrics`` read the copy.  So clients
reading ``/wa/params`` add no work to the engine loop however often they ask:
a read finds a copy at most ``max_age_s`` old, or waits for the one fetch in
flight (concurrent readers share it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

Fetch = Callable[[], Awaitable[list[dict[str, Any]]]]


class EngineSnapshots:
    """The latest snapshot of each engine core, refreshed by one fetch at a time.

    Args:
        max_age_s: a read older than this waits for a fresh fetch.
        fetch: returns one ``wa_get_snapshot`` result per engine core (set
            with :meth:`bind` once the engine client exists).
    """

    def __init__(self, max_age_s: float, fetch: Fetch | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self._fetch = fetch
        self.clock = clock
        self.engines: list[dict[str, Any]] | None = None
        self.fetched_at = -math.inf
        self.fetches = 0
        self.failures = 0
        # Called with every fetch's result (the shared metrics copy, with several API servers).
        self.on_fetch: Callable[[list[dict[str, Any]]], None] | None = None
        self._inflight: asyncio.Future[list[dict[str, Any]]] | None = None

    def bind(self, fetch: Fetch) -> None:
        self._fetch = fetch

    async def refresh(self) -> list[dict[str, Any]]:
        """Fetch now, or join the fetch in flight."""
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._do_fetch())
        return await asyncio.shield(self._inflight)

    async def _do_fetch(self) -> list[dict[str, Any]]:
        if self._fetch is None:
            raise RuntimeError("vllm-wa: no engine client yet")
        engines = await self._fetch()
        self.fetches += 1
        self.engines = engines
        self.fetched_at = self.clock()
        if self.on_fetch is not None:
            self.on_fetch(engines)
        return engines

    async def get(self) -> list[dict[str, Any]]:
        """The copy, if at most ``max_age_s`` old; else a fresh one."""
        if self.engines is not None and self.clock() - self.fetched_at <= self.max_age_s:
            return self.engines
        return await self.refresh()

    async def poll(self) -> None:
        """Refresh once per ``max_age_s`` for ever (an API-server background task)."""
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the poller must not take the server down
                self.failures += 1
                log = logger.warning if self.failures == 1 else logger.debug
                log("vllm-wa: fetching the engines' state failed (%d so far): %r", self.failures, e)
            await asyncio.sleep(self.max_age_s)

"""Polls every instance's /health and /metrics, marks instances down and up, records samples."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import aiohttp

from adapters.vllm.instances import Instance
from adapters.vllm.scrape import MetricsSample, parse_metrics

StatusChange = Callable[[Instance, bool, str], None]
SampleSink = Callable[[Instance, float], None]


class Poller:
    """One loop; each round probes all instances concurrently with short timeouts."""

    def __init__(
        self,
        instances: Callable[[], list[Instance]],
        *,
        interval_s: float,
        down_after: int,
        probe_timeout_s: float = 2.0,
        on_status: StatusChange,
        on_sample: SampleSink,
    ) -> None:
        self._instances = instances
        self.interval_s = interval_s
        self.down_after = down_after
        self.probe_timeout_s = probe_timeout_s
        self._on_status = on_status
        self._on_sample = on_sample
        self._task: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="poller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def kick(self) -> None:
        """Poll now (e.g. the proxy just saw a connection fail)."""
        self._kick.set()

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            await self.poll_once()
            self._kick.clear()
            delay = max(0.0, self.interval_s - (time.monotonic() - started))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), delay)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._probe(i) for i in self._instances()))

    async def _probe(self, inst: Instance) -> None:
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        reason = ""
        sample: MetricsSample | None = None
        try:
            assert inst.session is not None
            t0 = time.monotonic()
            async with inst.session.get("/health", timeout=timeout) as r:
                ok = r.status == 200
                reason = "" if ok else f"/health answered {r.status}"
            if ok:
                inst.health_rtt_s.append(time.monotonic() - t0)
            if ok:
                async with inst.session.get("/metrics", timeout=timeout) as r:
                    if r.status == 200:
                        inst.metrics_page = await r.text()
                        sample = parse_metrics(inst.metrics_page)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            ok = False
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        now = time.monotonic()
        if ok:
            inst.consecutive_failures = 0
            if sample is not None:
                inst.update(sample, now)
            if not inst.healthy:
                inst.healthy = True
                self._on_status(inst, True, "healthy again")
        else:
            inst.consecutive_failures += 1
            if inst.healthy and inst.consecutive_failures >= self.down_after:
                inst.healthy = False
                self._on_status(inst, False, reason)
        self._on_sample(inst, now)

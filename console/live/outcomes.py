"""What becomes of each request and instance event: counts, SLO window, metrics, events, stored rows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from console.live.events import EventBus
from console.live.metrics import GatewayMetrics
from console.live.request import Step
from core.slo import SlidingWindow

if TYPE_CHECKING:
    from adapters.vllm.instances import Instance
    from console.live.request import LiveRequest
    from core.slo import SLOClass
    from core.types import Role

SLO_WINDOW_S = 60.0
"""The sliding window of the live SLO view (the dashboard's "last 60 s")."""


class RunLog(Protocol):
    """Where the rows go (adapters.store.RunRecorder, or a list in a test)."""

    def request(self, row: dict[str, Any]) -> None:
        """One finished request."""

    def sample(self, row: dict[str, Any]) -> None:
        """One instance's /metrics sample."""

    def instance_event(self, *, t: float, instance_id: str, event: str, detail: str) -> None:
        """Something happened to an instance (up, down, added, migrated...)."""

    def policy_event(self, *, t: float, kind: str, old: str | None, new: str, params: dict[str, Any], source: str) -> None:
        """A policy became active."""


class Outcomes:
    """Request counts and the outcome of each request; instance and policy events, to the run log and the bus."""

    def __init__(self, log: RunLog, slo: dict[str, SLOClass], t0: float) -> None:
        self.log = log
        """The run's rows (SQLite through the recorder)."""
        self.t0 = t0
        """The console's start (monotonic seconds); stored times are relative to it."""
        self.events = EventBus()
        """Every event the control API streams and the dashboard logs."""
        self.metrics = GatewayMetrics()
        """The gateway's Prometheus metrics."""
        self.slo = SlidingWindow(SLO_WINDOW_S, slo)
        """SLO attainment over the last minute and the whole run."""
        self.in_flight = 0
        """Requests in the gateway now."""
        self.total = 0
        """Requests that entered the gateway since it started."""
        self.failed = 0
        """Requests that failed (errors, rejections, disconnects)."""
        self.live: dict[str, LiveRequest] = {}
        """Requests in the gateway now, by id."""
        self.idle = asyncio.Event()
        """Set while nothing is in flight (a stop waits for it, bounded)."""
        self.idle.set()
        self.metrics.in_flight.set_function(lambda: self.in_flight)  # read at scrape time, not per request

    def rel(self, t: float | None) -> float | None:
        """A monotonic time as seconds since the console started (None stays None)."""
        return None if t is None else t - self.t0

    # --- requests ------------------------------------------------------------------------------
    def started(self, live: LiveRequest) -> None:
        """`live` entered the gateway."""
        self.live[live.id] = live
        self.in_flight += 1
        self.total += 1
        self.idle.clear()

    def left(self, live: LiveRequest) -> None:
        """`live` left the gateway (its outcome is recorded by `record`)."""
        self.live.pop(live.id, None)
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    def record(self, live: LiveRequest) -> None:
        """The outcome of `live`: SLO window, event on failure or recovery, latency metrics, the stored row."""
        req = live.request
        finish = live.times[live.step]
        first = live.first_token_at
        ttft = (first - req.arrival) if live.ok and first is not None else None
        tpot = None
        if live.ok and first is not None:
            tpot = (finish - first) / (live.output_tokens - 1) if live.output_tokens > 1 else 0.0
        met = self.slo.add(finish, ttft if ttft is not None else float("inf"), tpot if tpot is not None else float("inf"), live.ok, req.slo_class)
        if not live.ok:
            self.failed += 1
            self.events.publish("failure", request_id=live.id, reason=live.reason, prefill=live.prefill_instance, decode=live.decode_instance)
        elif live.recovered is not None:  # saved after a failure (failure migration, a lost prefill's KV)
            self.events.publish("recovered", request_id=live.id, detail=live.recovered, decode=live.decode_instance)
        else:
            if ttft is not None:
                self.metrics.ttft.observe(ttft)
            if tpot is not None and live.output_tokens > 1:
                self.metrics.tpot.observe(tpot)
        self.metrics.count_request(live.prefill_instance or "-", live.decode_instance or "-", live.ok)
        self.log.request(self.request_row(live, ttft, tpot, met))

    def request_row(self, live: LiveRequest, ttft: float | None, tpot: float | None, met: bool | None) -> dict[str, Any]:
        """The stored row of a finished request (times relative to the console's start)."""
        req, rel = live.request, self.rel
        finish = live.times[live.step]
        return {
            "request_id": live.id,
            "arrival": rel(req.arrival),
            "prompt_tokens": req.prompt_tokens,
            "output_tokens": live.output_tokens,
            "max_tokens": req.max_tokens,
            "slo_class": req.slo_class,
            "priority": req.priority,
            "prefill_instance": live.prefill_instance,
            "decode_instance": live.decode_instance,
            "dp_rank": live.dp_rank,
            "queued": rel(live.at(Step.QUEUED)),
            "prefill_start": rel(live.at(Step.PREFILL)),
            "prefill_end": rel(live.at(Step.DECODE_BOUND)),
            "decode_start": rel(live.at(Step.DECODING)),
            "first_token": rel(live.first_token_at),
            "finish": rel(finish),
            "ttft": ttft,
            "tpot": tpot,
            "e2e": finish - req.arrival if live.ok else None,
            "status": "ok" if live.ok else "failed",
            "reason": live.reason,
            "slo_met": met,
        }

    # --- instances and policies ------------------------------------------------------------------
    def instance_event(self, instance_id: str, role: Role | None, event: str, detail: str, source: str = "") -> None:
        """Something happened to an instance: stored and published."""
        t = time.monotonic() - self.t0
        text = f"{detail} [{source}]" if source else detail
        self.log.instance_event(t=t, instance_id=instance_id, event=event, detail=text)
        self.events.publish("instance", instance=instance_id, role=role.value if role else None, event=event, detail=detail, source=source, t=t)

    def instance_up(self, inst: Instance, up: bool) -> None:
        """The `sibyl_instance_up` gauge of `inst` under its current role."""
        self.metrics.instance_up.labels(instance=inst.id, role=inst.role.value).set(1 if up else 0)

    def sample(self, inst: Instance, now: float) -> None:
        """Store the instance's latest /metrics sample."""
        s = inst.sample
        self.log.sample(
            {
                "t": now - self.t0,
                "instance_id": inst.id,
                "role": inst.role.value,
                "healthy": inst.healthy,
                "running": s.running,
                "waiting": s.waiting,
                "kv_usage": s.kv_usage,
                "tokens_per_s": inst.tokens_per_s,
                "projected_load": None,
            }
        )

    def policy_active(self, kind: str, name: str, params: dict[str, Any]) -> None:
        """The `sibyl_policy` info metric of one kind."""
        self.metrics.policy.labels(kind=kind).info({"name": name, "params": str(params)})

    def policy_swapped(self, t: float, kind: str, old: str | None, new: str, params: dict[str, Any], source: str) -> None:
        """A policy swap: stored, shown as the active policy's metric, published."""
        self.log.policy_event(t=t, kind=kind, old=old, new=new, params=params, source=source)
        self.policy_active(kind, new, params)
        self.events.publish("policy", kind=kind, old=old, new=new, params=params, source=source, t=t)

    # --- views -----------------------------------------------------------------------------------
    def publish_attainment(self, now: float) -> None:
        """Set the attainment gauges (last minute, run) from the SLO window."""
        snap = self.slo.snapshot(now)
        if snap["window"]["attainment"] is not None:
            self.metrics.attainment.labels(window="60s").set(snap["window"]["attainment"])
        if snap["run"]["attainment"] is not None:
            self.metrics.attainment.labels(window="run").set(snap["run"]["attainment"])

    def summary(self, now: float, instances: Iterable[Instance]) -> dict[str, Any]:
        """The run's closing summary: SLO over the run, request counts, health round trips."""
        snap = self.slo.snapshot(now)["run"]
        rtt = {i.id: float(np.median(i.health_rtt_s)) for i in instances if i.health_rtt_s}
        return {**snap, "requests_total": self.total, "failed": self.failed, "health_rtt_s": rtt}

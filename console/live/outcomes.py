"""What becomes of each request and instance event: counts, SLO window, metrics, events, stored rows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from console.live.events import EventBus
from console.live.metrics import GatewayMetrics
from console.live.record import Outcome, RequestRecord, RequestRow, Step
from core.slo import SlidingWindow

if TYPE_CHECKING:
    from adapters.vllm.instances import Instance
    from core.slo import SLOClass
    from core.types import Request, Role

SLO_WINDOW_S = 60.0
"""The sliding window of the live SLO view (the dashboard's "last 60 s")."""
TTFT_FROM_TOKEN = "first_token"
"""`ttft_source` of a streamed reply: TTFT ends when its first token reached the gateway."""
TTFT_FROM_PREFILL = "prefill_end"
"""`ttft_source` of a whole (non-streamed) reply: TTFT ends when its prefill leg returned."""


@dataclass(frozen=True, slots=True)
class Latencies:
    """What the gateway measured of one request; None where nothing was measured."""

    ttft: float | None = None
    tpot: float | None = None
    ttft_source: str | None = None
    """TTFT_FROM_TOKEN, TTFT_FROM_PREFILL, or None when TTFT is unknown."""
    handoff: float | None = None
    """Prefill leg's end to the first decode token (streamed replies only)."""


def latencies(live: RequestRecord) -> Latencies:
    """TTFT, TPOT and the P/D hand-off of a finished request, from what the gateway saw.

    A streamed reply: TTFT = first token relayed − arrival; TPOT = (last − first token) / (tokens − 1)
    (0 for one token); hand-off = first token − prefill leg's end.
    A whole (non-streamed) reply reaches the gateway in one piece, so no token time is seen: its TPOT
    is unknown (None, left out of TPOT attainment and the TPOT histogram) and its TTFT is taken at the
    end of its prefill leg — the prefill instance returns only after computing the prompt and sampling
    the first token, so that is a measured time at which the first token existed. It leaves out the
    KV hand-off and the decode instance's first step that a streamed TTFT includes: a lower bound of
    what the same request would have measured streamed. The row says which (`ttft_source`).
    A whole reply without a prefill leg (its decode instance computed the prompt) has neither.
    A failed request has neither (it misses its SLO whatever they were)."""
    if not live.ok:
        return Latencies()
    arrival = live.request.arrival
    prefill_end = live.times.get(Step.DECODE_BOUND)
    first = live.first_token_at
    if first is not None:
        finish = live.finish
        tpot = (finish - first) / (live.output_tokens - 1) if live.output_tokens > 1 else 0.0
        handoff = first - prefill_end if prefill_end is not None and first >= prefill_end else None
        return Latencies(first - arrival, tpot, TTFT_FROM_TOKEN, handoff)
    if not live.stream and prefill_end is not None and Step.PREFILL in live.times:
        return Latencies(prefill_end - arrival, None, TTFT_FROM_PREFILL)
    return Latencies()


def decisions(live: RequestRecord) -> list[tuple[str, str]]:
    """The (policy kind, outcome) of each decision taken on a request, read from its record when it leaves.

    queue: held (the queue policy held it), then expired (its ttl ran out), abandoned (its client left
    while held) or released; shed (turned away at arrival, queue full). routing: routed (a prefill
    instance was chosen), prefill_retried (a second prefill instance after the first failed),
    failed_over (continued on another decode instance after one failed), no_capacity (no instance to
    route to, at arrival or at prefill end)."""
    out: list[tuple[str, str]] = []
    outcome = live.outcome
    if Step.QUEUED in live.times:
        out.append(("queue", "held"))
        if outcome is Outcome.ABANDONED:
            return [*out, ("queue", "abandoned")]
        if outcome is Outcome.EXPIRED:
            return [*out, ("queue", "expired")]
    elif outcome is Outcome.TENANT_LIMIT:  # refused by its tenant's own limits (console/live/tenants.py counts those)
        return []
    elif outcome is Outcome.SHED:
        return [("queue", "shed")]
    if live.prefill_instance is not None:
        out.append(("routing", "routed"))
        if live.tried_prefill and len({*live.tried_prefill, live.prefill_instance}) > 1:
            out.append(("routing", "prefill_retried"))
        if live.tried_decode and len({*live.tried_decode, live.decode_instance}) > 1:
            out.append(("routing", "failed_over"))
    if outcome is Outcome.NO_CAPACITY:
        out.append(("routing", "no_capacity"))
    return out


class RunLog(Protocol):
    """Where the rows go (adapters.store.RunRecorder, or a list in a test)."""

    def request(self, row: RequestRow) -> None:
        """One finished request."""

    def sample(self, row: dict[str, Any]) -> None:
        """One instance's /metrics sample."""

    def instance_event(self, *, t: float, instance_id: str, event: str, detail: str) -> None:
        """Something happened to an instance (up, down, added, migrated...)."""

    def policy_event(
        self,
        *,
        t: float,
        kind: str,
        old: str | None,
        new: str,
        params: dict[str, Any],
        source: str,
        pool: str | None = None,
    ) -> None:
        """A policy became active in pool `pool`."""


class InstanceLog(Protocol):
    """Where what happens to an instance is told (Outcomes: the run store and the event bus)."""

    def instance_event(self, instance_id: str, role: Role | None, event: str, detail: str, source: str = "") -> None:
        """Something happened to an instance: stored and published."""


class OutcomeSink(Protocol):
    """Where a live request's record goes as it enters and leaves the gateway (Outcomes)."""

    def started(self, live: RequestRecord) -> None:
        """The request entered the gateway (counted in flight)."""

    def left(self, live: RequestRecord) -> None:
        """The request left the gateway."""

    def record(self, live: RequestRecord) -> bool:
        """Its outcome, recorded once; whether it met its SLO."""


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
        self.live: dict[str, RequestRecord] = {}
        """The records of the requests in the gateway now, by id."""
        self.idle = asyncio.Event()
        """Set while nothing is in flight (a stop waits for it, bounded)."""
        self.idle.set()
        self.metrics.in_flight.set_function(lambda: self.in_flight)  # read at scrape time, not per request
        self.active: dict[tuple[str, str], str] = {}
        """The active policy's name of each (pool, kind) (a pool's decisions are counted under its pool's)."""
        self.pool_of: Callable[[RequestRecord], str] = lambda live: live.model
        """The name of the pool a request ran on (the controller maps each base model to its pool's name)."""
        self.tenant_of: Callable[[Request], str] = lambda _: "default"
        """The tenant a request is charged to (the controller's tenants say)."""
        self.counted_refusal: Callable[[RequestRecord], bool] = lambda _: False
        """Whether a failed request's refusal is told by a refusal line of its cause (console/live/refusals.py)
        rather than a failure event of its own (the controller sets it while SLO admission counts refusals)."""

    def rel(self, t: float | None) -> float | None:
        """A monotonic time as seconds since the console started (None stays None)."""
        return None if t is None else t - self.t0

    # --- requests ------------------------------------------------------------------------------
    def started(self, live: RequestRecord) -> None:
        """The request entered the gateway."""
        self.live[live.id] = live
        self.in_flight += 1
        self.total += 1
        self.idle.clear()

    def left(self, live: RequestRecord) -> None:
        """The request left the gateway (its outcome is recorded by `record`)."""
        self.live.pop(live.id, None)
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    def record(self, live: RequestRecord) -> bool:
        """The outcome of a finished request: SLO window, event on failure or recovery, metrics, the stored row.
        Returns whether it met its SLO."""
        req = live.request
        finish, ok = live.finish, live.ok
        lat = latencies(live)
        met = self.slo.add(finish, lat.ttft, lat.tpot, ok, req.slo_class)
        if not ok:
            self.failed += 1
            if not self.counted_refusal(live):  # else its cause's refusal line counts it
                self.events.publish(
                    "failure",
                    request_id=live.id,
                    reason=live.reason,
                    prefill=live.prefill_instance,
                    decode=live.decode_instance,
                )
        elif live.recovered is not None:  # saved after a failure (failure migration, a lost prefill's KV)
            self.events.publish("recovered", request_id=live.id, detail=live.recovered, decode=live.decode_instance)
        self.observe(live, lat, met, ok, finish)
        self.metrics.count_request(live.prefill_instance or "-", live.decode_instance or "-", ok)
        self.log.request(self.request_row(live, lat, met, ok, finish))
        return met

    def observe(self, live: RequestRecord, lat: Latencies, met: bool, ok: bool, finish: float) -> None:
        """The request's latencies into its SLO class's histograms, and its decisions into their counters
        (`ok` and `finish`: the record's own, read once by `record`)."""
        m = self.metrics.of_class(live.request.slo_class)
        sent = live.times.get(Step.PREFILL)
        if sent is not None:
            m.queue_wait.observe(max(sent - live.request.arrival, 0.0))
        if ok:
            (m.met if met else m.missed).inc()
            m.e2e.observe(finish - live.request.arrival)
            if lat.ttft is not None:
                m.ttft.observe(lat.ttft)
            if lat.tpot is not None and live.output_tokens > 1:
                m.tpot.observe(lat.tpot)
            if lat.handoff is not None:
                m.handoff.observe(lat.handoff)
            if lat.ttft_source == TTFT_FROM_PREFILL:
                m.whole.inc()
        else:
            m.failed.inc()
        pool = self.pool_of(live)
        for kind, outcome in decisions(live):
            self.metrics.count_decision(pool, kind, self.active.get((pool, kind), "-"), outcome)

    def request_row(self, live: RequestRecord, lat: Latencies, met: bool | None, ok: bool, finish: float) -> RequestRow:
        """The stored row of a finished request (times relative to the console's start; `ok` and `finish`: the
        record's own, read once by `record`)."""
        req, rel, at = live.request, self.rel, live.times.get
        return RequestRow(
            request_id=live.id,
            arrival=req.arrival - self.t0,
            prompt_tokens=req.prompt_tokens,
            output_tokens=live.output_tokens,
            max_tokens=req.max_tokens,
            slo_class=req.slo_class,
            priority=req.priority,
            prefill_instance=live.prefill_instance,
            decode_instance=live.decode_instance,
            dp_rank=live.dp_rank,
            queued=rel(at(Step.QUEUED)),
            prefill_start=rel(at(Step.PREFILL)),
            prefill_end=rel(at(Step.DECODE_BOUND)),
            decode_start=rel(at(Step.DECODING)),
            first_token=rel(live.first_token_at),
            finish=finish - self.t0,
            ttft=lat.ttft,
            tpot=lat.tpot,
            ttft_source=lat.ttft_source,
            cached_tokens=live.cached_tokens,
            e2e=finish - req.arrival if ok else None,
            status="ok" if ok else "failed",
            reason=live.reason,
            slo_met=met,
            tenant=self.tenant_of(req),
            model=live.model or None,
            lora=req.lora,
            arm=live.arm,
            session=req.session or None,
            prefix_keys=req.prefix_keys or None,
        )

    # --- instances and policies ------------------------------------------------------------------
    def instance_event(self, instance_id: str, role: Role | None, event: str, detail: str, source: str = "") -> None:
        """Something happened to an instance: stored and published."""
        t = time.monotonic() - self.t0
        text = f"{detail} [{source}]" if source else detail
        self.log.instance_event(t=t, instance_id=instance_id, event=event, detail=text)
        self.events.publish(
            "instance",
            instance=instance_id,
            role=role.value if role else None,
            event=event,
            detail=detail,
            source=source,
            t=t,
        )

    def instance_up(self, inst: Instance, up: bool) -> None:
        """The `sibyl_instance_up` gauge of `inst` under its current role."""
        self.metrics.instance_up.labels(instance_id=inst.id, role=inst.role.value).set(1 if up else 0)

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
                "health_rtt_s": inst.health_rtt_median(),
            }
        )

    def policy_active(self, kind: str, name: str, params: dict[str, Any], *, pool: str) -> None:
        """The `sibyl_policy` info metric of one kind in pool `pool` (and the name its decisions are counted under)."""
        self.active[(pool, kind)] = name
        self.metrics.policy_active(pool, kind, name, str(params))

    def policy_swapped(
        self, t: float, kind: str, old: str | None, new: str, params: dict[str, Any], source: str, *, pool: str
    ) -> None:
        """A policy swap in pool `pool`: stored, shown as the active policy's metric, published (naming the pool)."""
        self.log.policy_event(t=t, kind=kind, old=old, new=new, params=params, source=source, pool=pool)
        self.policy_active(kind, new, params, pool=pool)
        self.metrics.policy_swapped(pool, kind)
        self.events.publish("policy", kind=kind, old=old, new=new, params=params, source=source, t=t, pool=pool)

    # --- views -----------------------------------------------------------------------------------
    def publish_attainment(self, now: float) -> None:
        """Set the attainment gauges (last minute, run) from the SLO window (NaN while nothing finished in it)."""
        snap = self.slo.snapshot(now)
        for window, key in (("60s", "window"), ("run", "run")):
            value = snap[key]["attainment"]
            self.metrics.attainment.labels(window=window).set(float("nan") if value is None else value)

    def summary(self, now: float, instances: Iterable[Instance]) -> dict[str, Any]:
        """The run's closing summary: SLO over the run, request counts, health round trips."""
        snap = self.slo.snapshot(now)["run"]
        rtt = {i.id: m for i in instances if (m := i.health_rtt_median()) is not None}
        return {**snap, "requests_total": self.total, "failed": self.failed, "health_rtt_s": rtt}

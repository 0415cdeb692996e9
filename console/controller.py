"""The running console: backend instances, dispatcher, poller, recorder, SLO window, events, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adapters.store import RunRecorder, RunStore
from console.config import ConsoleConfig
from console.events import EventBus
from console.gateway_metrics import GatewayMetrics
from console.instances import Instance
from console.poller import Poller
from core.dispatch import Dispatcher
from core.errors import SibylError
from core.perf import get_profile
from core.policies import registry
from core.slo import SlidingWindow
from core.types import PolicyEvent, Role


class ScaleError(SibylError):
    """A scale request the backend cannot carry out."""


@dataclass
class RequestOutcome:
    """What the proxy learned about one request, in monotonic seconds."""

    request_id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    slo_class: str
    priority: int
    prefill_instance: str | None
    decode_instance: str | None
    prefill_start: float | None
    prefill_end: float | None
    decode_start: float | None
    first_token: float | None
    finish: float
    output_tokens: int
    ok: bool
    reason: str | None = None


class Controller:
    """Owns everything a live console runs; the gateway and the dashboard talk to it."""

    def __init__(
        self,
        config: ConsoleConfig,
        instances: list[Instance],
        *,
        store: RunStore,
        run_id: str,
        run_dir: Path,
        backend_label: str | None = None,
        backend: Any = None,
    ) -> None:
        self.config = config
        self.instances = {i.id: i for i in instances}
        self.profile = get_profile(config.profile)
        self.dispatcher = Dispatcher(self.profile, config.policy, config.params)
        for inst in instances:
            self.dispatcher.add_instance(inst.id, inst.role)
        self.store = store
        self.run_id = run_id
        self.run_dir = run_dir
        self.backend = backend_label or config.backend
        self._backend = backend
        """The backend object; it can scale when it has async add(role, id) and remove(id)."""
        self._draining_out: set[str] = set()
        self.recorder = RunRecorder(store, run_id)
        self.events = EventBus()
        self.metrics = GatewayMetrics()
        self.slo = SlidingWindow(60.0, config.slo)
        self.served_models: set[str] = {config.served_model_name}
        self.max_model_len: int | None = None
        """The smallest context length the instances report (None when they do not say)."""
        self.token = os.environ.get("SIBYL_TOKEN") or secrets.token_urlsafe(32)
        self.t0 = time.monotonic()
        self.started_wall = time.time()
        self.in_flight = 0
        self.total = 0
        self.failed = 0
        self.poller = Poller(
            lambda: list(self.instances.values()),
            interval_s=config.poll_interval_s,
            down_after=config.down_after_failures,
            probe_timeout_s=config.probe_timeout_s,
            on_status=self._on_status,
            on_sample=self._on_sample,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.replay: Any = None
        """The Replayer started by `up --replay`, if any (console.replay.Replayer)."""
        self.replay_label = ""
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False
        for kind, policy in self.dispatcher.policies.items():
            self.metrics.policy.labels(kind=kind.value).info({"name": policy.name, "params": str(policy.params.model_dump())})

    # --- lifecycle -----------------------------------------------------------------------------
    def write_token(self) -> Path:
        """The control token, readable by the owner only."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        return path

    async def start(self) -> None:
        for inst in self.instances.values():
            inst.open(connect_timeout_s=self.config.connect_timeout_s)
            self.metrics.instance_up.labels(instance=inst.id, role=inst.role.value).set(1)
        await self._discover_models()
        first = self.dispatcher.policy_events[0]
        self.recorder.policy_event(t=0.0, kind=first.kind.value, old=None, new=first.new, params=first.params, source="config")
        await self.poller.poll_once()
        self.poller.start()
        self._tasks.append(asyncio.create_task(self._publish_state(), name="state-publisher"))

    async def _discover_models(self) -> None:
        for inst in self.instances.values():
            with contextlib.suppress(Exception):
                assert inst.session is not None
                async with inst.session.get("/v1/models") as r:
                    if r.status == 200:
                        data = await r.json()
                        for m in data.get("data", []):
                            if "id" in m:
                                self.served_models.add(m["id"])
                            if isinstance(m.get("max_model_len"), int):
                                old = self.max_model_len
                                self.max_model_len = m["max_model_len"] if old is None else min(old, m["max_model_len"])

    async def stop(self, status: str = "completed") -> None:
        """Drain in-flight requests (bounded), stop polling, close clients and the run record."""
        self.draining = True
        if self.in_flight:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), self.config.drain_timeout_s)
        await self.poller.stop()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for inst in self.instances.values():
            await inst.close()
        self.recorder.close(status=status, summary=self.summary())

    # --- time ----------------------------------------------------------------------------------
    def rel(self, t: float | None) -> float | None:
        return None if t is None else t - self.t0

    # --- policies ------------------------------------------------------------------------------
    def set_policy(self, kind: str, name: str, params: dict[str, Any] | None, source: str) -> PolicyEvent:
        ev = self.dispatcher.set_policy(kind, name, params, source=source, now=time.monotonic())
        rel = ev.time - self.t0
        self.recorder.policy_event(t=rel, kind=ev.kind.value, old=ev.old, new=ev.new, params=ev.params, source=source)
        self.metrics.policy.labels(kind=ev.kind.value).info({"name": ev.new, "params": str(ev.params)})
        self.events.publish("policy", kind=ev.kind.value, old=ev.old, new=ev.new, params=ev.params, source=source, t=rel)
        return ev

    def policy_catalog(self) -> list[dict[str, Any]]:
        return [
            {"kind": s.kind.value, "name": s.name, "summary": s.summary, "params_schema": s.schema(), "defaults": s.defaults()}
            for s in registry.specs()
        ]

    # --- request accounting (called by the proxy) ------------------------------------------------
    def request_started(self) -> None:
        self.in_flight += 1
        self.total += 1
        self._idle.clear()
        self.metrics.in_flight.set(self.in_flight)

    def request_done(self, o: RequestOutcome) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
        if self.in_flight == 0:
            self._idle.set()
        ttft = (o.first_token - o.arrival) if o.ok and o.first_token is not None else None
        tpot = None
        if o.ok and o.first_token is not None:
            tpot = (o.finish - o.first_token) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0
        met = self.slo.add(o.finish, ttft if ttft is not None else float("inf"), tpot if tpot is not None else float("inf"), o.ok, o.slo_class)
        if not o.ok:
            self.failed += 1
            self.events.publish("failure", request_id=o.request_id, reason=o.reason, prefill=o.prefill_instance, decode=o.decode_instance)
        else:
            if ttft is not None:
                self.metrics.ttft.observe(ttft)
            if tpot is not None and o.output_tokens > 1:
                self.metrics.tpot.observe(tpot)
        self.metrics.requests.labels(prefill=o.prefill_instance or "-", decode=o.decode_instance or "-", outcome="ok" if o.ok else "failed").inc()
        self.recorder.request(
            {
                "request_id": o.request_id,
                "arrival": self.rel(o.arrival),
                "prompt_tokens": o.prompt_tokens,
                "output_tokens": o.output_tokens,
                "max_tokens": o.max_tokens,
                "slo_class": o.slo_class,
                "priority": o.priority,
                "prefill_instance": o.prefill_instance,
                "decode_instance": o.decode_instance,
                "prefill_start": self.rel(o.prefill_start),
                "prefill_end": self.rel(o.prefill_end),
                "decode_start": self.rel(o.decode_start),
                "first_token": self.rel(o.first_token),
                "finish": self.rel(o.finish),
                "ttft": ttft,
                "tpot": tpot,
                "e2e": o.finish - o.arrival if o.ok else None,
                "status": "ok" if o.ok else "failed",
                "reason": o.reason,
                "slo_met": met,
            }
        )

    # --- scaling ------------------------------------------------------------------------------------
    @property
    def can_scale(self) -> bool:
        return hasattr(self._backend, "add") and hasattr(self._backend, "remove")

    def _next_id(self, role: Role) -> str:
        prefix = role.value[0]
        used = [int(i[1:]) for i in self.dispatcher.view.instance_ids if i[0] == prefix and i[1:].isdigit()]
        return f"{prefix}{max(used, default=-1) + 1}"

    async def scale(self, role: str, delta: int, source: str = "api") -> dict[str, Any]:
        """Add `delta` instances of a role (or remove -delta: routing stops at once, the process after draining)."""
        if not self.can_scale:
            raise ScaleError(f"the {self.backend} backend cannot add or remove instances")
        if role not in ("prefill", "decode") or not isinstance(delta, int) or delta == 0:
            raise ScaleError('expected {"role": "prefill"|"decode", "delta": a non-zero integer}')
        r = Role(role)
        changed: list[str] = []
        if delta > 0:
            for _ in range(delta):
                iid = self._next_id(r)
                inst = await self._backend.add(r, iid)
                inst.open(connect_timeout_s=self.config.connect_timeout_s)
                self.instances[iid] = inst
                self.dispatcher.add_instance(iid, r)
                self.metrics.instance_up.labels(instance=iid, role=r.value).set(1)
                self._instance_event(inst, "added", source)
                changed.append(iid)
            return {"role": role, "delta": delta, "instances": changed}
        active = [i for i in self.instances.values() if i.role == r and i.id not in self._draining_out]
        if len(active) + delta < 1:
            raise ScaleError(f"at least one {role} instance must remain ({len(active)} active)")
        for inst in active[delta:]:
            self._draining_out.add(inst.id)
            self.dispatcher.remove_instance(inst.id)
            self.metrics.instance_up.labels(instance=inst.id, role=r.value).set(0)
            self._instance_event(inst, "removed", source)
            changed.append(inst.id)
            self._tasks.append(asyncio.create_task(self._retire(inst), name=f"retire-{inst.id}"))
        return {"role": role, "delta": delta, "instances": changed}

    async def _retire(self, inst: Instance) -> None:
        """Wait (bounded) until nothing routed to the instance is in flight, then stop it."""
        idx = self.dispatcher.index_of(inst.id)
        view = self.dispatcher.view
        deadline = time.monotonic() + max(self.config.drain_timeout_s, 1.0)
        while (view.running_n[idx] or view.pending_n[idx]) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self.instances.pop(inst.id, None)
        await inst.close()
        await self._backend.remove(inst.id)
        self._draining_out.discard(inst.id)

    def _instance_event(self, inst: Instance, event: str, detail: str) -> None:
        self.recorder.instance_event(t=time.monotonic() - self.t0, instance_id=inst.id, event=event, detail=detail)
        self.events.publish("instance", instance=inst.id, role=inst.role.value, event=event, detail=detail)

    def upstream_failed(self, instance_id: str) -> None:
        """The proxy could not talk to an instance: poll now instead of waiting for the next round."""
        if instance_id in self.instances:
            self.instances[instance_id].failed += 1
        self.poller.kick()

    # --- poller callbacks --------------------------------------------------------------------------
    def _on_status(self, inst: Instance, healthy: bool, reason: str) -> None:
        self.dispatcher.set_health(inst.id, healthy)
        self.metrics.instance_up.labels(instance=inst.id, role=inst.role.value).set(1 if healthy else 0)
        event = "up" if healthy else "down"
        self.recorder.instance_event(t=self.rel(time.monotonic()) or 0.0, instance_id=inst.id, event=event, detail=reason)
        self.events.publish("instance", instance=inst.id, role=inst.role.value, event=event, detail=reason)

    def _on_sample(self, inst: Instance, now: float) -> None:
        self.dispatcher.observe_instance(inst.state())
        s = inst.sample
        self.recorder.sample(
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

    # --- views -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        now = time.monotonic()
        self.dispatcher.view.now = now
        loads = self.dispatcher.projected_loads()
        d = self.dispatcher.view
        instances = []
        for inst in self.instances.values():
            idx = self.dispatcher.index_of(inst.id)
            s = inst.sample
            instances.append(
                {
                    "id": inst.id,
                    "role": inst.role.value,
                    "url": inst.url,
                    "healthy": inst.healthy,
                    "running": int(s.running),
                    "waiting": int(s.waiting),
                    "kv_usage": s.kv_usage,
                    "tokens_per_s": inst.tokens_per_s,
                    "projected_load": loads.get(inst.id),
                    "routed_running": int(d.running_n[idx]),
                    "routed_pending": int(d.pending_n[idx]),
                    "failures": inst.failed,
                    "pid": inst.pid,
                    "scraped": {  # the instance's own cumulative counters at the last /metrics scrape
                        "prompt_tokens_total": s.prompt_tokens_total,
                        "generation_tokens_total": s.generation_tokens_total,
                        "success_total": s.success_total,
                        "preemptions_total": s.preemptions_total,
                        "failed_transfers_total": s.failed_transfers_total,
                    },
                }
            )
        n_p = sum(1 for i in self.instances.values() if i.role.serves_prefill())
        n_d = sum(1 for i in self.instances.values() if i.role.serves_decode())
        return {
            "run_id": self.run_id,
            "backend": self.backend,
            "cluster": f"{n_p}P{n_d}D",
            "model": sorted(self.served_models),
            "uptime_s": now - self.t0,
            "started_at": self.started_wall,
            "instances": instances,
            "policies": self.dispatcher.active_policies(),
            "slo": {"classes": {k: v.model_dump() for k, v in self.config.slo.items()}, **self.slo.snapshot(now)},
            "requests": {"in_flight": self.in_flight, "total": self.total, "failed": self.failed},
            "assignment_ratio": self.dispatcher.assignment_ratios()["active"],
            "draining": self.draining,
            "replay": {**self.replay.snapshot(), "label": self.replay_label} if self.replay is not None else None,
            "capabilities": {"scale": self.can_scale, "replay": self.replay is not None},
        }

    def summary(self) -> dict[str, Any]:
        snap = self.slo.snapshot(time.monotonic())["run"]
        rtt = {i.id: float(np.median(i.health_rtt_s)) for i in self.instances.values() if i.health_rtt_s}
        return {**snap, "requests_total": self.total, "failed": self.failed, "health_rtt_s": rtt}

    async def _publish_state(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            snap = self.slo.snapshot(time.monotonic())
            if snap["window"]["attainment"] is not None:
                self.metrics.attainment.labels(window="60s").set(snap["window"]["attainment"])
            if snap["run"]["attainment"] is not None:
                self.metrics.attainment.labels(window="run").set(snap["run"]["attainment"])
            self.events.publish("state", state=self.state())


def role_of(text: str) -> Role:
    return Role(text)

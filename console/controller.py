"""The running console's wiring: backend, dispatcher, poller, periodic policies, recorder, events, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from pathlib import Path
from typing import Any

import numpy as np

from adapters.backends import Backend, Capability
from adapters.backends.base import require
from adapters.store import RunRecorder, RunStore
from adapters.vllm.instances import Instance
from adapters.vllm.poller import Poller
from console.breaker import BreakerState, CircuitBreaker
from console.config import ConsoleConfig
from console.errors import ConsoleError
from console.events import EventBus
from console.gateway_metrics import GatewayMetrics
from console.live_request import LiveRequest, Rejected, Step
from console.scaler import Scaler
from core.dispatch import Dispatcher
from core.errors import ConfigError, PolicyError, SibylError
from core.perf import get_profile
from core.policies import registry
from core.slo import SlidingWindow
from core.types import PolicyEvent, PolicyKind, Role, ScaleAction

PERIODIC_TICK_S = 0.1
"""How often the controller expires queued requests and asks whether periodic policies are due."""


class ScaleError(ConsoleError):
    """A scale request the backend cannot carry out."""


POLICY_NEEDS: dict[PolicyKind, Capability] = {
    PolicyKind.RESCHEDULE: Capability.MIGRATION,
    PolicyKind.SCALING: Capability.SCALE,
    PolicyKind.RANK: Capability.DATA_PARALLEL,
}
"""Policies that act through the backend: any but the do-nothing baseline needs this capability."""


RANK_IMBALANCED, RANK_BALANCED = 1.5, 1.2
"""Straggler factors (busiest rank / mean) at which a DP group is reported imbalanced, then balanced again."""


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
        backend: Backend,
    ) -> None:
        self.config = config
        self.instances = {i.id: i for i in instances}
        self.profile = get_profile(config.profile)
        self.backend = backend
        self.dispatcher = Dispatcher(
            self.profile, config.policy, config.params,
            queue=(config.queue.name, config.queue.params),
            reschedule=(config.reschedule.name, config.reschedule.params),
            scaling=(config.scaling.name, config.scaling.params),
            rank=(config.rank.name, config.rank.params),
            slo=config.slo,
        )
        for kind in POLICY_NEEDS:
            check_capability(backend, kind, self.dispatcher.policies[kind].name)
        self._imbalanced: set[str] = set()
        """Data-parallel groups last reported imbalanced (see _watch_ranks)."""
        self.engine_priorities = Capability.PRIORITY in backend.capabilities
        """Whether the instances order their queues by `priority` (a queue policy may then set it)."""
        for inst in instances:
            self.dispatcher.add_instance(inst.id, inst.role)
            self.track_data_parallel(inst)
        self.store = store
        self.run_id = run_id
        self.run_dir = run_dir
        self.recorder = RunRecorder(store, run_id)
        self.events = EventBus()
        self.metrics = GatewayMetrics()
        self.metrics.in_flight.set_function(lambda: self.in_flight)  # read at scrape time, not per request
        self.metrics.queue_depth.set_function(lambda: len(self._held))
        self.slo = SlidingWindow(60.0, config.slo)
        self.scaler = Scaler(self)
        self.served_models: set[str] = {config.served_model_name}
        self.max_model_len: int | None = None
        """The smallest context length the instances report (None when they do not say)."""
        self.token = os.environ.get("SIBYL_TOKEN") or secrets.token_urlsafe(32)
        self.t0 = time.monotonic()
        self.started_wall = time.time()
        self.in_flight = 0
        self.total = 0
        self.failed = 0
        self.breakers: dict[str, CircuitBreaker] = {}
        """Per-instance circuit breakers (console/breaker.py), made on an instance's first failure."""
        self._held: dict[str, LiveRequest] = {}
        self._migrations: set[asyncio.Task[None]] = set()
        self.live: dict[str, LiveRequest] = {}
        """Requests in the gateway now, by id."""
        self._lost: dict[str, asyncio.Future[None]] = {}
        """Per instance, a future done when it is marked down (see lost_signal)."""
        """Requests the queue policy holds, by id (their futures are resolved on release)."""
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
        for ev in self.dispatcher.policy_events:
            self.recorder.policy_event(t=0.0, kind=ev.kind.value, old=None, new=ev.new, params=ev.params, source="config")
        await self.poller.poll_once()
        self.poller.start()
        self.backend.on_lost(self.instance_lost)  # backends that see instances die (ray: actor or node)
        self.dispatcher.start_periodic(time.monotonic())
        self._tasks.append(asyncio.create_task(self._publish_state(), name="state-publisher"))
        self._tasks.append(asyncio.create_task(self._periodic(), name="periodic-policies"))

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
        """Drain in-flight requests (bounded), stop polling and periodic work, close clients and the run record."""
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
        await self.scaler.stop()
        for inst in self.instances.values():
            await inst.close()
        self.recorder.close(status=status, summary=self.summary())

    # --- time ----------------------------------------------------------------------------------
    def rel(self, t: float | None) -> float | None:
        return None if t is None else t - self.t0

    # --- policies ------------------------------------------------------------------------------
    def set_policy(self, kind: str, name: str, params: dict[str, Any] | None, source: str) -> PolicyEvent:
        try:
            k = PolicyKind(kind)
        except ValueError:
            raise PolicyError(f"unknown policy kind {kind!r}; kinds: {', '.join(PolicyKind)}") from None
        check_capability(self.backend, k, name)
        ev = self.dispatcher.set_policy(k, name, params, source=source, now=time.monotonic())
        rel = ev.time - self.t0
        self.recorder.policy_event(t=rel, kind=ev.kind.value, old=ev.old, new=ev.new, params=ev.params, source=source)
        self.metrics.policy.labels(kind=ev.kind.value).info({"name": ev.new, "params": str(ev.params)})
        self.events.publish("policy", kind=ev.kind.value, old=ev.old, new=ev.new, params=ev.params, source=source, t=rel)
        if k == PolicyKind.QUEUE:
            self.release_queued()  # a new limit may let held requests go
        return ev

    def policy_catalog(self) -> list[dict[str, Any]]:
        return catalog(live=True)

    # --- requests (called by LiveRequest) ---------------------------------------------------------
    def request_started(self, live: LiveRequest) -> None:
        self.live[live.id] = live
        self.in_flight += 1
        self.total += 1
        self._idle.clear()

    def hold(self, live: LiveRequest) -> None:
        """The queue policy holds `live` until `release_queued` or the periodic expiry resolves it."""
        self._held[live.id] = live

    def unhold(self, live: LiveRequest) -> None:
        self._held.pop(live.id, None)

    def release_queued(self) -> None:
        """Let held requests go while the cluster has room (the queue policy picks which)."""
        if not self._held:
            return
        for req in self.dispatcher.release(time.monotonic()):
            live = self._held.pop(str(req.id), None)
            if live is not None and live.released is not None and not live.released.done():
                live.released.set_result(None)

    def _expire_queued(self) -> None:
        if not self._held:
            return
        ttl = self.dispatcher.policies[PolicyKind.QUEUE].params.ttl_s
        for req in self.dispatcher.expire(time.monotonic()):
            live = self._held.pop(str(req.id), None)
            if live is not None and live.released is not None and not live.released.done():
                live.released.set_exception(Rejected(503, f"queued longer than the queue policy's ttl_s={ttl:g} s while every instance was saturated", self.retry_after_s()))

    def retry_after_s(self) -> float:
        """What a rejected client is told to wait: a poll period plus the decode time of a typical request."""
        return max(1.0, self.config.poll_interval_s + self.profile.max_model_len / max(self.dispatcher.view.decode_rate.value, 1.0) / 8)

    def request_done(self, live: LiveRequest) -> None:
        self.live.pop(live.id, None)
        d = self.dispatcher
        rid = live.request.id
        finish = live.times[live.step]
        if live.ok:
            d.on_finish(rid, finish, live.output_tokens, live.first_token_at)
        else:
            d.on_fail(rid, finish)
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()
        self.release_queued()
        req = live.request
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
        rel = self.rel
        self.recorder.request(
            {
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
                "first_token": rel(first),
                "finish": rel(finish),
                "ttft": ttft,
                "tpot": tpot,
                "e2e": finish - req.arrival if live.ok else None,
                "status": "ok" if live.ok else "failed",
                "reason": live.reason,
                "slo_met": met,
            }
        )

    # --- periodic decisions and scaling -----------------------------------------------------------
    async def _periodic(self) -> None:
        """Wall-clock driver of the periodic decision point (the simulator drives it on virtual time)."""
        while True:
            await asyncio.sleep(PERIODIC_TICK_S)
            self._expire_queued()
            now = time.monotonic()
            for iid, b in list(self.breakers.items()):
                if b.tick(now) is not None and iid in self.instances:
                    self._breaker_event(self.instances[iid], b.state)
            if now < self.dispatcher.next_periodic_at():
                continue
            decisions = self.dispatcher.periodic(now)
            for action in decisions.scale:
                with contextlib.suppress(SibylError):  # a refusal is recorded as an event by the scaler
                    self.scaler.execute(action, source=f"policy:{self.dispatcher.policies[PolicyKind.SCALING].name}")
            policy = f"policy:{self.dispatcher.policies[PolicyKind.RESCHEDULE].name}"
            for m in decisions.migrations:
                if Capability.MIGRATION not in self.backend.capabilities:
                    self.instance_event(m.source, None, "refused", f"migration of {m.request_id} to {m.target}: the {self.backend.label} backend cannot migrate", policy)
                    continue
                task = asyncio.create_task(self._migrate_logged(str(m.request_id), m.target, policy, m.reason))
                self._migrations.add(task)
                task.add_done_callback(self._migrations.discard)

    # --- migration ------------------------------------------------------------------------------
    async def migrate(self, request_id: str, target: str, source: str = "api", reason: str = "") -> dict[str, Any]:
        """Move a streaming request that is decoding to the decode instance `target`.

        Returns what the source reported once the KV is on the target; the client's stream then
        continues from there (LiveRequest follows the hand-off). Raises ScaleError when the
        request or target does not qualify and BackendError when the backend gave the move up."""
        require(self.backend, Capability.MIGRATION)
        live = self.live.get(request_id)
        if live is None or live.step != Step.DECODING:
            raise ScaleError(f"request {request_id!r} is not decoding in the gateway now")
        if not live.stream:
            raise ScaleError(f"request {request_id!r} is not streaming: only a stream can follow a migration")
        if live.migrating_to is not None or live.handed_over is not None:
            raise ScaleError(f"request {request_id!r} is being migrated already")
        src = live.decode_instance
        if target == src:
            raise ScaleError(f"request {request_id!r} decodes on {target} already")
        if target not in self.instances or self.dispatcher.role_of(target) != Role.DECODE or self.dispatcher.phase_of(target) != "active":
            raise ScaleError(f"{target!r} is not an active decode instance")
        assert src is not None
        live.migrating_to = target
        live.open_resume(self.instances[target])
        try:
            report = await self.backend.migrate(request_id, self.instances[src], self.instances[target])
        except BaseException:
            live.migrating_to = None
            live.drop_resume()
            raise
        return {"request_id": request_id, "source": src, "target": target, "reason": reason, **report, "by": source}

    async def _migrate_logged(self, request_id: str, target: str, source: str, reason: str) -> None:
        """A policy's migration: executed, or refused with why, as an event either way."""
        live = self.live.get(request_id)
        src = live.decode_instance if live is not None else None
        try:
            await self.migrate(request_id, target, source, reason)
        except SibylError as e:
            self.instance_event(src or target, None, "migration_refused", f"{request_id} → {target}: {e}", source)

    def migration_done(self, live: LiveRequest, src: str, target: str, last_before: float, tokens_before: int, first_after: float) -> None:
        """The first token of a migrated request arrived from its new instance: record the stall,
        also in decode steps (the request's own mean time between tokens before the move)."""
        stall = first_after - last_before
        steps = ""
        if live.first_token_at is not None and tokens_before > 1 and last_before > live.first_token_at:
            step = (last_before - live.first_token_at) / (tokens_before - 1)
            steps = f" ({stall / step:.1f} of its decode steps of {step * 1000:.1f} ms)"
        detail = f"request {live.id} → {target} after {tokens_before} tokens: the client waited {stall * 1000:.1f} ms between tokens{steps}"
        self.metrics.migration_stall.observe(stall)
        self.instance_event(src, Role.DECODE, "migrated", detail)
        self.events.publish("migration", request_id=live.id, source=src, target=target, stall_s=stall, tokens_before=tokens_before)

    @property
    def can_scale(self) -> bool:
        return Capability.SCALE in self.backend.capabilities

    async def scale(self, role: str, delta: int, source: str = "api") -> dict[str, Any]:
        """Add `delta` instances of a role (or remove -delta: routing stops at once, the process after draining)."""
        if not self.can_scale:
            raise ScaleError(f"the {self.backend.label} backend cannot add or remove instances")
        if role not in ("prefill", "decode") or not isinstance(delta, int) or isinstance(delta, bool) or delta == 0:
            raise ScaleError('expected {"role": "prefill"|"decode", "delta": a non-zero integer}')
        r = Role(role)
        changed: list[str] = []
        reason = f"operator via {source}"
        if delta > 0:
            for _ in range(delta):
                iid = self.scaler.execute(ScaleAction("add", r, reason=reason), source)
                assert iid is not None
                changed.append(iid)
            return {"role": role, "delta": delta, "instances": changed}
        routable = [i for i in self.instances.values() if i.role == r and self.dispatcher.phase_of(i.id) == "active"]
        if len(routable) + delta < 1:
            raise ScaleError(f"at least one {role} instance must remain ({len(routable)} active)")
        for inst in routable[delta:]:
            self.scaler.execute(ScaleAction("remove", r, inst.id, reason=reason), source)
            changed.append(inst.id)
        return {"role": role, "delta": delta, "instances": changed}

    async def flip(self, instance_id: str, role: str, source: str = "api") -> dict[str, Any]:
        """Make an instance serve the other role (routing changes; requests on it finish where they are)."""
        try:
            r = Role(role)
        except ValueError:
            raise ScaleError(f"unknown role {role!r}: prefill or decode") from None
        inst = self.instances.get(instance_id)
        if inst is None:
            raise ScaleError(f"no instance {instance_id!r}; instances: {', '.join(self.instances)}")
        if inst.role == r:
            raise ScaleError(f"{instance_id} already serves {role}")
        others = [i for i in self.instances.values() if i.role == inst.role and i.id != instance_id and self.dispatcher.phase_of(i.id) == "active"]
        if not others:
            raise ScaleError(f"{instance_id} is the last active {inst.role.value} instance")
        try:
            self.scaler.execute(ScaleAction("flip", r, instance_id, reason=f"operator via {source}"), source)
        except ConfigError as e:
            raise ScaleError(str(e)) from None
        return {"instance": instance_id, "role": role}

    def instance_event(self, instance_id: str, role: Role | None, event: str, detail: str, source: str = "") -> None:
        t = time.monotonic() - self.t0
        text = f"{detail} [{source}]" if source else detail
        self.recorder.instance_event(t=t, instance_id=instance_id, event=event, detail=text)
        self.events.publish("instance", instance=instance_id, role=role.value if role else None, event=event, detail=detail, source=source, t=t)

    def upstream_failed(self, instance_id: str) -> None:
        """A leg failed because of the instance: count it on its breaker and poll it now."""
        inst = self.instances.get(instance_id)
        if inst is not None:
            inst.failed += 1
            changed = self._breaker(instance_id).failure(time.monotonic())
            if changed is not None:
                self._breaker_event(inst, changed)
        self.poller.kick()

    def upstream_ok(self, instance_id: str) -> None:
        """A leg succeeded on the instance (cheap when its breaker is closed and clean)."""
        b = self.breakers.get(instance_id)
        if b is None or (b.consecutive == 0 and b.state == BreakerState.CLOSED):
            return
        changed = b.success()
        inst = self.instances.get(instance_id)
        if changed is not None and inst is not None:
            self._breaker_event(inst, changed)

    def _breaker(self, instance_id: str) -> CircuitBreaker:
        b = self.breakers.get(instance_id)
        if b is None:
            b = self.breakers[instance_id] = CircuitBreaker(self.config.breaker_failures, self.config.breaker_cooloff_s)
        return b

    def _breaker_event(self, inst: Instance, state: BreakerState) -> None:
        self._apply_health(inst)
        b = self.breakers[inst.id]
        detail = {
            BreakerState.OPEN: f"{b.consecutive} requests in a row failed on it: routing stops for {b.cooloff_s:g} s",
            BreakerState.HALF_OPEN: "cool-off over: the next request tries it again",
            BreakerState.CLOSED: "a request succeeded on it: routing as usual",
        }[state]
        self.instance_event(inst.id, inst.role, f"circuit_{state.value}", detail)

    def _apply_health(self, inst: Instance) -> None:
        """Routable when its probes pass and its breaker allows it."""
        b = self.breakers.get(inst.id)
        self.dispatcher.set_health(inst.id, inst.healthy and (b is None or b.allows))

    # --- poller callbacks --------------------------------------------------------------------------
    def lost_signal(self, instance_id: str) -> asyncio.Future[None]:
        """A future done once the instance is marked down or removed (a fresh one is handed out
        after it recovers); shared by every request whose KV waits on the instance."""
        fut = self._lost.get(instance_id)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            if instance_id in self.instances:
                self._lost[instance_id] = fut
            else:
                fut.set_result(None)
        return fut

    def instance_removed(self, instance_id: str) -> None:
        """The instance left the cluster: whoever waits on its lost signal hears it now."""
        fut = self._lost.pop(instance_id, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def track_data_parallel(self, inst: Instance) -> None:
        """Tell the dispatcher whether `inst` is a data-parallel group (its ranks and slots per rank)."""
        self.dispatcher.set_data_parallel(inst.id, inst.dp_size, self.config.emulator.max_num_seqs or 0)

    def instance_lost(self, instance_id: str, reason: str) -> None:
        """The backend saw the instance's process, actor or node go: down at once, with that reason
        (recorded as well when its probes had already marked it down)."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        if inst.healthy:
            inst.healthy = False
            inst.consecutive_failures = max(inst.consecutive_failures, self.config.down_after_failures)
            self._on_status(inst, False, reason)
        else:
            self.instance_event(inst.id, inst.role, "lost", reason)

    def _on_status(self, inst: Instance, healthy: bool, reason: str) -> None:
        if healthy:
            self._lost.pop(inst.id, None)
        elif not (lost := self.lost_signal(inst.id)).done():
            lost.set_result(None)
        self._apply_health(inst)
        self.metrics.instance_up.labels(instance=inst.id, role=inst.role.value).set(1 if healthy else 0)
        self.instance_event(inst.id, inst.role, "up" if healthy else "down", reason)
        if healthy:
            self.release_queued()

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
        d = self.dispatcher
        d.view.now = now
        loads = d.projected_loads()
        instances = []
        for inst in self.instances.values():
            idx = d.index_of(inst.id)
            s = inst.sample
            instances.append(
                {
                    "id": inst.id,
                    "role": inst.role.value,
                    "phase": str(d.phase_of(inst.id)),
                    "breaker": self.breakers[inst.id].state.value if inst.id in self.breakers else "closed",
                    "url": inst.url,
                    "healthy": inst.healthy,
                    "managed": inst.managed,
                    "running": int(s.running),
                    "waiting": int(s.waiting),
                    "kv_usage": s.kv_usage,
                    "tokens_per_s": inst.tokens_per_s,
                    "projected_load": loads.get(inst.id),
                    "routed_running": int(d.view.running_n[idx]),
                    "routed_pending": int(d.view.pending_n[idx]),
                    "failures": inst.failed,
                    "pid": inst.pid,
                    "node": inst.node,
                    "dp_ranks": d.rank_loads(inst.id, now),
                    "scraped": {  # the instance's own cumulative counters at the last /metrics scrape
                        "prompt_tokens_total": s.prompt_tokens_total,
                        "generation_tokens_total": s.generation_tokens_total,
                        "success_total": s.success_total,
                        "preemptions_total": s.preemptions_total,
                        "failed_transfers_total": s.failed_transfers_total,
                    },
                }
            )
        starting = [iid for iid in d.view.instance_ids if str(d.phase_of(iid)) == "starting"]
        for iid in starting:  # not reachable yet: shown so the operator sees the scale-out under way
            role = d.view.roles[d.index_of(iid)]
            instances.append({"id": iid, "role": role.value, "phase": "starting", "url": "", "healthy": False, "managed": True,
                              "running": 0, "waiting": 0, "kv_usage": 0.0, "tokens_per_s": 0.0, "projected_load": None,
                              "routed_running": 0, "routed_pending": 0, "failures": 0, "pid": None, "node": None, "dp_ranks": None, "scraped": {}})
        active = [i for i in self.instances.values() if str(d.phase_of(i.id)) == "active"]
        n_p = sum(1 for i in active if i.role.serves_prefill())
        n_d = sum(1 for i in active if i.role.serves_decode())
        queue = d.policies[PolicyKind.QUEUE].params
        caps: dict[str, bool] = {c.value: True for c in self.backend.capabilities}
        caps["replay"] = self.replay is not None
        return {
            "run_id": self.run_id,
            "backend": self.backend.label,
            "cluster": f"{n_p}P{n_d}D",
            "model": sorted(self.served_models),
            "uptime_s": now - self.t0,
            "started_at": self.started_wall,
            "instances": instances,
            "policies": d.active_policies(),
            "slo": {"classes": {k: v.model_dump() for k, v in self.config.slo.items()}, **self.slo.snapshot(now)},
            "requests": {"in_flight": self.in_flight, "total": self.total, "failed": self.failed},
            "queue": {"depth": d.queue_depth(), "by_class": d.queue_depth_by_class(), "max_queued": queue.max_queued,
                      "max_in_flight_per_instance": queue.max_in_flight_per_instance, "ttl_s": queue.ttl_s},
            "assignment_ratio": d.assignment_ratios()["active"],
            "draining": self.draining,
            "replay": {**self.replay.snapshot(), "label": self.replay_label} if self.replay is not None else None,
            "capabilities": caps,
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
            state = self.state()
            self._watch_ranks(state["instances"])
            self.events.publish("state", state=state)

    def _watch_ranks(self, instances: list[dict[str, Any]]) -> None:
        """An event when a data-parallel group's ranks drift apart (its busiest rank holds ≥ 1.5×
        the mean: every step then waits for it) and when they are balanced again (≤ 1.2×)."""
        for inst in instances:
            loads = inst.get("dp_ranks")
            if not loads or sum(loads) == 0:
                continue
            factor = max(loads) / (sum(loads) / len(loads))
            iid = inst["id"]
            flagged = iid in self._imbalanced
            if not flagged and factor >= RANK_IMBALANCED:
                self._imbalanced.add(iid)
            elif flagged and factor <= RANK_BALANCED:
                self._imbalanced.discard(iid)
            else:
                continue
            busiest = loads.index(max(loads))
            self.events.publish("ranks", instance=iid, factor=round(factor, 2), busiest=busiest, loads=loads,
                                balanced=iid not in self._imbalanced, policy=self.dispatcher.rank.name)


def check_capability(backend: Backend, kind: PolicyKind, name: str, params: dict[str, Any] | None = None) -> None:
    """Refuse a periodic policy that acts through the backend when the backend cannot carry it out."""
    need = POLICY_NEEDS.get(kind)
    if need is None or need in backend.capabilities or not registry.build(kind, name, params).acts:
        return
    have = ", ".join(sorted(c.value for c in backend.capabilities)) or "none"
    what = {Capability.MIGRATION: "moves running requests between decode instances", Capability.SCALE: "adds and removes instances",
            Capability.DATA_PARALLEL: "chooses data-parallel ranks"}[need]
    raise PolicyError(
        f"{kind} policy {name!r} {what}, which the {backend.label} backend cannot do "
        f"(it declares no {need.value} capability; its capabilities: {have})"
    )


def check_policies(config: ConsoleConfig, backend: Backend) -> None:
    """Build every configured policy once (bad names and params fail before anything starts)."""
    registry.build(PolicyKind.ROUTING, config.policy, config.params)
    for kind, choice in ((PolicyKind.QUEUE, config.queue), (PolicyKind.RESCHEDULE, config.reschedule), (PolicyKind.SCALING, config.scaling),
                         (PolicyKind.RANK, config.rank)):
        registry.build(kind, choice.name, choice.params)
        check_capability(backend, kind, choice.name, choice.params)


def catalog(live: bool = False) -> list[dict[str, Any]]:
    """Every registered policy of every kind with its params schema and defaults; `live` leaves out
    the simulator-only ones (a clairvoyant needs true output lengths no live console knows)."""
    out = []
    for s in registry.specs():
        if live and s.sim_only:
            continue
        out.append({"kind": s.kind.value, "name": s.name, "summary": s.summary, "params_schema": s.schema(),
                    "defaults": s.defaults(), "sim_only": s.sim_only})
    return out

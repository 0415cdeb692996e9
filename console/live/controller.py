"""The running console's wiring: its collaborators, start and stop, the tick, policy swaps, the state."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adapters.backends import Backend, Capability
from adapters.store import RunRecorder, RunStore
from adapters.vllm.instances import Instance
from adapters.vllm.poller import Poller
from console.live import tracing
from console.live.admission import HeldRequests
from console.live.advisor import AdvisorCollector, LiveAdvisor, RowTee, cluster_profile
from console.live.calibration import CalibrationFeed
from console.live.calibrator import Calibrator
from console.live.canary import LiveCanary
from console.live.config import ConsoleConfig
from console.live.decision_quality import QualityCollector, decision_log, quality
from console.live.events import EventBus, InstanceListeners
from console.live.health import InstanceHealth, RankWatch
from console.live.lora import LiveAdapters, LoraCollector
from console.live.metrics import GatewayMetrics
from console.live.migrations import Migrations
from console.live.operations import Operations
from console.live.outcomes import Outcomes
from console.live.policies import POLICY_NEEDS, check_capability
from console.live.prefix import PrefixIndex, default_tokenizer
from console.live.recent import RecentRequests
from console.live.refusals import RefusalCollector, RefusalLines, counted_by_admission
from console.live.scaler import Scaler
from console.live.services import RequestServices
from console.live.state import ConsoleState, InstanceRow, QueueState, ScrapedCounters
from console.live.tenants import Tenants
from core.dispatch import Dispatcher
from core.errors import PolicyError
from core.perf import get_profile
from core.pools import Pool, Pools
from core.types import PolicyEvent, PolicyKind

PERIODIC_TICK_S = 0.1
"""How often the controller expires queued requests and asks whether periodic policies are due."""


STATE_PUSH_S = 0.5
"""How often the state snapshot is pushed on /control/events (a dashboard's redraw cadence)."""


class Controller:
    """Owns everything a live console runs; it wires the parts, and the gateway and the dashboard talk to them.

    The work is done by its parts, each built once here: `held` (the queue policy's held requests),
    `health` (probes, breakers, lost signals), `outcomes` (counts, SLO window, metrics, events, stored rows),
    `tenants`, `migrations` and `operations` (scale, flip, the periodic policies' decisions). A LiveRequest
    gets `services` (console.live.services.RequestServices) and calls the parts themselves; instance
    changes reach the parts through `listeners`, subscribed here. The controller keeps start and stop,
    the tick, policy swaps and the state snapshot."""

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
            self.profile,
            config.policy,
            config.params,
            queue=(config.queue.name, config.queue.params),
            reschedule=(config.reschedule.name, config.reschedule.params),
            scaling=(config.scaling.name, config.scaling.params),
            rank=(config.rank.name, config.rank.params),
            slo=config.slo,
        )
        for kind in POLICY_NEEDS:
            check_capability(backend, kind, self.dispatcher.policies[kind].name)
        if config.admission.enabled:
            self.dispatcher.use_slo_admission(config.admission)
        self.prefix = PrefixIndex(
            config.prefix,
            self.dispatcher,
            self.profile.block_size,
            default_tokenizer(config.backend, config.model, config.vllm.extra_args),
        )
        """Request prefix keys and the cache index's source (approximate, or KV events per instance)."""
        self.store = store
        self.run_id = run_id
        self.run_dir = run_dir
        self.recorder = RunRecorder(store, run_id)
        self.t0 = time.monotonic()
        self.started_wall = time.time()
        self.finished = RowTee(self.recorder)
        """Each finished request's stored row, to the recorder and to the canary and the advisor."""
        self.recent = RecentRequests(self.finished)
        """The run's rows pass through it; it keeps the last finished requests for the request inspector."""
        self.outcomes = Outcomes(self.recent, config.slo, self.t0)
        self.metrics: GatewayMetrics = self.outcomes.metrics
        """The gateway's Prometheus metrics (the outcomes' own)."""
        self.events: EventBus = self.outcomes.events
        """The console's event bus (the outcomes' own)."""
        log = decision_log(config.decisions, lambda recs: self.recorder.decisions(recs, self.t0))
        self.dispatcher.use_decisions(log)
        self.metrics.registry.register(QualityCollector(self.dispatcher))
        self.metrics.registry.register(RefusalCollector(lambda: self.dispatcher.gate))
        self.refusals = RefusalLines(self.events, lambda: self.dispatcher.gate)
        """Admission's refusals as one event line per cause per few seconds (not one per request)."""
        if self.dispatcher.gate is not None:
            self.outcomes.counted_refusal = counted_by_admission
        self.held = HeldRequests(self.dispatcher, self.profile, config.poll_interval_s)
        self.metrics.queue_depth.set_function(lambda: len(self.held))
        self.metrics.watch_instances(lambda: list(self.instances.values()))
        self.tenants = Tenants(config.tenants.file, self.dispatcher)
        """API keys and per-tenant limits for /v1 (one open `default` tenant without a keys file)."""
        self.tenants.register_metrics(self.metrics.registry)
        self.tenants.on_reload = lambda result: self.events.publish("tenants", **result)
        self.outcomes.tenant_of = self.tenants.label
        self.listeners = InstanceListeners()
        """Who hears that an instance joined, went down or left (subscribed below, in this order)."""
        self.health = InstanceHealth(
            config, self.instances, self.dispatcher, self.outcomes, self.held.release, self.listeners
        )
        self.listeners.subscribe(added=self.health.track_data_parallel, removed=self.health.instance_removed)
        self.listeners.subscribe(added=self.prefix.follow, down=self.prefix.lost, removed=self.prefix.removed)
        self.listeners.subscribe(added=lambda _: self.held.release())  # a new instance has room
        self.calibration = Calibrator(CalibrationFeed(self.profile, refit_every_s=0), self.dispatcher)
        """Each instance's step terms refitted online from its scrapes (the profile is the prior)."""
        self.health.scraped.append(self.calibration.scraped)
        self.listeners.subscribe(removed=self.calibration.forget)
        pool = Pool(config.pool_name, config.served_model_name, self.dispatcher, adapters=dict(config.lora.adapters))
        self.pools = Pools([pool])
        """The pools behind the gateway (one: this console's dispatcher) and the table from a model to its pool."""
        self.lora = LiveAdapters(self.pools, self.instances, config.max_loras(), events=self.events)
        """The pools' LoRA adapters on their instances: loaded where requests need them, residency for routing."""
        self.listeners.subscribe(added=self.lora.instance_added, removed=self.lora.instance_removed)
        self.health.scraped.append(self.lora.observe)
        self.metrics.registry.register(LoraCollector(self.lora.counts))
        self.tracing = tracing.build(config.tracing)
        """OpenTelemetry spans of each request's phases (None: [tracing] off, opentelemetry not even imported)."""
        for inst in instances:
            self.dispatcher.add_instance(inst.id, inst.role)
            self.health.track_data_parallel(inst)
            self.lora.instance_added(inst)
        self.migrations = Migrations(backend, self.dispatcher, self.instances, self.outcomes)
        scaler = Scaler(backend, self.dispatcher, self.instances, config, self.metrics, self.outcomes, self.listeners)
        self.operations = Operations(backend, self.dispatcher, self.instances, scaler, self.migrations)
        self.canary = LiveCanary(self.dispatcher, self.recorder, self.events, self.t0, self.set_policy)
        """The policy canary (one at a time), its arms and readings."""
        self.advisor = LiveAdvisor(
            config.advisor,
            dispatcher=self.dispatcher,
            canary=self.canary,
            log=self.recorder,
            events=self.events,
            t0=self.t0,
            run_id=run_id,
            slos=config.slo,
            shape=lambda: self.snapshot().cluster,
            profile=lambda: cluster_profile(self.profile, [a.terms for a in self.calibration.applied.values()]),
        )
        """The what-if advisor ([advisor]; its simulations run in a niced worker process)."""
        self.finished.listeners += [self.canary.request, self.advisor.request]
        self.metrics.registry.register(AdvisorCollector(self.advisor))
        self.services = RequestServices(
            dispatcher=self.dispatcher,
            instances=self.instances,
            tenants=self.tenants,
            held=self.held,
            health=self.health,
            outcomes=self.outcomes,
            migrations=self.migrations,
            metrics=self.metrics,
            engine_priorities=Capability.PRIORITY in backend.capabilities,
            failure_migration_attempts=config.failure_migration_attempts,
            lora=self.lora,
            arrivals=self.advisor if config.advisor.enabled else None,
        )
        """What each LiveRequest uses (built once, here)."""
        self.ranks = RankWatch(self.events, lambda: self.dispatcher.rank.name)
        self.served_models: set[str] = {config.served_model_name}
        self.max_model_len: int | None = None
        """The smallest context length the instances report (None when they do not say)."""
        self.token = os.environ.get("SIBYL_TOKEN") or secrets.token_urlsafe(32)
        self.poller = Poller(
            lambda: list(self.instances.values()),
            interval_s=config.poll_interval_s,
            down_after=config.down_after_failures,
            probe_timeout_s=config.probe_timeout_s,
            on_status=self.health.on_status,
            on_sample=self.health.on_sample,
        )
        self.health.kick = self.poller.kick
        self._tasks: list[asyncio.Task[None]] = []
        self.replay: Any = None
        """The Replayer started by `up --replay`, if any (console.offline.replay.Replayer)."""
        self.replay_label = ""
        self.draining = False
        for kind, policy in self.dispatcher.policies.items():
            self.outcomes.policy_active(kind.value, policy.name, policy.params.model_dump())

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
            self.outcomes.instance_up(inst, True)
        await self._discover_models()
        for ev in self.dispatcher.policy_events:
            self.recorder.policy_event(
                t=0.0, kind=ev.kind.value, old=None, new=ev.new, params=ev.params, source="config"
            )
        await self.poller.poll_once()
        for inst in self.instances.values():
            self.prefix.follow(inst)
        self.poller.start()
        self.backend.on_lost(self.health.instance_lost)  # backends that see instances die (ray: actor or node)
        self.dispatcher.start_periodic(time.monotonic())
        self._tasks.append(asyncio.create_task(self._publish_state(), name="state-publisher"))
        self._tasks.append(asyncio.create_task(self._periodic(), name="periodic-policies"))
        self._tasks.append(asyncio.create_task(self.canary.run(), name="canary"))
        self._tasks.append(asyncio.create_task(self.advisor.run(), name="advisor"))

    async def _discover_models(self) -> None:
        for inst in self.instances.values():
            with contextlib.suppress(Exception):
                assert inst.session is not None
                async with inst.session.get("/v1/models") as r:
                    if r.status == 200:
                        data = await r.json()
                        for m in data.get("data", []):
                            pool = self.pools.of_instance(inst.id)
                            if "id" in m and not m.get("parent") and pool is not None:  # adapters have a parent
                                self.served_models.add(m["id"])
                                self.pools.add_alias(pool, m["id"])
                            if isinstance(m.get("max_model_len"), int):
                                old = self.max_model_len
                                self.max_model_len = m["max_model_len"] if old is None else min(old, m["max_model_len"])

    async def stop(self, status: str = "completed", drain: bool = True) -> None:
        """Drain in-flight requests (bounded; not when `drain` is False), stop polling and periodic work,
        close clients and the run record."""
        self.draining = True
        self.canary.interrupt(f"the console stopped ({status})")  # the active policy stays in force
        if drain and self.outcomes.in_flight:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.outcomes.idle.wait(), self.config.drain_timeout_s)
        await self.poller.stop()
        await self.prefix.close()
        await self.lora.close()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.operations.stop()
        await asyncio.to_thread(self.advisor.close)
        for inst in self.instances.values():
            await inst.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # exports the last spans (a blocking HTTP call)
        self.recorder.close(status=status, summary=self.summary())

    # --- policies ------------------------------------------------------------------------------
    def set_policy(
        self, kind: str, name: str, params: dict[str, Any] | None, source: str, pool: str | None = None
    ) -> PolicyEvent:
        """Hot-swap one policy of pool `pool` (None: the only pool; UnknownPool otherwise)."""
        dispatcher = self.pools.pick(pool).dispatcher
        try:
            k = PolicyKind(kind)
        except ValueError:
            raise PolicyError(f"unknown policy kind {kind!r}; kinds: {', '.join(PolicyKind)}") from None
        check_capability(self.backend, k, name)
        ev = dispatcher.set_policy(k, name, params, source=source, now=time.monotonic())
        self.outcomes.policy_swapped(ev.time - self.t0, ev.kind.value, ev.old, ev.new, ev.params, source)
        self.canary.policy_swapped(ev.kind.value, source)
        if k == PolicyKind.QUEUE:
            self.held.release()  # a new limit may let held requests go
        return ev

    # --- the tick --------------------------------------------------------------------------------
    async def _periodic(self) -> None:
        """Wall-clock driver of the periodic decision point (the simulator drives it on virtual time)."""
        while True:
            await asyncio.sleep(PERIODIC_TICK_S)
            self.held.expire()
            self.held.release()  # the prefill backlog drains with time, not only on events
            now = time.monotonic()
            self.health.tick(now)
            self.calibration.tick(now)
            self.refusals.tick(now)
            self.tenants.poll(now)
            if now < self.dispatcher.next_periodic_at():
                continue
            decisions = self.dispatcher.periodic(now)
            policies = self.dispatcher.policies
            self.operations.carry_out(
                decisions, policies[PolicyKind.SCALING].name, policies[PolicyKind.RESCHEDULE].name
            )

    async def _publish_state(self) -> None:
        """Every second: attainment and the data-parallel rank check; every STATE_PUSH_S, while
        anyone follows the event stream, the snapshot (dashboards redraw from it)."""
        tick = 0
        while True:
            await asyncio.sleep(STATE_PUSH_S)
            tick += 1
            every_second = tick % round(1.0 / STATE_PUSH_S) == 0
            if not every_second and not self.events.subscribers:
                continue
            if every_second:
                self.outcomes.publish_attainment(time.monotonic())
            state = self.snapshot()
            if every_second:
                self.ranks.check(state.instances)
            self.events.publish("state", state=state.to_json())

    # --- views -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The snapshot as the control API serves it (`snapshot().to_json()`)."""
        return self.snapshot().to_json()

    def snapshot(self) -> ConsoleState:
        """The console's state now, built once (see console.live.state for every field)."""
        now = time.monotonic()
        d, out = self.dispatcher, self.outcomes
        d.view.now = now
        loads = d.projected_loads()
        rows = [self._row(inst, loads, now) for inst in self.instances.values()]
        for iid in d.view.instance_ids:  # not reachable yet: shown so the operator sees the scale-out under way
            if str(d.phase_of(iid)) == "starting":
                rows.append(
                    InstanceRow(
                        id=iid,
                        role=d.view.roles[d.index_of(iid)].value,
                        phase="starting",
                        url="",
                        healthy=False,
                        managed=True,
                        running=0,
                        waiting=0,
                        kv_usage=0.0,
                        tokens_per_s=0.0,
                        projected_load=None,
                        routed_running=0,
                        routed_pending=0,
                        failures=0,
                        pid=None,
                        node=None,
                        dp_ranks=None,
                        scraped=ScrapedCounters(),
                    )
                )
        active = [i for i in self.instances.values() if str(d.phase_of(i.id)) == "active"]
        n_p = sum(1 for i in active if i.role.serves_prefill())
        n_d = sum(1 for i in active if i.role.serves_decode())
        queue = d.policies[PolicyKind.QUEUE].params
        caps: dict[str, bool] = {c.value: True for c in self.backend.capabilities}
        caps["replay"] = self.replay is not None
        return ConsoleState.model_validate(
            {
                "run_id": self.run_id,
                "backend": self.backend.label,
                "cluster": f"{n_p}P{n_d}D",
                "model": sorted(self.served_models),
                "uptime_s": now - self.t0,
                "started_at": self.started_wall,
                "instances": rows,
                "policies": d.active_policies(),
                "slo": {"classes": {k: v.model_dump() for k, v in self.config.slo.items()}, **out.slo.snapshot(now)},
                "requests": {"in_flight": out.in_flight, "total": out.total, "failed": out.failed},
                "queue": QueueState(
                    depth=d.queue_depth(),
                    by_class=d.queue_depth_by_class(),
                    max_queued=queue.max_queued,
                    max_in_flight_per_instance=queue.max_in_flight_per_instance,
                    ttl_s=queue.ttl_s,
                    admission=d.gate.describe() if d.gate is not None else None,
                    refusals=d.gate.refusals_by_cause() if d.gate is not None else None,
                ),
                "assignment_ratio": d.assignment_ratios()["active"],
                "draining": self.draining,
                "replay": {**self.replay.snapshot(), "label": self.replay_label} if self.replay is not None else None,
                "prefix": self.prefix.snapshot(),
                "capabilities": caps,
                "tenants": self.tenants.snapshot(),
                **self._advisor_state(),
                "pools": self._pools_state(),
            }
        )

    def _pools_state(self) -> dict[str, Any]:
        """Each pool: its model, instances, active policies and adapters (console.live.state.PoolState)."""
        lora = self.lora.snapshot()
        return {
            p.name: {
                "model": p.model,
                "instances": sorted(p.instance_ids),
                "policies": p.dispatcher.active_policies(),
                "adapters": lora[p.name]["adapters"],
                "lora_counts": lora[p.name]["counts"],
            }
            for p in self.pools
        }

    def _advisor_state(self) -> dict[str, Any]:
        """The advisor's and the canary's state, when the advisor is on or a canary has run (else no keys)."""
        out: dict[str, Any] = {}
        if (advisor := self.advisor.snapshot()) is not None:
            out["advisor"] = advisor
        if self.canary.current is not None or self.canary.last is not None:
            out["canary"] = self.canary.snapshot()
        return out

    def _row(self, inst: Instance, loads: Mapping[str, float], now: float) -> InstanceRow:
        d = self.dispatcher
        idx = d.index_of(inst.id)
        s = inst.sample
        return InstanceRow(
            id=inst.id,
            role=inst.role.value,
            phase=str(d.phase_of(inst.id)),
            breaker=self.health.breaker_state(inst.id),
            url=inst.url,
            healthy=inst.healthy,
            managed=inst.managed,
            running=int(s.running),
            waiting=int(s.waiting),
            kv_usage=s.kv_usage,
            tokens_per_s=inst.tokens_per_s,
            prefix_hit_rate=inst.prefix_hit_rate,
            cached_share=inst.cached_share,
            projected_load=loads.get(inst.id),
            routed_running=int(d.view.running_n[idx]),
            routed_pending=int(d.view.pending_n[idx]),
            failures=inst.failed,
            pid=inst.pid,
            node=inst.node,
            dp_ranks=d.rank_loads(inst.id, now),
            backlog_s=d.prefill_backlog_s(inst.id, now) if inst.role.serves_prefill() else None,
            calibration=self.calibration.row(inst.id, now),
            pool=pool.name if (pool := self.pools.of_instance(inst.id)) is not None else None,
            adapters=self.lora.adapters_on(inst.id),
            scraped=ScrapedCounters(
                prompt_tokens_total=s.prompt_tokens_total,
                generation_tokens_total=s.generation_tokens_total,
                success_total=s.success_total,
                preemptions_total=s.preemptions_total,
                failed_transfers_total=s.failed_transfers_total,
            ),
        )

    def summary(self) -> dict[str, Any]:
        out = self.outcomes.summary(time.monotonic(), self.instances.values())
        return {**out, "decision_quality": quality(self.dispatcher)}

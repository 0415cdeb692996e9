"""The running console's wiring: its collaborators, start and stop, the tick, policy swaps, the state."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections import ChainMap
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from adapters.backends import Backend
from adapters.store import RunRecorder, RunStore
from adapters.vllm.instances import Instance
from adapters.vllm.poller import Poller
from console.live import tracing
from console.live.advisor import AdvisorCollector, LiveAdvisor, RowTee, cluster_profile
from console.live.canary import CanaryPool, LiveCanary
from console.live.canary_metrics import CanaryCollector
from console.live.config import ConsoleConfig
from console.live.decision_quality import QualityCollector, quality
from console.live.events import EventBus
from console.live.health import RankWatch
from console.live.lora import LiveAdapters, LoraCollector
from console.live.metrics import GatewayMetrics
from console.live.outcomes import Outcomes
from console.live.policies import check_capability
from console.live.pools import PoolPlan, PoolRuntime, plan_pools
from console.live.recent import RecentRequests
from console.live.refusals import RefusalCollector, counted_by_admission
from console.live.state import ConsoleState, QueueState
from console.live.tenants import Tenants
from core.dispatch import Dispatcher
from core.errors import PolicyError
from core.pools import Pool, Pools
from core.types import PolicyEvent, PolicyKind

PERIODIC_TICK_S = 0.1
"""How often the controller expires queued requests and asks whether periodic policies are due."""


STATE_PUSH_S = 0.5
"""How often the state snapshot is pushed on /control/events (a dashboard's redraw cadence)."""


class Controller:
    """Owns everything a live console runs; it wires the parts, and the gateway and the dashboard talk to them.

    The work is done by its parts, each built once here. Each pool (one per base model) has its own in a
    `PoolRuntime` (console/live/pools.py): its dispatcher, `held` (the queue policy's held requests), `health`
    (probes, breakers, lost signals), prefix index, calibration, `migrations` and `operations` (scale, flip, the
    periodic policies' decisions), and the `services` (console.live.services.RequestServices) its LiveRequests
    call; its instance changes reach its parts through its `listeners`. Shared by all: `outcomes` (counts, SLO
    window, metrics, events, stored rows), `tenants`, the adapters (`lora`), the poller, the canary (one at a
    time, on the pool named when it starts) and the advisor (on `[advisor] pool`). With one pool `dispatcher`,
    `held`, `health`, ... are that pool's. The controller keeps start and
    stop, the tick, policy swaps and the state snapshot."""

    def __init__(
        self,
        config: ConsoleConfig,
        instances: list[Instance],
        *,
        store: RunStore,
        run_id: str,
        run_dir: Path,
        backend: Backend,
        pools: Sequence[tuple[PoolPlan, Backend, list[Instance]]] = (),
    ) -> None:
        """`instances` run on `backend` as the one pool of `config`; or `pools` gives each pool's plan, backend
        and started instances (`instances` and `backend` then unused but the first pool's backend labels the run)."""
        self.config = config
        started = list(pools) or [(plan_pools(config)[0], backend, instances)]
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
        self.runtimes = [
            PoolRuntime(plan, config, b, insts, outcomes=self.outcomes, recorder=self.recorder, t0=self.t0)
            for plan, b, insts in started
        ]
        """Each pool's own parts (console.live.pools.PoolRuntime), in the configuration's order."""
        first = self.runtimes[0]
        self.instances: Mapping[str, Instance] = (
            first.instances if len(self.runtimes) == 1 else ChainMap(*reversed([r.instances for r in self.runtimes]))
        )
        """Every instance by id (with several pools a live view over each pool's own)."""
        self.backend, self.profile, self.dispatcher = first.backend, first.profile, first.dispatcher
        """The first pool's (the only one's, with one pool): what labels the run, and what the top-level state and
        decision quality read."""
        self.held, self.health, self.prefix = first.held, first.health, first.prefix
        self.calibration = first.calibration
        self.migrations, self.operations, self.refusals = first.migrations, first.operations, first.refusals
        self.listeners = first.listeners
        registry = self.metrics.registry
        registry.register(QualityCollector(lambda: [(r.pool.name, r.dispatcher) for r in self.runtimes]))
        registry.register(RefusalCollector(lambda: [(r.pool.name, r.dispatcher.gate) for r in self.runtimes]))
        pool_names = {r.pool.model: r.pool.name for r in self.runtimes}
        self.outcomes.pool_of = lambda live: pool_names.get(live.model, first.pool.name)
        if first.dispatcher.gate is not None:
            self.outcomes.counted_refusal = counted_by_admission
        if len(self.runtimes) == 1:
            self.metrics.queue_depth.set_function(lambda: len(first.held))
        else:
            self.metrics.queue_depth.set_function(lambda: sum(len(r.held) for r in self.runtimes))
        self.metrics.watch_instances(lambda: list(self.instances.values()))
        self.tenants = Tenants(config.tenants.file, first.dispatcher, others=[r.dispatcher for r in self.runtimes[1:]])
        """API keys and per-tenant limits for /v1 (one open `default` tenant without a keys file)."""
        self.tenants.register_metrics(self.metrics.registry)
        self.tenants.on_reload = lambda result: self.events.publish("tenants", **result)
        self.outcomes.tenant_of = self.tenants.label
        self.pools = Pools([r.pool for r in self.runtimes])
        """The pools behind the gateway and the table from a model to its pool."""
        self.runtime_of: dict[Pool, PoolRuntime] = {r.pool: r for r in self.runtimes}
        """Each pool's runtime (the gateway looks a request's route up here)."""
        self.lora = LiveAdapters(self.pools, self.instances, config.max_loras(), events=self.events)
        """The pools' LoRA adapters on their instances: loaded where requests need them, residency for routing."""
        self.metrics.registry.register(LoraCollector(self.lora.counts))
        self.tracing = tracing.build(config.tracing)
        """OpenTelemetry spans of each request's phases (None: [tracing] off, opentelemetry not even imported)."""
        self.canary = LiveCanary(self.canary_pool, self.recorder, self.events, self.t0)
        """The policy canary (one at a time, on the pool named when it starts: the first by default), its arms and
        readings."""
        advised = self.runtime(config.advisor.pool) if config.advisor.pool is not None else first
        self.advisor = LiveAdvisor(
            config.advisor,
            dispatcher=advised.dispatcher,
            pool=advised.pool.name,
            model=advised.pool.model,
            canary=self.canary,
            log=self.recorder,
            events=self.events,
            t0=self.t0,
            run_id=run_id,
            slos=config.slo,
            shape=lambda: "{}P{}D".format(*advised.cluster()),
            profile=lambda: cluster_profile(advised.profile, [a.terms for a in advised.calibration.applied.values()]),
            outcomes=self.outcomes,
            calibration=advised.calibration,
        )
        """The what-if advisor ([advisor], on its `pool`, default the first; its simulations run in a niced worker
        process)."""
        advised.advised = self.advisor.enabled
        self.finished.listeners.append(self.canary.request)
        if self.advisor.enabled:  # a disabled advisor keeps no rows (its `request` would return at once)
            self.finished.listeners.append(self.advisor.request)
        self.metrics.registry.register(AdvisorCollector(self.advisor))
        self.metrics.registry.register(CanaryCollector(self.canary))
        arrivals = self.advisor if config.advisor.enabled else None
        for r in self.runtimes:
            r.serve(config, self.tenants, self.outcomes, self.lora, arrivals)
        self.services = first.services
        """What each LiveRequest of the first (the only) pool uses (each pool's: `runtime_of[pool].services`)."""
        self.ranks = RankWatch(self.events, lambda: first.dispatcher.rank.name)
        self.served_models: set[str] = {r.pool.model for r in self.runtimes}
        self.max_model_len: int | None = None
        """The smallest context length the instances report (None when they do not say)."""
        self.token = os.environ.get("SIBYL_TOKEN") or secrets.token_urlsafe(32)
        one = len(self.runtimes) == 1
        self.poller = Poller(
            lambda: list(self.instances.values()),
            interval_s=config.poll_interval_s,
            down_after=config.down_after_failures,
            probe_timeout_s=config.probe_timeout_s,
            on_status=first.health.on_status if one else self._on_status,
            on_sample=first.health.on_sample if one else self._on_sample,
        )
        for r in self.runtimes:
            r.health.kick = self.poller.kick
        self._tasks: list[asyncio.Task[None]] = []
        self.replay: Any = None
        """The Replayer started by `up --replay`, if any (console.offline.replay.Replayer)."""
        self.replay_label = ""
        self.draining = False
        for r in self.runtimes:
            for kind, policy in r.dispatcher.policies.items():
                self.outcomes.policy_active(kind.value, policy.name, policy.params.model_dump(), pool=r.pool.name)

    def runtime(self, pool: str | None) -> PoolRuntime:
        """The runtime of pool `pool` (None: the only pool; UnknownPool otherwise)."""
        return self.runtime_of[self.pools.pick(pool)]

    def canary_pool(self, name: str | None) -> CanaryPool:
        """The pool a canary runs on: pool `name` (None: the first pool; UnknownPool naming the pools otherwise)."""
        r = self.runtimes[0] if name is None else self.runtime(name)
        return CanaryPool(r.pool.name, r.pool.model, r.dispatcher, partial(self.set_policy, pool=r.pool.name))

    def runtime_with(self, instance_id: str) -> PoolRuntime | None:
        """The runtime of the pool the instance serves (None: no pool has it)."""
        return next((r for r in self.runtimes if instance_id in r.instances), None)

    def _on_status(self, inst: Instance, healthy: bool, reason: str) -> None:
        """The poller marked `inst` up or down: its pool's health hears it (several pools)."""
        if (r := self.runtime_with(inst.id)) is not None:
            r.health.on_status(inst, healthy, reason)

    def _on_sample(self, inst: Instance, now: float) -> None:
        if (r := self.runtime_with(inst.id)) is not None:
            r.health.on_sample(inst, now)

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
        for r in self.runtimes:
            for ev in r.dispatcher.policy_events:
                self.recorder.policy_event(
                    t=0.0,
                    kind=ev.kind.value,
                    old=None,
                    new=ev.new,
                    params=ev.params,
                    source="config",
                    pool=r.pool.name,
                )
        await self.poller.poll_once()
        for r in self.runtimes:
            for inst in r.instances.values():
                r.prefix.follow(inst)
        self.poller.start()
        now = time.monotonic()
        for r in self.runtimes:
            r.backend.on_lost(r.health.instance_lost)  # backends that see instances die (ray: actor or node)
            r.dispatcher.start_periodic(now)
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
        for r in self.runtimes:
            await r.prefix.close()
        await self.lora.close()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for r in self.runtimes:
            await r.operations.stop()
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
        runtime = self.runtime(pool)
        try:
            k = PolicyKind(kind)
        except ValueError:
            raise PolicyError(f"unknown policy kind {kind!r}; kinds: {', '.join(PolicyKind)}") from None
        check_capability(runtime.backend, k, name)
        ev = runtime.dispatcher.set_policy(k, name, params, source=source, now=time.monotonic())
        self.outcomes.policy_swapped(
            ev.time - self.t0, ev.kind.value, ev.old, ev.new, ev.params, source, pool=runtime.pool.name
        )
        self.canary.policy_swapped(ev.kind.value, source, pool=runtime.pool.name)
        if k == PolicyKind.QUEUE:
            runtime.held.release()  # a new limit may let held requests go
        return ev

    # --- the tick --------------------------------------------------------------------------------
    async def _periodic(self) -> None:
        """Wall-clock driver of each pool's periodic decision point (the simulator drives it on virtual time)."""
        while True:
            await asyncio.sleep(PERIODIC_TICK_S)
            now = time.monotonic()
            for r in self.runtimes:
                r.tick(now)
            self.tenants.poll(now)

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
        """The console's state now, built once (see console.live.state for every field). With several pools the
        top-level policies, queue limits, admission, prefix index and assignment ratio are the first pool's
        (`pools` has each pool's, with its queue, admission and refusals, assignment ratio and prefix index); the
        queue depth counts every pool's."""
        now = time.monotonic()
        first, out = self.runtimes[0], self.outcomes
        d = first.dispatcher
        rows = [row for r in self.runtimes for row in r.rows(now, self.lora)]
        clusters = [r.cluster() for r in self.runtimes]
        by_class: dict[str, int] = {}
        for r in self.runtimes:
            for k, v in r.dispatcher.queue_depth_by_class().items():
                by_class[k] = by_class.get(k, 0) + v
        queue = queue_state(d).model_copy(
            update={"depth": sum(r.dispatcher.queue_depth() for r in self.runtimes), "by_class": by_class}
        )
        caps: dict[str, bool] = {c.value: True for c in self.backend.capabilities}
        caps["replay"] = self.replay is not None
        return ConsoleState.model_validate(
            {
                "run_id": self.run_id,
                "backend": self.backend.label,
                "cluster": f"{sum(p for p, _ in clusters)}P{sum(n for _, n in clusters)}D",
                "model": sorted(self.served_models),
                "uptime_s": now - self.t0,
                "started_at": self.started_wall,
                "instances": rows,
                "policies": d.active_policies(),
                "slo": {"classes": {k: v.model_dump() for k, v in self.config.slo.items()}, **out.slo.snapshot(now)},
                "requests": {"in_flight": out.in_flight, "total": out.total, "failed": out.failed},
                "queue": queue,
                "assignment_ratio": d.assignment_ratios()["active"],
                "draining": self.draining,
                "replay": {**self.replay.snapshot(), "label": self.replay_label} if self.replay is not None else None,
                "prefix": first.prefix.snapshot(),
                "capabilities": caps,
                "tenants": self.tenants.snapshot(),
                **self._advisor_state(),
                "pools": self._pools_state(clusters),
            }
        )

    def _pools_state(self, clusters: list[tuple[int, int]]) -> dict[str, Any]:
        """Each pool: its model, active instances, instances, active policies, queue (its held requests, limits,
        admission and refusals), assignment ratio, prefix index and adapters (state.PoolState)."""
        lora = self.lora.snapshot()
        return {
            p.name: {
                "model": p.model,
                "cluster": f"{n_p}P{n_d}D",
                "instances": sorted(p.instance_ids),
                "policies": p.dispatcher.active_policies(),
                "queue": queue_state(p.dispatcher),
                "assignment_ratio": p.dispatcher.assignment_ratios()["active"],
                "prefix": self.runtime_of[p].prefix.snapshot(),
                "adapters": lora[p.name]["adapters"],
                "lora_counts": lora[p.name]["counts"],
            }
            for p, (n_p, n_d) in zip(self.pools, clusters, strict=True)
        }

    def _advisor_state(self) -> dict[str, Any]:
        """The advisor's and the canary's state, when the advisor is on or a canary has run (else no keys)."""
        out: dict[str, Any] = {}
        if (advisor := self.advisor.snapshot()) is not None:
            out["advisor"] = advisor
        if self.canary.current is not None or self.canary.last is not None:
            out["canary"] = self.canary.snapshot()
        return out

    def summary(self) -> dict[str, Any]:
        """The run's closing summary: the outcomes' (SLO over the run, counts, health round trips) and the first
        pool's decision quality; with several pools also `pools`, each pool's model and decision quality."""
        out = {
            **self.outcomes.summary(time.monotonic(), self.instances.values()),
            "decision_quality": quality(self.dispatcher),
        }
        if len(self.runtimes) > 1:
            out["pools"] = {
                r.pool.name: {"model": r.pool.model, "decision_quality": quality(r.dispatcher)} for r in self.runtimes
            }
        return out


def queue_state(d: Dispatcher) -> QueueState:
    """One pool's queue: the requests its queue policy holds (by class), its limits, SLO admission and refusals."""
    queue = d.policies[PolicyKind.QUEUE].params
    return QueueState(
        depth=d.queue_depth(),
        by_class=d.queue_depth_by_class(),
        max_queued=queue.max_queued,
        max_in_flight_per_instance=queue.max_in_flight_per_instance,
        ttl_s=queue.ttl_s,
        admission=d.gate.describe() if d.gate is not None else None,
        refusals=d.gate.refusals_by_cause() if d.gate is not None else None,
    )

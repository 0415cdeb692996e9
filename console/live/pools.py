"""Each pool's own parts on a live console: what the configuration says of each pool (`PoolPlan`, its backend
settings and instance-id prefix) and, once its instances run, its `PoolRuntime` (dispatcher, held queue, health,
prefix index, calibration, migrations, scaling and the RequestServices its requests use)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from adapters.backends import BackendSettings, Capability
from console.live.admission import HeldRequests
from console.live.calibration import CalibrationFeed
from console.live.calibrator import Calibrator
from console.live.decision_quality import decision_log
from console.live.events import InstanceListeners
from console.live.health import InstanceHealth
from console.live.migrations import Migrations
from console.live.operations import Operations
from console.live.policies import POLICY_NEEDS, check_capability
from console.live.prefix import PrefixIndex, default_tokenizer
from console.live.refusals import RefusalLines
from console.live.scaler import Scaler
from console.live.services import ArrivalNotes, RequestServices
from console.live.state import InstanceRow, ScrapedCounters
from core.dispatch import Dispatcher
from core.errors import ConfigError
from core.perf import get_profile
from core.pools import Pool
from core.types import PolicyKind

if TYPE_CHECKING:
    from adapters.backends import Backend
    from adapters.store import RunRecorder
    from adapters.vllm.instances import Instance
    from console.live.config import ConsoleConfig
    from console.live.lora import LiveAdapters
    from console.live.outcomes import Outcomes
    from console.live.tenants import Tenants


@dataclass(frozen=True)
class PoolPlan:
    """One pool as configured: its name, base model, profile and adapters, and what its backend is told."""

    name: str
    model: str
    """The base model's served name (what clients put in `model`)."""
    profile: str
    adapters: dict[str, str]
    settings: BackendSettings
    """Its backend's settings: its instance counts, profile, model path and served name, its ids' prefix."""


def instance_prefixes(names: Sequence[str]) -> list[str]:
    """Each pool's instance-id prefix: its name with anything but letters, digits, `_` and `-` made `_`, then `.`
    (`A` → `A.`, so its instances are `A.p0`, `A.d0`). The `.` is unreserved in URLs (ids sit in /control/ paths),
    never in a backend's own ids (p0, d1) nor in a made-safe name, so the pool is the part before it; a made-safe
    name that two pools share gets the pool's index after it."""
    safe = [re.sub(r"[^A-Za-z0-9_-]", "_", n) for n in names]
    return [f"{s}_{i}." if safe.count(s) > 1 else f"{s}." for i, s in enumerate(safe)]


def plan_pools(config: ConsoleConfig) -> list[PoolPlan]:
    """The pools `up` starts: one from the top-level settings (the flags, or a single `[[pools]]` entry, which the
    configuration already folded in), else one per `[[pools]]` entry, each with its own counts, profile, model and
    adapters, its instances' ids prefixed (`instance_prefixes`) and its ports after the previous pools' ones."""
    if len(config.pools) <= 1:
        return [
            PoolPlan(
                config.pool_name,
                config.served_model_name,
                config.profile,
                dict(config.lora.adapters),
                config.backend_settings(),
            )
        ]
    if config.attach:
        raise ConfigError("--attach names one pool's instances; it cannot be combined with several [[pools]]")
    if config.lora.adapters:
        names = ", ".join(sorted(config.lora.adapters))
        raise ConfigError(
            f"with several [[pools]] each LoRA adapter belongs to one pool: put {names} in that pool's `adapters` "
            "(not [lora] adapters or --lora-adapter), or add it at run time with `lora add NAME PATH --pool P`"
        )
    base = config.backend_settings()
    prefixes = instance_prefixes([p.pool_name for p in config.pools])
    plans, port = [], config.instance_base_port
    for p, prefix in zip(config.pools, prefixes, strict=True):
        emulator = base.emulator
        if p.adapters and config.backend == "emulator" and "enable_lora" not in emulator.model_fields_set:
            emulator = emulator.model_copy(update={"enable_lora": True})
        update: dict[str, Any] = {
            "prefill": p.prefill,
            "decode": p.decode,
            "profile": p.profile or config.profile,
            "model": p.path or config.model,
            "served_model_name": p.model,
            "instance_prefix": prefix,
            "instance_base_port": port,
            "emulator": emulator,
        }
        settings = base.model_copy(update=update)
        plans.append(PoolPlan(p.pool_name, p.model, settings.profile, dict(p.adapters), settings))
        if port:
            port += p.prefill + p.decode
    return plans


def cluster_label(plans: Sequence[PoolPlan]) -> str:
    """The run's cluster as the run store records it: `2P4D`, or per pool `A:1P1D+B:2P2D`."""
    if len(plans) == 1:
        return f"{plans[0].settings.prefill}P{plans[0].settings.decode}D"
    return "+".join(f"{p.name}:{p.settings.prefill}P{p.settings.decode}D" for p in plans)


async def start_backends(backends: Sequence[Backend]) -> list[list[Instance]]:
    """Start every pool's backend at once; when one fails (or the start is cancelled) the others stop what they
    started and the first failure is raised."""
    if len(backends) == 1:
        return [await backends[0].start()]
    results = await asyncio.gather(*(b.start() for b in backends), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await asyncio.gather(*(b.stop() for b in backends), return_exceptions=True)
        raise failed[0]
    return [r for r in results if not isinstance(r, BaseException)]


class PoolRuntime:
    """One pool's parts, built once by the controller: each answers for this pool's instances only."""

    services: RequestServices
    """What each of its LiveRequests uses (built by `serve`, once the shared parts exist)."""

    def __init__(
        self,
        plan: PoolPlan,
        config: ConsoleConfig,
        backend: Backend,
        instances: list[Instance] | dict[str, Instance],
        *,
        outcomes: Outcomes,
        recorder: RunRecorder,
        t0: float,
    ) -> None:
        self.plan = plan
        self.backend = backend
        self.profile = get_profile(plan.profile)
        self.instances: dict[str, Instance] = (
            instances if isinstance(instances, dict) else {i.id: i for i in instances}
        )
        """This pool's instances by id (the scaler adds and removes them here)."""
        self.advised = False
        """The advisor advises this pool: the gateway keys every request's prompt, since the advisor re-simulates
        the prefix caches whatever the active routing policy reads (set by the controller)."""
        self.dispatcher = d = Dispatcher(
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
            check_capability(backend, kind, d.policies[kind].name)
        if config.admission.enabled:
            d.use_slo_admission(config.admission)
        self.prefix = PrefixIndex(
            config.prefix,
            d,
            self.profile.block_size,
            default_tokenizer(config.backend, plan.settings.model, config.vllm.extra_args),
        )
        """Request prefix keys and the cache index's source (approximate, or KV events per instance)."""
        d.use_decisions(decision_log(config.decisions, lambda recs: recorder.decisions(recs, t0)))
        self.held = HeldRequests(d, self.profile, config.poll_interval_s)
        self.listeners = InstanceListeners()
        """Who hears that one of its instances joined, went down or left (subscribed here, the adapters last)."""
        self.health = InstanceHealth(config, self.instances, d, outcomes, self.held.release, self.listeners)
        self.listeners.subscribe(added=self.health.track_data_parallel, removed=self.health.instance_removed)
        self.listeners.subscribe(added=self.prefix.follow, down=self.prefix.lost, removed=self.prefix.removed)
        self.listeners.subscribe(added=lambda _: self.held.release())  # a new instance has room
        self.calibration = Calibrator(CalibrationFeed(self.profile, refit_every_s=0), d)
        """Each instance's step terms refitted online from its scrapes (the profile is the prior)."""
        self.health.scraped.append(self.calibration.scraped)
        self.listeners.subscribe(removed=self.calibration.forget)
        self.refusals = RefusalLines(outcomes.events, lambda: d.gate, pool=plan.name)
        """Admission's refusals as one event line per cause per few seconds (not one per request)."""
        self.pool = Pool(plan.name, plan.model, d, adapters=dict(plan.adapters))
        for inst in self.instances.values():
            d.add_instance(inst.id, inst.role)
            self.health.track_data_parallel(inst)
        self.migrations = Migrations(backend, d, self.instances, outcomes)
        scaler = Scaler(
            backend,
            d,
            self.instances,
            config,
            outcomes.metrics,
            outcomes,
            self.listeners,
            id_prefix=plan.settings.instance_prefix,
        )
        self.operations = Operations(backend, d, self.instances, scaler, self.migrations)

    def serve(
        self,
        config: ConsoleConfig,
        tenants: Tenants,
        outcomes: Outcomes,
        lora: LiveAdapters,
        arrivals: ArrivalNotes | None,
    ) -> RequestServices:
        """Its instances join the pools' adapters, and the RequestServices of its requests (built once, here)."""
        pool = self.pool
        self.listeners.subscribe(added=lambda inst: lora.instance_added(inst, pool), removed=lora.instance_removed)
        self.health.scraped.append(lora.observe)
        for inst in self.instances.values():
            lora.instance_added(inst, pool)
        self.services = RequestServices(
            dispatcher=self.dispatcher,
            instances=self.instances,
            tenants=tenants,
            held=self.held,
            health=self.health,
            outcomes=outcomes,
            migrations=self.migrations,
            metrics=outcomes.metrics,
            engine_priorities=Capability.PRIORITY in self.backend.capabilities,
            failure_migration_attempts=config.failure_migration_attempts,
            lora=lora,
            arrivals=arrivals,
        )
        return self.services

    # --- the tick --------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Held requests expire or go, breakers half-open, calibration refits, refusal lines; then the periodic
        policies, when due, and their decisions carried out."""
        self.held.expire()
        self.held.release()  # the prefill backlog drains with time, not only on events
        self.health.tick(now)
        self.calibration.tick(now)
        self.refusals.tick(now)
        d = self.dispatcher
        if now < d.next_periodic_at():
            return
        decisions = d.periodic(now)
        policies = d.policies
        self.operations.carry_out(decisions, policies[PolicyKind.SCALING].name, policies[PolicyKind.RESCHEDULE].name)

    # --- views ------------------------------------------------------------------------------------------
    def cluster(self) -> tuple[int, int]:
        """Its active instances serving prefill and decode."""
        d = self.dispatcher
        active = [i for i in self.instances.values() if str(d.phase_of(i.id)) == "active"]
        return sum(1 for i in active if i.role.serves_prefill()), sum(1 for i in active if i.role.serves_decode())

    def rows(self, now: float, lora: LiveAdapters) -> list[InstanceRow]:
        """Its instances as the state shows them, the ones still starting after (so a scale-out under way shows)."""
        d = self.dispatcher
        d.view.now = now
        loads = d.projected_loads()
        rows = [self._row(inst, loads, now, lora) for inst in self.instances.values()]
        for iid in d.view.instance_ids:
            if str(d.phase_of(iid)) == "starting":
                rows.append(self._starting(iid))
        return rows

    def _starting(self, iid: str) -> InstanceRow:
        d = self.dispatcher
        return InstanceRow(
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
            pool=self.pool.name,
            scraped=ScrapedCounters(),
        )

    def _row(self, inst: Instance, loads: Mapping[str, float], now: float, lora: LiveAdapters) -> InstanceRow:
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
            pool=self.pool.name,
            adapters=lora.adapters_on(inst.id),
            scraped=ScrapedCounters(
                prompt_tokens_total=s.prompt_tokens_total,
                generation_tokens_total=s.generation_tokens_total,
                success_total=s.success_total,
                preemptions_total=s.preemptions_total,
                failed_transfers_total=s.failed_transfers_total,
            ),
        )

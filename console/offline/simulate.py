"""Offline simulation runs: one trace, several policies on the same arrivals, each recorded as a run."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from core.dispatch import Dispatcher
from core.dispatch.prefix import APPROXIMATE_TTL_S
from core.perf import PerfProfile
from core.policies import registry
from core.sim.cluster import FAIL_REASONS, CacheParams, ClusterSimResult, ClusterSimulation, Mode
from core.sim.cluster.lora import DEFAULT_MAX_LORAS
from core.slo import SLOClass, summarize
from core.types import PolicyKind

if TYPE_CHECKING:
    from adapters.store import RunStore

ProgressFn = Callable[[str, int, int], None]

PrefixSource = Literal["precise", "approximate"]
"""Where routing learns what each simulated instance caches: precise = the instances' exact caches
(what vLLM's KV events deliver live), approximate = the router's own past decisions (what it sent
somewhere counts as cached there, for a TTL and up to the instance's capacity)."""
PREFIX_SOURCES: tuple[PrefixSource, ...] = ("precise", "approximate")


@dataclass
class SimPlan:
    """Everything one `sim` invocation runs."""

    arrivals: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    workload: str
    profile: PerfProfile
    n_prefill: int
    n_decode: int
    mode: Mode
    policies: list[tuple[str, dict[str, Any]]]
    slo: SLOClass
    seed: int = 0
    shadow: bool = True
    config: dict[str, Any] = field(default_factory=dict)
    queue: tuple[str, dict[str, Any]] = ("fcfs", {})
    """Queue policy (admission) for every run."""
    reschedule: tuple[str, dict[str, Any]] = ("none", {})
    scaling: tuple[str, dict[str, Any]] = ("static", {})
    priorities: np.ndarray | None = None
    """Per-request priority (from the trace), for priority queueing."""
    hash_ids: list[list[int]] | None = None
    """Per-request prefix-block hashes (Mooncake); with them (and `cache` on) every instance keeps
    a prefix cache (core/sim/cluster/cache.py)."""
    sessions: list[str] | None = None
    """Per-request session id (derived from the hash ids), for session affinity."""
    cache: CacheParams | None = None
    """How the KV cache is modelled (None: the defaults; on only when `hash_ids` are given)."""
    prefix_source: PrefixSource = "precise"
    """What routing reads of the caches (see PrefixSource)."""
    prefix_ttl_s: float | None = APPROXIMATE_TTL_S
    """The approximate source's TTL."""
    prefix_keys: list[tuple[int, ...]] | None = None
    """Per-request prefix keys computed beforehand (a live run's, console/advisor): the cache is modelled
    on them instead of keys derived from `hash_ids`."""
    tenants: list[str] | None = None
    """Per-request tenant (a live run's), for the queue policies that share between tenants."""
    slo_classes: list[str] | None = None
    """Per-request SLO class name; `slos` holds their targets (a class it lacks gets `slo`)."""
    slos: dict[str, SLOClass] | None = None
    """SLO targets by class name, beside `slo` (the default class)."""
    lora: list[str | None] | None = None
    """Per-request LoRA adapter (a trace's `lora` column or a synthetic mix; None: the base model): the
    simulated instances hold adapters in `max_loras` slots (core/sim/cluster/lora.py)."""
    max_loras: int = DEFAULT_MAX_LORAS
    """Adapter slots of each simulated instance (vLLM's --max-loras), with `lora`."""
    instance_profiles: dict[str, PerfProfile] | None = None
    """Simulated instance id ("p0", "d1") → the profile it runs on (the advisor's calibrated instances); the
    others run `profile` (core/sim/cluster/profiles.py)."""

    @property
    def cluster(self) -> str:
        return f"{self.n_prefill}P{self.n_decode}D"


def validate_policies(
    policies: list[tuple[str, dict[str, Any]]],
    others: dict[PolicyKind, tuple[str, dict[str, Any]]] | None = None,
) -> None:
    """Build each policy once so a bad name or param fails before any simulation runs."""
    for name, params in policies:
        registry.build(PolicyKind.ROUTING, name, params)
    for kind, (name, params) in (others or {}).items():
        registry.build(kind, name, params)


def run_one(
    plan: SimPlan, name: str, params: dict[str, Any], on_progress: ProgressFn | None = None
) -> tuple[dict[str, Any], ClusterSimResult]:
    """Simulate one policy; returns its metrics row and the raw per-request result."""
    others = [(n, p) for n, p in plan.policies if (n, p) != (name, params)] if plan.shadow else []
    dispatcher = Dispatcher(
        plan.profile,
        name,
        params,
        shadow=others,
        queue=plan.queue,
        reschedule=plan.reschedule,
        scaling=plan.scaling,
        true_lengths=True,
        survival_prior_max=int(plan.output_tokens.max()) if len(plan.output_tokens) else None,
        slo={"default": plan.slo, **(plan.slos or {})},
    )
    sim = ClusterSimulation(
        arrivals=plan.arrivals,
        prompt_tokens=plan.prompt_tokens,
        output_tokens=plan.output_tokens,
        profile=plan.profile,
        n_prefill=plan.n_prefill,
        n_decode=plan.n_decode,
        dispatcher=dispatcher,
        mode=plan.mode,
        priorities=plan.priorities,
        hash_ids=plan.hash_ids,
        sessions=plan.sessions,
        cache=plan.cache,
        tenants=plan.tenants,
        slo_classes=plan.slo_classes,
        prefix_keys=plan.prefix_keys,
        lora=plan.lora,
        max_loras=plan.max_loras,
        instance_profiles=plan.instance_profiles,
    )
    if sim.cache is not None and plan.prefix_source == "approximate":
        # the engine installed the exact lookup; replace it by the router's own record
        dispatcher.use_prefix_routes(
            sim.cache.block_size, plan.prefix_ttl_s, sim.cache.capacity_blocks, decode_only=True
        )
    started = time.perf_counter()
    result = sim.run(None if on_progress is None else lambda done, total: on_progress(name, done, total))
    wall = time.perf_counter() - started
    metrics = summarize(
        arrival=result.arrival,
        first_token=result.first_token,
        finish=result.finish,
        output_tokens=result.output_tokens,
        ok=result.ok,
        slo=plan.slo,
    )
    row: dict[str, Any] = {
        "policy": name,
        "params": params,
        **metrics,
        "optimal_assignment_ratio": result.assignment_ratio,
        "shadow_assignment_ratios": result.shadow_ratios,
        "preemptions": result.preemptions,
        "queue": plan.queue[0],
        "reschedule": plan.reschedule[0],
        "scaling": plan.scaling[0],
        "queued": result.queued,
        "shed": result.shed,
        "expired": result.expired,
        "scale_events": len(result.scale_events),
        "mode": plan.mode,
        "cluster": plan.cluster,
        "profile": plan.profile.name,
        "sim_wall_s": wall,
        "requests_per_s_simulated": len(plan.arrivals) / wall if wall > 0 else None,
    }
    if result.cache_block_size:  # the cache was modelled (a trace with prefix structure)
        row.update(cache_summary(result))
        row["prefix_source"] = plan.prefix_source
    if sim.lora is not None:
        row.update(lora_summary(result, plan.max_loras))
    return row, result


def lora_summary(result: ClusterSimResult, max_loras: int) -> dict[str, Any]:
    """A run's LoRA figures: adapter loads (in all and per minute of the run), hits and evictions."""
    span = float(np.nanmax(result.finish) - result.arrival[0]) if bool(result.ok.any()) else 0.0
    return {
        "max_loras": max_loras,
        "lora_loads": result.lora_loads,
        "lora_loads_per_min": 60.0 * result.lora_loads / span if span > 0 else None,
        "lora_hits": result.lora_hits,
        "lora_evictions": result.lora_evictions,
    }


def cache_summary(result: ClusterSimResult) -> dict[str, Any]:
    """A run's prefix-cache figures: prefill-side hit rate, KV moved P→D (tokens, and as a share of
    the prompt tokens of the requests that reached decode), and the decode side's local hits."""
    reached = ~np.isnan(result.decode_start)
    prompts = int(result.prompt_tokens[reached].sum())
    moved = int(result.kv_transferred_tokens.sum())
    return {
        "prefix_hit_rate": result.hit_rate,
        "cached_tokens": int(result.cached_tokens.sum()),
        "kv_transferred_tokens": moved,
        "kv_transferred_share": moved / prompts if prompts else 0.0,
        "decode_cached_tokens": int(result.decode_cached_tokens.sum()),
        "decode_only": int(np.count_nonzero(reached & (result.prefill_instance < 0) & ~np.isnan(result.prefill_start))),
        "cache_block_size": result.cache_block_size,
    }


def _nullable(values: np.ndarray) -> list[float | None]:
    return [None if x != x else x for x in values.tolist()]  # x != x only for NaN


def request_rows(result: ClusterSimResult, slo: SLOClass) -> list[dict[str, Any]]:
    """Per-request records for the run store (times relative to the trace start)."""
    prefill_names = result.prefill_ids
    decode_names = result.decode_ids
    ok = result.ok
    first, finish, arrival, out = (
        result.first_token,
        result.finish,
        result.arrival,
        result.output_tokens,
    )
    bad = ~ok
    ttft = np.where(bad, np.nan, first - arrival)
    tpot = np.where(bad, np.nan, np.where(out > 1, (finish - first) / np.maximum(out - 1, 1), 0.0))
    e2e = np.where(bad, np.nan, finish - arrival)
    met = ok & (np.nan_to_num(ttft, nan=np.inf) <= slo.ttft_s) & (np.nan_to_num(tpot, nan=np.inf) <= slo.tpot_s)
    columns: dict[str, list[Any]] = {
        "request_id": [str(i) for i in range(len(arrival))],
        "arrival": arrival.tolist(),
        "prompt_tokens": result.prompt_tokens.tolist(),
        "output_tokens": [int(o) if k else None for o, k in zip(out.tolist(), ok.tolist(), strict=True)],
        "max_tokens": out.tolist(),
        "prefill_instance": [prefill_names[p] if p >= 0 else None for p in result.prefill_instance.tolist()],
        "decode_instance": [decode_names[d] if d >= 0 else None for d in result.decode_instance.tolist()],
        "prefill_start": _nullable(result.prefill_start),
        "prefill_end": _nullable(result.prefill_end),
        "decode_start": _nullable(result.decode_start),
        "first_token": _nullable(first),
        "finish": _nullable(finish),
        "ttft": _nullable(ttft),
        "tpot": _nullable(tpot),
        "e2e": _nullable(e2e),
        "status": ["ok" if k else "failed" for k in ok.tolist()],
        "reason": [None if s == "ok" else FAIL_REASONS.get(s, s) for s in result.status.tolist()],
        "slo_met": met.tolist(),
    }
    keys = list(columns)
    return [dict(zip(keys, values, strict=True)) for values in zip(*columns.values(), strict=True)]


_SCALE_EVENT_NAMES = {
    ("add", "starting"): "starting",
    ("add", "active"): "added",
    ("remove", "draining"): "draining",
    ("remove", "stopped"): "removed",
    ("flip", "draining"): "draining",
    ("flip", "active"): "flipped",
}


def instance_event_rows(result: ClusterSimResult) -> list[dict[str, Any]]:
    """The run's scale steps as run-store instance events (event names as live runs use)."""
    return [
        {
            "t": e.time,
            "instance_id": e.instance_id,
            "event": _SCALE_EVENT_NAMES.get((e.action, e.phase), e.phase),
            "detail": f"{e.action} {e.role}: {e.reason}",
        }
        for e in result.scale_events
    ]


def json_safe(x: Any) -> Any:
    """NaN and infinities become null (the run store keeps JSON)."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def store_result(
    store: RunStore,
    run_id: str,
    result: ClusterSimResult,
    slo: SLOClass,
    summary: dict[str, Any],
    *,
    requests: bool = True,
) -> None:
    """Write a finished simulation into its run: requests (unless `requests` is off), instance and
    policy events, then close the run with `summary`."""
    if requests:
        store.add_requests(run_id, request_rows(result, slo))
    events = instance_event_rows(result)
    if events:
        store.write_batch(run_id, [], [], [], events)
    for ev in result.policy_events:
        store.add_policy_event(
            run_id, t=ev.time, kind=str(ev.kind), old=ev.old, new=ev.new, params=ev.params, source="sim"
        )
    store.finish_run(run_id, status="completed", summary=json_safe(summary))

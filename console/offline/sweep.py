"""Sweeps: plan and run grid points (as Ray tasks), record each in the run store, compare them."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from console.errors import ConsoleError
from console.offline.simulate import SimPlan, run_one, store_result
from console.offline.sweep_config import Point, WorkloadRef
from core.perf import PerfProfile
from core.sim.cluster import ClusterSimResult
from core.slo import SLOClass
from core.traces import Trace, read_trace, synthetic_trace

if TYPE_CHECKING:
    from adapters.store import RunInfo, RunStore

WALL_CLOCK_KEYS = ("sim_wall_s", "requests_per_s_simulated")
"""Summary fields that measure the machine, not the simulation (they differ between runs)."""
COMPARED = ("tpot_p99", "ttft_p99", "slo_attainment")
"""The metrics of the comparison table, in its column order."""


class SweepError(ConsoleError):
    """A sweep cannot run: Ray is missing or unreachable, or its options contradict each other."""


# --- planning (shared with benchmarks/routing_sweep.py) --------------------------------------


def saturation_tps(profile: PerfProfile) -> float:
    """Peak throughput of one decode instance (tokens/s) over N ≤ max_num_seqs running."""
    return max(profile.total_tps(n) for n in range(1, profile.max_num_seqs + 1))


def load_rate(load: float, n_decode: int, profile: PerfProfile, mean_output: float) -> float:
    """The arrival rate (req/s) that is `load` × the decode instances' saturation throughput."""
    return load * n_decode * saturation_tps(profile) / mean_output


def traffic(
    workload: WorkloadRef,
    *,
    requests: int,
    seed: int,
    rate: float | None,
    load: float | None,
    burstiness: float | None,
    n_decode: int,
    profile: PerfProfile,
) -> Trace:
    """The arrivals and lengths of one point: a synthetic workload or a trace, at a rate or load."""
    if workload.trace is None:
        if load is not None:
            lengths = synthetic_trace(workload.name, requests=requests, rate=1.0, seed=seed)
            rate = load_rate(load, n_decode, profile, float(lengths.output_tokens.mean()))
        if rate is None:
            raise SweepError(f"synthetic workload {workload.name}: needs a rate or a load")
        return synthetic_trace(
            workload.name,
            requests=requests,
            rate=rate,
            seed=seed,
            burstiness=1.0 if burstiness is None else burstiness,
        )
    trace = read_trace(workload.trace, workload.format, seed=seed, limit=workload.limit)
    if load is not None:
        rate = load_rate(load, n_decode, profile, float(trace.output_tokens.mean()))
    return trace if rate is None else trace.with_rate(rate)


def plan_point(point: Point, profile: PerfProfile) -> tuple[SimPlan, Trace]:
    """The simulation of one grid point, as `sim` would run it."""
    n_prefill, n_decode = point.shape
    trace = traffic(
        point.workload,
        requests=point.requests,
        seed=point.seed,
        rate=point.rate,
        load=point.load,
        burstiness=point.burstiness,
        n_decode=n_decode,
        profile=profile,
    )
    shadow = [(name, json.loads(params)) for name, params in point.shadow]
    plan = SimPlan(
        arrivals=trace.arrivals,
        prompt_tokens=trace.prompt_tokens,
        output_tokens=trace.output_tokens,
        workload=point.workload.name,
        profile=profile,
        n_prefill=n_prefill,
        n_decode=n_decode,
        mode=point.mode,  # type: ignore[arg-type]
        policies=[(point.policy.name, point.params), *shadow],
        slo=SLOClass(ttft_s=point.slo[0], tpot_s=point.slo[1]),
        seed=point.seed,
        shadow=bool(shadow),
        queue=point.others["queue"],
        reschedule=point.others["reschedule"],
        scaling=point.others["scaling"],
        priorities=trace.priority,
    )
    return plan, trace


@dataclass
class PointOutcome:
    """What one grid point's simulation hands back to the driver."""

    row: dict[str, Any]
    """The metrics row `sim` stores as a run's summary, plus the point's arrival rate."""
    result: ClusterSimResult
    source: str
    """Where the trace came from (the run's `workload`)."""


def run_point(point: Point, profile: PerfProfile) -> PointOutcome:
    """Simulate one grid point in this process (the body of the Ray task)."""
    plan, trace = plan_point(point, profile)
    row, result = run_one(plan, point.policy.name, point.params)
    span = float(plan.arrivals[-1] - plan.arrivals[0]) if len(plan.arrivals) > 1 else 0.0
    row["rate_rps"] = (len(plan.arrivals) - 1) / span if span > 0 else None
    row["label"] = point.policy.label
    return PointOutcome(row=row, result=result, source=trace.source or trace.name)


def deterministic(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary without its wall-clock fields: equal for equal points on any machine."""
    return {k: v for k, v in summary.items() if k not in WALL_CLOCK_KEYS}


# --- the run store ---------------------------------------------------------------------------


def stored_points(store: RunStore, sweep: str) -> dict[str, RunInfo]:
    """Point key → its newest completed run among the runs tagged with `sweep`."""
    done: dict[str, RunInfo] = {}
    for info in store.sweep_runs(sweep):
        key = (info.config.get("sweep") or {}).get("point")
        if key and info.status == "completed":
            done[key] = info
    return done


def record_point(
    store: RunStore,
    sweep: str,
    point: Point,
    outcome: PointOutcome | None,
    *,
    store_requests: bool = True,
    error: str | None = None,
) -> str:
    """One run per grid point, tagged with the sweep and the point's key and coordinates."""
    n_prefill, n_decode = point.shape
    run_id = store.create_run(
        kind="sim",
        backend="sim",
        cluster=point.cluster,
        workload=outcome.source if outcome else point.workload.name,
        seed=point.seed,
        policy=point.policy.label,
        sweep=sweep,
        config={
            "profile": point.profile,
            "mode": point.mode,
            "policy": point.policy.name,
            "params": point.params,
            **{kind: {"name": n, "params": p} for kind, (n, p) in point.others.items()},
            "slo": {"ttft_s": point.slo[0], "tpot_s": point.slo[1]},
            "requests": point.requests if point.workload.trace is None else None,
            "sweep": {"name": sweep, "point": point.key, "coords": point.coords()},
        },
    )
    if outcome is None:
        store.finish_run(run_id, status="failed", summary={"error": error or "failed"})
        return run_id
    store_result(
        store,
        run_id,
        outcome.result,
        SLOClass(ttft_s=point.slo[0], tpot_s=point.slo[1]),
        outcome.row,
        requests=store_requests,
    )
    return run_id


# --- Ray -------------------------------------------------------------------------------------


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise SweepError(
            "sweep runs its grid on Ray, which is not installed: pip install 'sibyl-console[ray]'"
        ) from None
    return ray


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a cluster address nothing listens at (Ray itself retries for minutes)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" and the like: Ray resolves those
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise SweepError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


@contextmanager
def ray_session(address: str | None, workers: int | None) -> Iterator[Any]:
    """Connect to `address`, or start a local Ray of `workers` CPUs; shut it down at the end."""
    ray = import_ray()
    if address is not None and workers is not None:
        raise SweepError("--workers sizes a local Ray; a cluster at --ray-address has its own CPUs")
    if ray.is_initialized():  # an embedding program's own session: use it, leave it running
        yield ray
        return
    try:
        if address is None:
            ray.init(address="local", num_cpus=workers, include_dashboard=False, logging_level=logging.WARNING)
        else:
            _probe(address)
            ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as e:
        where = f"the Ray cluster at {address}" if address else "a local Ray"
        raise SweepError(f"cannot start or reach {where}: {e}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def execute(
    ray: Any,
    points: Sequence[Point],
    profile: PerfProfile,
    on_done: Callable[[Point, PointOutcome | None, str | None], None],
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """Run every point as a Ray task (1 CPU each); hand each outcome (or error) to `on_done` as
    it finishes. When `stop()` turns true (checked between points) or on an interrupt, the tasks
    still pending are cancelled and KeyboardInterrupt is raised."""
    task = ray.remote(num_cpus=1)(run_point)
    profile_ref = ray.put(profile)
    pending = {task.remote(p, profile_ref): p for p in points}
    try:
        while pending:
            if stop():
                raise KeyboardInterrupt
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            for ref in ready:
                point = pending.pop(ref)
                try:
                    outcome = ray.get(ref)
                except ray.exceptions.RayError as e:
                    on_done(point, None, _first_line(e))
                else:
                    on_done(point, outcome, None)
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)


def _first_line(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    text = f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


# --- the comparison --------------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    a = np.asarray(values, dtype=float)
    return {
        "mean": float(a.mean()),
        "std": float(a.std(ddof=1)) if len(a) > 1 else None,
        "min": float(a.min()),
        "max": float(a.max()),
    }


def comparison(points: Sequence[Point], summaries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload × mode × shape × burstiness × rate/load: each policy's metrics over seeds.

    `summaries` maps point keys to stored summaries; points without one are counted as missing.
    """
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for p in points:
        gkey = (p.workload.name, p.mode, p.cluster, p.burstiness, p.load, p.rate)
        group = groups.setdefault(
            gkey,
            {
                "workload": p.workload.name,
                "mode": p.mode,
                "cluster": p.cluster,
                "burstiness": p.burstiness,
                "load": p.load,
                "rate": p.rate,
                "policies": {},
            },
        )
        entry = group["policies"].setdefault(
            p.policy.label, {"policy": p.policy.label, "seeds": 0, "missing": 0, "values": {m: [] for m in COMPARED}}
        )
        summary = summaries.get(p.key)
        if summary is None:
            entry["missing"] += 1
            continue
        entry["seeds"] += 1
        for m in COMPARED:
            if summary.get(m) is not None:
                entry["values"][m].append(float(summary[m]))
    out = []
    for group in groups.values():
        rows = []
        for entry in group["policies"].values():
            values = entry.pop("values")
            rows.append({**entry, **{m: _spread(values[m]) for m in COMPARED}})
        out.append({**group, "policies": rows})
    return out


def tpot_curves(table: Sequence[dict[str, Any]]) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """For plots: per workload/mode/shape/burstiness, per policy, P99 TPOT (ms) against rate or load."""
    curves: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for group in sorted(table, key=lambda g: g["load"] if g["load"] is not None else g["rate"] or 0.0):
        x = group["load"] if group["load"] is not None else group["rate"]
        if x is None:
            continue
        title = group_title(group, with_level=False)
        for row in group["policies"]:
            y = row["tpot_p99"]["mean"]
            if y is None:
                continue
            xs, ys = curves.setdefault(title, {}).setdefault(row["policy"], ([], []))
            xs.append(float(x))
            ys.append(y * 1000)
    return curves


def group_title(group: dict[str, Any], with_level: bool = True) -> str:
    parts = [group["workload"], group["mode"], group["cluster"]]
    if group["burstiness"] is not None:
        parts.append("poisson" if group["burstiness"] == 1.0 else f"burstiness {group['burstiness']:g}")
    if with_level:
        if group["load"] is not None:
            parts.append(f"load {group['load']:g}")
        elif group["rate"] is not None:
            parts.append(f"{group['rate']:g} req/s")
        else:
            parts.append("recorded rate")
    return " · ".join(parts)


def x_label(table: Sequence[dict[str, Any]]) -> str:
    return "load (share of decode saturation)" if any(g["load"] is not None for g in table) else "rate (req/s)"

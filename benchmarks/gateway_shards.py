"""Scaling the gateway past one process (issue 18): K gateway shards routing one cluster.

The design evaluated (README.md, Architecture, "Scaling the gateway"): requests are sharded by a
hash of their id over K gateway processes. Each shard has its own Dispatcher (its own request
table and estimators) and sees its own requests in real time. It sees the other shards' requests
only through a state exchange every Δ seconds: a snapshot of their in-flight rows (decode and
prefill instance, state, prompt, progress, projected handoff), their remaining prefill backlog per
instance, and the output lengths (and decode times) of what they finished since the last exchange,
which feed its survival and decode-rate estimators.

How it is simulated: the core simulator (core.sim.Simulation: cluster model, arrival process,
decode models) is reused unchanged. It drives a `ShardedDispatcher`, which offers the Dispatcher
methods the simulator calls and hands every event of a request to the real Dispatcher of the
shard that owns it. Each shard's routing policy is wrapped (`ShardRouting`) so that every decision
reads the shard's own view merged with the others' rows as of the last exchange. The exchange
runs at the first dispatcher call at or after each multiple of Δ. A dispatcher's state changes
only when it is called, so that is its state as of the boundary. Δ = 0 exchanges before every call.

Measured per (policy, K, Δ): P99 and mean TPOT, P99 TTFT, SLO attainment, the optimal-assignment
ratio against the true global load at each handoff, the view error (how far a deciding shard's
decode load vector is from the truth), the wall time per routing decision, and the exchange's
rows and bytes. `--rtt` also measures a localhost HTTP round trip (httpx client in this process,
uvicorn server in a child process) as the extra latency per request of the alternative design:
one decision service that every gateway process asks.

`--push-latency S` adds a variant: every routing decision also reaches the other shards S seconds
after it is taken (until the next snapshot supersedes it).

Usage (figures in benchmarks/README.md, "Scaling the gateway past one process"):
  python benchmarks/gateway_shards.py --seeds 7,8,9                 # 3 policies × K × Δ, + RTT
  python benchmarks/gateway_shards.py --seeds 7,8,9 --policies sibyl,least_load \\
      --push-latency 0.0005 --no-rtt                                # the push variant
  python benchmarks/gateway_shards.py --requests 1500 --shards 1,4 --deltas 0.5 --no-rtt
  python benchmarks/gateway_shards.py --rtt-only --rtt 5000
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from console.sweep import traffic  # noqa: E402
from console.sweep_config import WorkloadRef  # noqa: E402
from core.dispatch import Dispatcher  # noqa: E402
from core.perf import PerfProfile, get_profile  # noqa: E402
from core.policies.base import (  # noqa: E402
    BindPoint,
    PolicyParams,
    QueuePolicy,
    RoutingPolicy,
    RoutingPolicyBase,
)
from core.request_table import RUNNING, RequestTable  # noqa: E402
from core.sim import Simulation  # noqa: E402
from core.sim.engine import Mode, SimResult  # noqa: E402
from core.slo import SLOClass, summarize  # noqa: E402
from core.traces import Trace  # noqa: E402
from core.types import Admission, Assignment, InstancePhase, PolicyKind, Request, Role  # noqa: E402
from core.view import ClusterView  # noqa: E402

COLUMNS = (
    "l_in", "l_obs", "t_obs", "v", "tau", "arrival", "decode_start", "max_out", "ttft_slo",
    "tpot_slo", "inst", "prefill", "state", "rank",
)  # fmt: skip
"""Every column of core.request_table.RequestTable (the simulation copies them all)."""

EXCHANGE_ROW = np.dtype(
    [
        ("request_id", "<u8"),
        ("decode", "<i2"),
        ("prefill", "<i2"),
        ("state", "u1"),
        ("prompt_tokens", "<u4"),
        ("max_tokens", "<u4"),
        ("generated", "<f4"),
        ("observed_at", "<f8"),
        ("rate", "<f4"),
        ("handoff_at", "<f8"),
    ]
)
"""One in-flight row on the wire, packed: what SIBYL reads of a row (45 bytes)."""
FINISHED_ROW = np.dtype([("output_tokens", "<u4"), ("decode_s", "<f4")])
"""One finished request on the wire: it feeds the survival and decode-rate estimators (8 bytes)."""
BACKLOG_BYTES = 4
"""Per instance and exchange: the sender's remaining prefill work there (float32 seconds)."""

_M64 = (1 << 64) - 1


def shard_of(rid: Hashable, k: int) -> int:
    """The shard that owns a request: a 64-bit mix (splitmix64) of an integer id, blake2b of any
    other, modulo K. Stable across processes (no hash randomisation)."""
    if k == 1:
        return 0
    if isinstance(rid, int | np.integer):
        x = (int(rid) + 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        x ^= x >> 31
    else:
        x = int.from_bytes(hashlib.blake2b(str(rid).encode(), digest_size=8).digest(), "little")
    return x % k


@dataclass
class Snapshot:
    """What one shard publishes at an exchange, as of time `t`."""

    t: float
    n: int
    cols: dict[str, np.ndarray]
    """Its own in-flight rows (every table column)."""
    running_n: np.ndarray
    pending_n: np.ndarray
    prefill_n: np.ndarray
    backlog: np.ndarray
    """Seconds of prefill work it projects left on each instance at `t`."""
    finished: list[tuple[int, float]]
    """(output tokens, decode seconds or -1) of what it finished since the previous exchange."""


@dataclass
class Foreign:
    """What one shard knows of all the others: their snapshots, merged."""

    t: float
    m: int
    cols: dict[str, np.ndarray]
    running_n: np.ndarray
    pending_n: np.ndarray
    prefill_n: np.ndarray
    backlog: np.ndarray


@dataclass
class Pushed:
    """A routing decision one shard pushed to the others at once (the `push` variant)."""

    origin: int
    at: float
    """When it was routed (its prefill work joins the instance's queue then)."""
    visible_at: float
    """When the others have it (`at` + the push latency)."""
    row: dict[str, float]
    prefill: int
    decode: int
    prefill_s: float


class MergedTable(RequestTable):
    """A read-only request table for one decision: the shard's own rows, then the other shards'
    rows as of the last exchange. Only the columns are filled (policies read columns); it does not
    call RequestTable.__init__, which would allocate columns it replaces at once."""

    def __init__(self, own: RequestTable, foreign: Foreign) -> None:
        n0 = own.n
        self.n = self.capacity = n0 + foreign.m
        self.ids = []
        self.row = {}
        for name in COLUMNS:
            setattr(self, name, np.concatenate((getattr(own, name)[:n0], foreign.cols[name])))


class ShardRouting:
    """One shard's routing policy: the real policy, deciding on the shard's merged view."""

    kind: ClassVar[PolicyKind] = PolicyKind.ROUTING

    def __init__(self, inner: RoutingPolicy, gateway: ShardedDispatcher, shard: int) -> None:
        self.inner = inner
        self.gateway = gateway
        self.shard = shard
        self.name: str = inner.name
        self.params: PolicyParams = inner.params
        self.bind_at: BindPoint = inner.bind_at
        self.needs_progress: bool = inner.needs_progress
        self.needs_true_lengths: bool = inner.needs_true_lengths

    def _view(self, view: ClusterView) -> ClusterView:
        return self.gateway.merged_view(self.shard, view)

    def route(self, request: Request, view: ClusterView) -> Assignment:
        return self.inner.route(request, self._view(view))

    def choose_decode(self, request: Request, view: ClusterView) -> int:
        return self.inner.choose_decode(request, self._view(view))

    def display_load(self, view: ClusterView) -> np.ndarray:
        return self.inner.display_load(self._view(view))

    def assign_targets(self, request: Request, view: ClusterView, queue: QueuePolicy) -> None:
        if type(self.inner).assign_targets is RoutingPolicyBase.assign_targets:
            return  # the base's no-op: no view to build
        self.inner.assign_targets(request, self._view(view), queue)

    def observe_completion(
        self, request: Request, ttft_s: float, tpot_s: float, queue_s: float
    ) -> None:
        self.inner.observe_completion(request, ttft_s, tpot_s, queue_s)

    def close(self) -> None:
        self.inner.close()


class ShardedDispatcher:
    """K gateway shards in front of one cluster, offering the Dispatcher methods that
    core.sim.Simulation calls (static scaling, no reschedule: periodic policies are not modelled).

    Every request belongs to shard `shard_of(id, K)`, whose own Dispatcher gets all its events.
    With K = 1 it is exactly the single dispatcher (nothing is merged or exchanged).
    """

    def __init__(
        self,
        k: int,
        delta: float,
        make_dispatcher: Callable[[], Dispatcher],
        policy: Callable[[], RoutingPolicy] | None = None,
        push_latency: float | None = None,
    ) -> None:
        """`policy` builds each shard's routing policy (default: the one its dispatcher built).

        `push_latency` (seconds; None: off) is the `push` variant: besides the periodic snapshots,
        every routing decision (the new row and its prefill reservation) reaches the other shards
        that long after it is taken; the next snapshot supersedes it.
        """
        if k < 1:
            raise ValueError("K must be >= 1")
        if delta < 0:
            raise ValueError("the exchange period must be >= 0")
        self.k = k
        self.delta = delta
        self.shards = [make_dispatcher() for _ in range(k)]
        for s, d in enumerate(self.shards):
            inner = policy() if policy is not None else d.routing
            d.policies[PolicyKind.ROUTING] = ShardRouting(inner, self, s)
        self._owner: dict[Hashable, int] = {}
        self._finished: list[list[tuple[int, float]]] = [[] for _ in range(k)]
        self._snaps: list[Snapshot] = []
        self._foreign: list[Foreign | None] = [None] * k
        self._next_exchange = 0.0
        self.push_latency = push_latency
        self._pushed: list[Pushed] = []
        self.pushes = 0
        # measurements
        self.exchanges = 0
        self.exchange_rows: list[int] = []
        """Per exchange: in-flight rows published (all shards together)."""
        self.exchange_bytes: list[int] = []
        """Per exchange: bytes sent, every shard to each of the K − 1 others."""
        self.decision_s: list[float] = []
        """Wall time of each routing decision (Dispatcher.route of the owning shard)."""
        self.merge_s = 0.0
        """Wall time spent building merged views (a simulation artefact: a live shard would keep
        the others' rows in its table between exchanges instead of merging per decision)."""
        self.view_errors: list[float] = []
        """Per decision: Σ_j |seen_j − true_j| / Σ_j true_j over decode instances, with load =
        running + pending requests (0 when the deciding shard sees the truth)."""
        self.hits = 0
        self.total = 0

    # --- ownership and the exchange -------------------------------------------------------------
    def shard_of(self, rid: Hashable) -> int:
        s = self._owner.get(rid)
        if s is None:
            s = self._owner[rid] = shard_of(rid, self.k)
        return s

    def _d(self, rid: Hashable) -> Dispatcher:
        return self.shards[self.shard_of(rid)]

    def _tick(self, now: float) -> None:
        if self.k == 1:
            return
        if self.delta == 0:
            self._exchange(now)
        elif now >= self._next_exchange:
            at = math.floor(now / self.delta) * self.delta
            self._exchange(at)
            self._next_exchange = at + self.delta

    def _snapshot(self, s: int, t: float) -> Snapshot:
        v = self.shards[s].view
        tab = v.table
        n = tab.n
        finished, self._finished[s] = self._finished[s], []
        return Snapshot(
            t=t,
            n=n,
            cols={c: getattr(tab, c)[:n].copy() for c in COLUMNS},
            running_n=v.running_n.copy(),
            pending_n=v.pending_n.copy(),
            prefill_n=v.prefill_n.copy(),
            backlog=np.maximum(v.prefill_free_at - t, 0.0),
            finished=finished,
        )

    def _exchange(self, t: float) -> None:
        """Every shard publishes its snapshot; every other shard takes it in."""
        snaps = [self._snapshot(s, t) for s in range(self.k)]
        for s, d in enumerate(self.shards):
            survival, rate = d.view.survival, d.view.decode_rate
            for o, snap in enumerate(snaps):
                if o == s:
                    continue
                for length, seconds in snap.finished:
                    survival.observe(length)
                    if seconds > 0:
                        rate.observe(length, seconds)
        self._snaps = snaps
        self._foreign = [None] * self.k
        self._pushed = []  # every decision pushed so far is in these snapshots
        self.exchanges += 1
        rows = sum(x.n for x in snaps)
        n_inst = self.shards[0].view.n_instances
        sent = sum(
            x.n * EXCHANGE_ROW.itemsize
            + len(x.finished) * FINISHED_ROW.itemsize
            + n_inst * BACKLOG_BYTES
            for x in snaps
        )
        self.exchange_rows.append(rows)
        self.exchange_bytes.append(sent * (self.k - 1))

    def _foreign_of(self, s: int) -> Foreign | None:
        f = self._foreign[s]
        if f is None and self._snaps:
            others = [x for o, x in enumerate(self._snaps) if o != s]
            f = self._foreign[s] = Foreign(
                t=others[0].t,
                m=sum(x.n for x in others),
                cols={c: np.concatenate([x.cols[c] for x in others]) for c in COLUMNS},
                running_n=np.sum([x.running_n for x in others], axis=0),
                pending_n=np.sum([x.pending_n for x in others], axis=0),
                prefill_n=np.sum([x.prefill_n for x in others], axis=0),
                backlog=np.sum([x.backlog for x in others], axis=0),
            )
        return f

    def foreign_at(self, s: int, now: float) -> Foreign | None:
        """What shard s knows of the others at `now`: the last snapshots, plus (push variant) the
        decisions pushed since that have reached it. Their prefill work is drained as a fluid
        queue per instance: the snapshot's backlog from its time, each decision's from when it
        was taken."""
        f = self._foreign_of(s)
        if f is None or not self._pushed:
            return f
        seen = [x for x in self._pushed if x.origin != s and x.visible_at <= now]
        if not seen:
            return f
        running_n, pending_n, prefill_n = f.running_n, f.pending_n.copy(), f.prefill_n.copy()
        rem, last = f.backlog.copy(), f.t
        for x in sorted(seen, key=lambda x: x.at):
            np.maximum(rem - (x.at - last), 0.0, out=rem)
            rem[x.prefill] += x.prefill_s
            last = x.at
            prefill_n[x.prefill] += 1
            if x.decode >= 0:
                pending_n[x.decode] += 1
        np.maximum(rem - (now - last), 0.0, out=rem)
        cols = {
            c: np.concatenate(
                (f.cols[c], np.array([x.row[c] for x in seen], dtype=f.cols[c].dtype))
            )
            for c in COLUMNS
        }
        return Foreign(now, f.m + len(seen), cols, running_n, pending_n, prefill_n, rem)

    def merged_view(self, s: int, view: ClusterView) -> ClusterView:
        """Shard s's view for one decision: its own rows and counts (fresh) plus the others' as of
        the last exchange; the prefill projection adds their backlog, drained since at full speed."""
        if self.k == 1:
            return view
        t0 = time.perf_counter()
        now = view.now
        f = self.foreign_at(s, now)
        if f is None:
            return view
        free_at = np.maximum(view.prefill_free_at, now) + np.maximum(f.backlog - (now - f.t), 0.0)
        merged = dataclasses.replace(
            view,
            table=MergedTable(view.table, f),
            prefill_free_at=free_at,
            running_n=view.running_n + f.running_n,
            pending_n=view.pending_n + f.pending_n,
            prefill_n=view.prefill_n + f.prefill_n,
        )
        self.merge_s += time.perf_counter() - t0
        return merged

    def true_decode_load(self) -> np.ndarray:
        """Running + pending requests per instance index, over every shard's own rows."""
        out: np.ndarray = np.sum([d.view.running_n + d.view.pending_n for d in self.shards], axis=0)
        return out

    # --- instances and admission ----------------------------------------------------------------
    @property
    def view(self) -> ClusterView:
        """Shard 0's view: instance ids, roles and masks are the same on every shard."""
        return self.shards[0].view

    def add_instance(
        self,
        instance_id: str,
        role: Role,
        healthy: bool = True,
        *,
        phase: InstancePhase = InstancePhase.ACTIVE,
    ) -> int:
        xs = {d.add_instance(instance_id, role, healthy, phase=phase) for d in self.shards}
        if len(xs) != 1:
            raise RuntimeError("shards disagree on instance indices")
        if self._snaps:
            self._snaps, self._foreign = [], [None] * self.k
            self._next_exchange = -math.inf  # snapshots with the new instance at the next call
        return xs.pop()

    def index_of(self, instance_id: str) -> int:
        return self.shards[0].index_of(instance_id)

    def in_flight(self, instance_id: str) -> int:
        return sum(d.in_flight(instance_id) for d in self.shards)

    @property
    def needs_progress(self) -> bool:
        return self.shards[0].needs_progress

    @property
    def queue(self) -> QueuePolicy:
        return self.shards[0].queue

    @property
    def admission(self) -> bool:
        return any(len(d.admission) for d in self.shards)

    def admit(self, request: Request, now: float) -> Admission:
        self._tick(now)
        return self._d(request.id).admit(request, now)

    def queue_depth(self) -> int:
        return sum(d.queue_depth() for d in self.shards)

    def release(self, now: float) -> list[Request]:
        self._tick(now)
        return [r for d in self.shards for r in d.release(now)]

    def expire(self, now: float) -> list[Request]:
        return [r for d in self.shards for r in d.expire(now)]

    def next_expiry_at(self) -> float:
        return min(d.next_expiry_at() for d in self.shards)

    # --- the request lifecycle, each event to the owning shard ----------------------------------
    def route(self, request: Request, now: float) -> Assignment:
        self._tick(now)
        d = self._d(request.id)
        if self.k > 1:
            v = d.view
            truth = self.true_decode_load()
            f = self.foreign_at(self.shard_of(request.id), now)
            seen = v.running_n + v.pending_n
            if f is not None:
                seen = seen + f.running_n + f.pending_n
            mask = v.decode_mask()
            self.view_errors.append(
                float(np.abs(seen - truth)[mask].sum()) / max(float(truth[mask].sum()), 1.0)
            )
        t0 = time.perf_counter()
        a = d.route(request, now)
        self.decision_s.append(time.perf_counter() - t0)
        if self.push_latency is not None and self.k > 1:
            t = d.view.table
            i = t.row[request.id]
            self._pushed.append(
                Pushed(
                    origin=self.shard_of(request.id),
                    at=now,
                    visible_at=now + self.push_latency,
                    row={c: getattr(t, c)[i] for c in COLUMNS},
                    prefill=int(t.prefill[i]),
                    decode=int(t.inst[i]),
                    prefill_s=float(d.view.prefill_time(request.prompt_tokens)),
                )
            )
            self.pushes += 1
        return a

    def bind_late(self, request_id: Hashable, now: float) -> str:
        self._tick(now)
        return self._d(request_id).bind_late(request_id, now)

    def on_prefill_start(self, rid: Hashable, now: float) -> None:
        self._tick(now)
        self._d(rid).on_prefill_start(rid, now)

    def on_prefill_end(self, rid: Hashable, now: float, seconds: float | None = None) -> None:
        self._tick(now)
        self._d(rid).on_prefill_end(rid, now, seconds)

    def on_decode_start(self, rid: Hashable, now: float) -> None:
        """Scores the decode choice against the true global running counts (as
        Dispatcher._score_handoff does against its own), then hands the event on."""
        self._tick(now)
        d = self._d(rid)
        v = d.view
        if v.routable_count(Role.DECODE):
            mask = v.decode_mask()
            load = np.sum([x.view.running_n for x in self.shards], axis=0)
            best = float(load[mask].min()) + 1e-6
            j = int(v.table.inst[v.table.row[rid]])
            self.total += 1
            self.hits += bool(j >= 0 and mask[j] and float(load[j]) <= best)
        d.on_decode_start(rid, now)

    def on_progress_bulk(self, rids: Sequence[Hashable], generated: np.ndarray, now: float) -> None:
        if self.k == 1:
            self.shards[0].on_progress_bulk(rids, generated, now)
            return
        self._tick(now)
        owners = np.fromiter((self.shard_of(r) for r in rids), dtype=np.int64, count=len(rids))
        for s in np.unique(owners).tolist():
            idx = np.flatnonzero(owners == s)
            self.shards[s].on_progress_bulk([rids[j] for j in idx.tolist()], generated[idx], now)

    def on_finish(
        self, rid: Hashable, now: float, output_tokens: int, first_token_at: float | None = None
    ) -> None:
        self._tick(now)
        s = self.shard_of(rid)
        d = self.shards[s]
        if self.k > 1:
            t = d.view.table
            i = t.row[rid]
            seconds = now - float(t.decode_start[i]) if t.state[i] == RUNNING else -1.0
            self._finished[s].append((int(output_tokens), seconds))
        d.on_finish(rid, now, output_tokens, first_token_at)
        self._owner.pop(rid, None)

    def on_fail(self, rid: Hashable, now: float) -> None:
        self._tick(now)
        self._d(rid).on_fail(rid, now)
        self._owner.pop(rid, None)

    # --- what the simulator asks besides ----------------------------------------------------------
    def next_periodic_at(self) -> float:
        return min(d.next_periodic_at() for d in self.shards)

    def periodic(self, now: float) -> Any:
        raise NotImplementedError(
            "periodic policies (reschedule, scaling) are not modelled per shard"
        )

    def set_policy(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("policy swaps are not modelled per shard")

    @property
    def policy_events(self) -> list[Any]:
        return self.shards[0].policy_events

    def assignment_ratios(self) -> dict[str, float]:
        """The optimal-assignment ratio of the decisions taken, against the true global load."""
        return {"active": self.hits / self.total if self.total else float("nan")}


# --- one simulated run --------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    workload: str = "reasoning-chat"
    mode: str = "ps"
    n_prefill: int = 4
    n_decode: int = 16
    load: float = 0.9
    burstiness: float = 0.2
    requests: int = 6000
    profile: str = "h20-qwen3-32b"

    @property
    def label(self) -> str:
        arrivals = (
            "Poisson" if self.burstiness == 1.0 else f"bursty (gamma shape {self.burstiness:g})"
        )
        return (
            f"{self.workload}, {self.mode}, {self.n_prefill}P{self.n_decode}D, load {self.load:g} "
            f"of decode saturation, {arrivals} arrivals, {self.requests} requests, {self.profile}"
        )


POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "sibyl": ("sibyl", {}),
    "least_load": ("least_load", {}),
    "round_robin": ("round_robin", {}),
}


def make_trace(setting: Setting, seed: int, profile: PerfProfile) -> Trace:
    return traffic(
        WorkloadRef(setting.workload),
        requests=setting.requests,
        seed=seed,
        rate=None,
        load=setting.load,
        burstiness=setting.burstiness,
        n_decode=setting.n_decode,
        profile=profile,
    )


def dispatcher_factory(
    profile: PerfProfile, name: str, params: dict[str, Any], trace: Trace
) -> Callable[[], Dispatcher]:
    """Dispatchers built as `sim` builds them (console.simulate.run_one without shadows)."""
    prior = int(trace.output_tokens.max()) if len(trace.output_tokens) else None

    def make() -> Dispatcher:
        return Dispatcher(
            profile,
            name,
            params,
            true_lengths=True,
            survival_prior_max=prior,
            slo={"default": SLOClass()},
        )

    return make


def simulate(
    trace: Trace,
    profile: PerfProfile,
    setting: Setting,
    gateway: ShardedDispatcher | Dispatcher,
) -> SimResult:
    """Run the core simulator on `trace` with `gateway` (K shards, or a plain Dispatcher)."""
    sim = Simulation(
        arrivals=trace.arrivals,
        prompt_tokens=trace.prompt_tokens,
        output_tokens=trace.output_tokens,
        profile=profile,
        n_prefill=setting.n_prefill,
        n_decode=setting.n_decode,
        dispatcher=cast(Dispatcher, gateway),  # duck-typed: the methods Simulation calls
        mode=cast(Mode, setting.mode),
    )
    return sim.run()


def run_point(
    setting: Setting,
    trace: Trace,
    profile: PerfProfile,
    label: str,
    k: int,
    delta: float,
    seed: int,
    push_latency: float | None = None,
) -> dict[str, Any]:
    name, params = POLICIES[label]
    gw = ShardedDispatcher(
        k, delta, dispatcher_factory(profile, name, params, trace), push_latency=push_latency
    )
    t0 = time.perf_counter()
    result = simulate(trace, profile, setting, gw)
    wall = time.perf_counter() - t0
    m = summarize(
        arrival=result.arrival,
        first_token=result.first_token,
        finish=result.finish,
        output_tokens=result.output_tokens,
        ok=result.ok,
        slo=SLOClass(),
    )
    dec = np.asarray(gw.decision_s) * 1e6
    rows = np.asarray(gw.exchange_rows, dtype=float)
    sent = np.asarray(gw.exchange_bytes, dtype=float)
    return {
        "policy": label if push_latency is None or k == 1 else f"{label}+push",
        "push_latency": push_latency,
        "pushes": gw.pushes,
        "push_bytes_per_request": EXCHANGE_ROW.itemsize * (k - 1)
        if push_latency is not None
        else 0,
        "k": k,
        "delta": None if k == 1 else delta,
        "seed": seed,
        "requests": setting.requests,
        "tpot_p99": m["tpot_p99"],
        "tpot_mean": m["tpot_mean"],
        "ttft_p99": m["ttft_p99"],
        "slo_attainment": m["slo_attainment"],
        "completed": m["completed"],
        "failed": m["failed"],
        "assignment_ratio": result.assignment_ratio,
        "view_error": float(np.mean(gw.view_errors)) if gw.view_errors else 0.0,
        "decision_us_mean": float(dec.mean()) if len(dec) else None,
        "decision_us_p99": float(np.percentile(dec, 99)) if len(dec) else None,
        "merge_us_mean": gw.merge_s * 1e6 / len(dec) if len(dec) else None,
        "exchanges": gw.exchanges,
        "rows_per_exchange": float(rows.mean()) if len(rows) else 0.0,
        "rows_per_exchange_max": int(rows.max()) if len(rows) else 0,
        "bytes_per_exchange": float(sent.mean()) if len(sent) else 0.0,
        # an exchange goes out every Δ (the simulation skips those with no event in between)
        "bytes_per_s": float(sent.mean()) / delta if len(sent) and delta > 0 else None,
        "sim_wall_s": wall,
    }


# --- the alternative: one decision service ------------------------------------------------------

_SERVER = r"""
import sys, uvicorn
BODY = b'{"prefill": "p0", "decode": "d13", "projected_handoff": 1234.567}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
async def app(scope, receive, send):
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", lifespan="off",
            access_log=False)
"""


def measure_rtt(n: int = 3000, warmup: int = 300) -> dict[str, float]:
    """One routing request to a decision service and its answer over localhost HTTP/1.1 with
    keep-alive: httpx client here, a minimal uvicorn ASGI server in a child process."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)])
    try:
        body = json.dumps(
            {
                "request_id": "chatcmpl-5f0c3a9e6d2b4c1f",
                "prompt_tokens": 812,
                "max_tokens": 8192,
                "slo_class": "default",
                "tenant": "",
            }
        ).encode()
        headers = {"content-type": "application/json"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as client:
            deadline = time.monotonic() + 20
            while True:
                try:
                    client.post("/route", content=body, headers=headers)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            samples = []
            for i in range(warmup + n):
                t0 = time.perf_counter()
                r = client.post("/route", content=body, headers=headers)
                r.read()
                dt = time.perf_counter() - t0
                if i >= warmup:
                    samples.append(dt)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    us = np.asarray(samples) * 1e6
    return {
        "n": float(n),
        "mean_us": float(us.mean()),
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
    }


# --- report ---------------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x * 1e3:.1f}"


def aggregate(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean over seeds per (policy, K, Δ), with the min and max P99 TPOT."""
    groups: dict[tuple[str, int, float | None], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["k"], r["delta"]), []).append(r)
    out = []
    for (policy, k, delta), rs in groups.items():
        agg: dict[str, Any] = {"policy": policy, "k": k, "delta": delta, "seeds": len(rs)}
        for key in (
            "tpot_p99", "tpot_mean", "ttft_p99", "slo_attainment", "assignment_ratio", "view_error",
            "decision_us_mean", "decision_us_p99", "merge_us_mean", "rows_per_exchange", "bytes_per_exchange",
            "bytes_per_s", "sim_wall_s", "failed",
        ):  # fmt: skip
            vals = [r[key] for r in rs if r.get(key) is not None]
            agg[key] = statistics.fmean(vals) if vals else None
        p99 = [r["tpot_p99"] for r in rs]
        agg["tpot_p99_min"], agg["tpot_p99_max"] = min(p99), max(p99)
        out.append(agg)
    return out


def markdown(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> str:
    agg = aggregate(rows)
    base = {a["policy"]: a["tpot_p99"] for a in agg if a["k"] == 1}
    multi = any(a["seeds"] > 1 for a in agg)
    lines = [
        "| policy | K | Δ s | P99 TPOT ms"
        + (" (min–max)" if multi else "")
        + " | vs K=1 | mean TPOT ms | P99 TTFT s | SLO att. | opt. ratio | view err. | decision µs (merge) | "
        "rows/exch. | KB/exch. | KB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {p: i for i, p in enumerate(policies)}
    agg.sort(
        key=lambda a: (order.get(a["policy"].removesuffix("+push"), 99), a["k"], a["delta"] or 0.0)
    )
    for a in agg:
        p99 = _ms(a["tpot_p99"])
        if multi:
            p99 += f" ({_ms(a['tpot_p99_min'])}–{_ms(a['tpot_p99_max'])})"
        b = base.get(a["policy"].removesuffix("+push"))
        vs = "-" if a["k"] == 1 or not b else f"{a['tpot_p99'] / b - 1:+.1%}"
        many = a["k"] > 1
        decision = f"{a['decision_us_mean']:.0f}"
        if many:
            decision += f" ({a['merge_us_mean']:.0f})"
        delta = "-" if a["delta"] is None else f"{a['delta']:g}"
        rows_x = f"{a['rows_per_exchange']:.0f}" if many else "-"
        kb = f"{a['bytes_per_exchange'] / 1e3:.1f}" if many else "-"
        kbs = f"{a['bytes_per_s'] / 1e3:.1f}" if many and a["bytes_per_s"] is not None else "-"
        lines.append(
            f"| {a['policy']} | {a['k']} | {delta} | {p99} | {vs} | "
            f"{_ms(a['tpot_mean'])} | {a['ttft_p99']:.2f} | {a['slo_attainment']:.1%} | "
            f"{a['assignment_ratio']:.3f} | {a['view_error']:.3f} | {decision} | "
            f"{rows_x} | {kb} | {kbs} |"
        )
    return "\n".join(lines) + "\n"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument(
        "--seeds", default="7", help="comma-separated trace seeds (metrics are averaged)"
    )
    ap.add_argument("--shards", default="1,2,4,8", help="K values (1 = the single gateway)")
    ap.add_argument("--deltas", default="0.05,0.5,2,10", help="exchange periods Δ in seconds")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workload", default="reasoning-chat")
    ap.add_argument("--mode", choices=["ps", "iteration"], default="ps")
    ap.add_argument("--cluster", default="4P16D")
    ap.add_argument("--load", type=float, default=0.9)
    ap.add_argument("--burstiness", type=float, default=0.2)
    ap.add_argument("--profile", default="h20-qwen3-32b")
    ap.add_argument("--out", type=Path, default=None, help="also write every run as JSON here")
    ap.add_argument("--rtt", type=int, default=3000, help="round trips to time (0: skip)")
    ap.add_argument("--no-rtt", action="store_true")
    ap.add_argument("--rtt-only", action="store_true")
    ap.add_argument(
        "--push-latency",
        type=float,
        default=None,
        help="the push variant: every routing decision also reaches the other shards this many "
        "seconds after it is taken (runs labelled POLICY+push; K=1 is run as the baseline)",
    )
    args = ap.parse_args(argv)
    p_str, d_str = args.cluster.upper().rstrip("D").split("P")
    setting = Setting(
        workload=args.workload, mode=args.mode, n_prefill=int(p_str), n_decode=int(d_str), load=args.load,
        burstiness=args.burstiness, requests=args.requests, profile=args.profile,
    )  # fmt: skip
    rtt = None
    if args.rtt and not args.no_rtt:
        rtt = measure_rtt(args.rtt)
        print(
            f"localhost HTTP round trip (httpx → uvicorn, keep-alive, {int(rtt['n'])} requests): "
            f"mean {rtt['mean_us']:.0f} µs, p50 {rtt['p50_us']:.0f} µs, p99 {rtt['p99_us']:.0f} µs",
            flush=True,
        )
    if args.rtt_only:
        return
    profile = get_profile(setting.profile)
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"unknown policy {p!r}; choose from {sorted(POLICIES)}")
    shards, deltas = _ints(args.shards), _floats(args.deltas)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    print(f"setting: {setting.label}", file=sys.stderr, flush=True)
    for seed in _ints(args.seeds):
        trace = make_trace(setting, seed, profile)
        for label in policies:
            for k in shards:
                for delta in deltas if k > 1 else deltas[:1]:
                    push = args.push_latency if k > 1 else None
                    row = run_point(setting, trace, profile, label, k, delta, seed, push)
                    rows.append(row)
                    print(
                        f"seed {seed} {row['policy']} K={k} Δ={'-' if k == 1 else format(delta, 'g')}: P99 TPOT "
                        f"{_ms(row['tpot_p99'])} ms, mean {_ms(row['tpot_mean'])} ms, TTFT P99 "
                        f"{row['ttft_p99']:.2f} s ({row['sim_wall_s']:.1f} s; "
                        f"{time.perf_counter() - started:.0f} s elapsed)",
                        file=sys.stderr,
                        flush=True,
                    )
    print(f"\n{setting.label}; seeds {args.seeds}\n")
    print(markdown(rows, policies))
    if args.out is not None:
        args.out.write_text(
            json.dumps({"setting": dataclasses.asdict(setting), "rtt": rtt, "runs": rows}, indent=1)
        )
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

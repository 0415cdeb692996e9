"""K gateway shards in front of one cluster (benchmarks/gateway_shards.py): `ShardedDispatcher`
offers what the cluster simulator asks of a dispatcher (core.sim.cluster.SimDispatcher) and hands
each request's events to the shard that owns it; `ShardRouting` makes every decision on the
shard's own view merged with the others' rows as of the last exchange (shard_exchange.py)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

import numpy as np

from benchmarks.shard_exchange import (
    BACKLOG_BYTES,
    COLUMNS,
    EXCHANGE_ROW,
    FINISHED_ROW,
    Foreign,
    MergedTable,
    Pushed,
    Snapshot,
    shard_of,
)
from core.dispatch import Dispatcher
from core.periodic import PeriodicRunner
from core.policies.base import (
    BindPoint,
    PolicyParams,
    QueuePolicy,
    ReschedulePolicy,
    RoutingPolicy,
    RoutingPolicyBase,
)
from core.request_table import RUNNING
from core.types import Admission, Assignment, InstancePhase, PolicyKind, Request, Role
from core.view import ClusterView


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

    def observe_completion(self, request: Request, ttft_s: float, tpot_s: float, queue_s: float) -> None:
        self.inner.observe_completion(request, ttft_s, tpot_s, queue_s)

    def close(self) -> None:
        self.inner.close()


class ShardedDispatcher:
    """K gateway shards in front of one cluster, offering what core.sim.cluster.ClusterSimulation
    asks of a dispatcher (core.sim.cluster.SimDispatcher; static scaling, no reschedule: periodic
    policies are not modelled).

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
            x.n * EXCHANGE_ROW.itemsize + len(x.finished) * FINISHED_ROW.itemsize + n_inst * BACKLOG_BYTES
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
            c: np.concatenate((f.cols[c], np.array([x.row[c] for x in seen], dtype=f.cols[c].dtype))) for c in COLUMNS
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
            self.view_errors.append(float(np.abs(seen - truth)[mask].sum()) / max(float(truth[mask].sum()), 1.0))
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

    def on_finish(self, rid: Hashable, now: float, output_tokens: int, first_token_at: float | None = None) -> None:
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

    def on_progress(self, rid: Hashable, generated: float, now: float) -> None:
        self._tick(now)
        self._d(rid).on_progress(rid, generated, now)

    def on_migrated(self, rid: Hashable, target: str, now: float) -> None:
        self._tick(now)
        self._d(rid).on_migrated(rid, target, now)

    # --- instance phases and roles: the same on every shard -------------------------------------
    def phase_of(self, instance_id: str) -> InstancePhase:
        return self.shards[0].phase_of(instance_id)

    def role_of(self, instance_id: str) -> Role:
        return self.shards[0].role_of(instance_id)

    def set_phase(self, instance_id: str, phase: InstancePhase) -> None:
        for d in self.shards:
            d.set_phase(instance_id, phase)

    def begin_drain(self, instance_id: str) -> None:
        for d in self.shards:
            d.begin_drain(instance_id)

    def remove_instance(self, instance_id: str) -> None:
        for d in self.shards:
            d.remove_instance(instance_id)

    def flip_role(self, instance_id: str, role: Role) -> None:
        for d in self.shards:
            d.flip_role(instance_id, role)

    # --- what the simulator asks besides ----------------------------------------------------------
    @property
    def reschedule(self) -> ReschedulePolicy:
        return self.shards[0].reschedule

    @property
    def runner(self) -> PeriodicRunner:
        return self.shards[0].runner

    def next_periodic_at(self) -> float:
        return min(d.next_periodic_at() for d in self.shards)

    def periodic(self, now: float) -> Any:
        raise NotImplementedError("periodic policies (reschedule, scaling) are not modelled per shard")

    def set_policy(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("policy swaps are not modelled per shard")

    @property
    def policy_events(self) -> list[Any]:
        return self.shards[0].policy_events

    def assignment_ratios(self) -> dict[str, float]:
        """The optimal-assignment ratio of the decisions taken, against the true global load."""
        return {"active": self.hits / self.total if self.total else float("nan")}

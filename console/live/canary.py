"""A running console's policy canary: its start, its arms' finished requests, a reading every few seconds, its end.

It runs on one pool, the one the operator names (default: the first): that pool's dispatcher splits its requests
and a promotion swaps that pool's policy; at most one canary runs on the console at a time. The split and the
statistics are console/advisor/canary.py's (ArmSplit, read_canary: Mann–Whitney, Fisher and Newcombe intervals
under a stated stopping rule); the dispatcher routes the canary arm under the candidate (core/dispatch/canary.py)
and each request records its arm. A reading compares the arms' requests of the canary's pool that arrived after
the start and finished since, in a worker thread (scipy, not on the event loop). The end is the rule's verdict:
*promote* swaps the active policy to the candidate (a swap with source `canary`), *rollback*, *equal* and
*inconclusive* leave the active one; a canary stopped by the operator, by a swap of its kind in its pool, or by
the console stopping ends *interrupted*. Every start, reading and end is an advisor event in the run store and a
`canary` event on the bus (the dashboard's log), each naming the pool; /metrics shows the running canary, its arms
so far and the verdicts by outcome (console/live/canary_metrics.py).
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from console.errors import ConsoleError

if TYPE_CHECKING:
    from console.advisor.canary import CanaryPlan, Reading
    from console.live.events import EventBus
    from core.dispatch import Dispatcher
    from core.types import Request

log = logging.getLogger(__name__)
READING_EVERY_S = 10.0
"""How often a running canary is read (a short canary is read at least four times)."""
CANARY_MODULE = "console.advisor.canary"
"""The statistics (scipy): imported off the event loop when the first canary starts."""
VERDICTS = ("promote", "rollback", "equal", "inconclusive", "interrupted")
"""How a canary ends: the stopping rule's four verdicts, or interrupted (stopped before one)."""
ARMS = ("canary", "control")
_ids = itertools.count(1)


class CanaryBusy(ConsoleError):
    """A canary is already running (one at a time)."""


class AdvisorLog(Protocol):
    """Where advisor and canary events are stored (adapters.store.RunRecorder)."""

    def advisor_event(
        self,
        *,
        t: float,
        event: str,
        canary: str | None = None,
        kind: str | None = None,
        policy: str | None = None,
        decision: str | None = None,
        detail: str = "",
        data: dict[str, Any] | None = None,
    ) -> None:
        """One advice, or a canary's start, reading or end."""


Swap = Callable[[str, str, dict[str, Any], str], Any]
"""(kind, name, params, source) → the swap (the controller's set_policy on the canary's pool)."""


@dataclass(frozen=True)
class CanaryPool:
    """The pool a canary runs on: its name, its base model (its requests' stored `model`), its dispatcher (which
    splits its requests) and the swap that promotes a candidate in it."""

    name: str
    model: str
    dispatcher: Dispatcher
    swap: Swap


PoolOf = Callable[[str | None], CanaryPool]
"""A pool's name → its CanaryPool (None: the first pool); an unknown name raises core.pools.UnknownPool."""


@dataclass
class RunningCanary:
    """One canary while it runs: its plan, when it started, its arms' finished requests, its last reading."""

    id: str
    plan: CanaryPlan
    pool: CanaryPool
    source: str
    started: float
    """Monotonic seconds."""
    started_rel: float
    """Seconds since the console started (the run store's clock)."""
    promote: Callable[[], str | None] | None
    """Asked before a promote verdict swaps (None: it swaps): a reason not to swap, or None to swap."""
    why: str = ""
    arms: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {"canary": [], "control": []})
    reading: Reading | None = None
    readings: int = 0

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id,
            "plan": self.plan.to_json(),
            "pool": self.pool.name,
            "source": self.source,
            "why": self.why,
            "started_t": self.started_rel,
            "elapsed_s": now - self.started,
            "finished": {arm: len(rows) for arm, rows in self.arms.items()},
            "reading": None if self.reading is None else self.reading.to_json(),
            "readings": self.readings,
        }


class LiveCanary:
    """The console's canary: at most one at a time, on the pool named when it starts (see the module docstring)."""

    def __init__(self, pool_of: PoolOf, log: AdvisorLog, events: EventBus, t0: float) -> None:
        self.pool_of, self.log, self.events, self.t0 = pool_of, log, events, t0
        self.current: RunningCanary | None = None
        self.last: dict[str, Any] | None = None
        """The last canary that ended, with its verdict."""
        self.active_until: dict[str, float] = {}
        """By pool: monotonic time the last canary on it ended (inf while one runs there)."""
        self._stats: Any = None
        """console.advisor.canary, once the first canary starts."""
        self.on_end: list[Callable[[dict[str, Any]], None]] = []
        """Called with each ended canary's record (the advisor's autopilot listens)."""
        self.verdicts: dict[str, int] = dict.fromkeys(VERDICTS, 0)
        """Canaries ended since the console started, by verdict."""

    # --- start --------------------------------------------------------------------------------------
    async def start(
        self,
        kind: str,
        name: str,
        params: Mapping[str, Any] | None,
        share: float | str,
        duration_s: float,
        *,
        source: str = "api",
        why: str = "",
        promote: Callable[[], str | None] | None = None,
        pool: str | None = None,
    ) -> dict[str, Any]:
        """Check the request (a CanaryError, PolicyError or UnknownPool says what is wrong), then route `share` of
        pool `pool`'s new requests (None: the first pool's) under the candidate for `duration_s`."""
        if self._stats is None:
            self._stats = await asyncio.to_thread(importlib.import_module, CANARY_MODULE)
        plan = self._stats.plan_canary(kind, name, dict(params or {}), share, duration_s)
        target = self.pool_of(pool)
        if self.current is not None:
            c = self.current
            raise CanaryBusy(
                f"canary {c.id} ({c.plan.kind} {c.plan.name} on pool {c.pool.name}) is running; stop it first "
                "(policy canary --stop)"
            )
        cid = f"canary-{next(_ids)}-{int(time.time())}"
        split = self._stats.ArmSplit(plan.share, salt=cid)
        canary_arm = self._stats.CANARY

        def in_canary(r: Request) -> bool:
            return bool(split.arm(r.session, r.tenant, str(r.id)) == canary_arm)

        target.dispatcher.start_canary(plan.kind, plan.name, plan.params, in_canary, label=cid)
        now = time.monotonic()
        c = RunningCanary(cid, plan, target, source, now, now - self.t0, promote, why)
        self.current = c
        self.active_until[target.name] = float("inf")
        detail = (
            f"{plan.kind} {plan.name} on {plan.share:.0%} of pool {target.name}'s requests (by session, else tenant, "
            f"else request) for {plan.duration_s:g} s [{source}]" + (f": {why}" if why else "")
        )
        data = {"plan": plan.to_json(), "pool": target.name, "source": source, "why": why}
        self._event("canary_start", c, None, detail, data)
        return c.to_json(now)

    # --- the arms ------------------------------------------------------------------------------------
    def request(self, row: Mapping[str, Any]) -> None:
        """A finished request's stored row: kept in its arm when it ran on the canary's pool (its stored `model`,
        when known, is the pool's) and arrived while the canary ran."""
        c, arm = self.current, row.get("arm")
        if c is None or arm not in ("canary", "control") or (row.get("arrival") or 0.0) < c.started_rel:
            return
        if row.get("model") not in (None, c.pool.model):  # another pool's (its dispatcher splits nothing)
            return
        c.arms[str(arm)].append(
            {"status": row["status"], "ttft": row.get("ttft"), "tpot": row.get("tpot"), "slo_met": row.get("slo_met")}
        )

    # --- readings and the end --------------------------------------------------------------------------
    async def run(self) -> None:
        """Read the running canary every READING_EVERY_S (a quarter of its length when shorter, and at its
        end); end it on a final verdict."""
        while True:
            c = self.current
            if c is None:
                await asyncio.sleep(1.0)
                continue
            every = max(min(READING_EVERY_S, c.plan.duration_s / 4), 1.0)
            left = c.started + c.plan.duration_s - time.monotonic()
            await asyncio.sleep(max(min(every, left), 0.05))
            if self.current is c:
                try:
                    await self.read()
                except Exception:  # a reading that fails is logged; the canary goes on, the loop too
                    log.exception("canary %s: the reading failed", c.id)

    async def read(self) -> Reading | None:
        """Compare the arms now (in a thread: scipy); record the reading; end the canary when it is final."""
        c = self.current
        if c is None:
            return None
        rows = {arm: list(c.arms[arm]) for arm in ("canary", "control")}
        elapsed = time.monotonic() - c.started
        reading: Reading = await asyncio.to_thread(self._compare, rows, c.plan, elapsed)
        if self.current is not c:  # ended while it was read
            return reading
        c.reading, c.readings = reading, c.readings + 1
        self._event("canary_reading", c, reading.decision, reading.reason, reading.to_json())
        if reading.final:
            self.end(reading.decision, reading.reason, reading)
        return reading

    def _compare(self, rows: dict[str, list[dict[str, Any]]], plan: CanaryPlan, elapsed_s: float) -> Reading:
        stats = self._stats
        canary, control = stats.ArmSample.from_rows(rows["canary"]), stats.ArmSample.from_rows(rows["control"])
        reading: Reading = stats.read_canary(canary, control, plan, elapsed_s)
        return reading

    def end(self, decision: str, reason: str, reading: Reading | None = None) -> dict[str, Any] | None:
        """Stop routing under the candidate; on *promote* swap it in (unless the autopilot's gate holds it)."""
        c = self.current
        if c is None:
            return None
        self.current = None
        c.pool.dispatcher.stop_canary()
        now = time.monotonic()
        self.active_until[c.pool.name] = now
        swapped = None
        if decision == "promote":
            held = c.promote() if c.promote is not None else None
            if held is None:
                ev = c.pool.swap(c.plan.kind.value, c.plan.name, dict(c.plan.params), "canary")
                swapped = {"kind": ev.kind.value, "old": ev.old, "new": ev.new}
                reason += f"; promoted: {c.plan.kind} {ev.old} -> {ev.new}"
            else:
                reason += f"; not promoted: {held}"
        record = {**c.to_json(now), "decision": decision, "reason": reason, "swapped": swapped}
        if reading is not None:
            record["reading"] = reading.to_json()
        self.last = record
        self.verdicts[decision] = self.verdicts.get(decision, 0) + 1
        self._event("canary_end", c, decision, reason, record)
        for listener in self.on_end:
            listener(record)
        return record

    def interrupt(self, reason: str) -> dict[str, Any] | None:
        """End the running canary without a verdict: the active policy stays in force."""
        return self.end("interrupted", reason)

    def policy_swapped(self, kind: str, source: str, pool: str | None = None) -> None:
        """A swap of the canary's kind in its pool (`pool`; None: the canary's), not its own promotion, ends it: its
        control arm is no longer one policy. A swap in another pool leaves it running."""
        c = self.current
        if c is None or c.plan.kind.value != kind or source == "canary" or pool not in (None, c.pool.name):
            return
        self.interrupt(f"the {kind} policy was swapped during the canary (source {source})")

    def ran_since(self, pool: str, since: float) -> bool:
        """Whether a canary ran on pool `pool` at any time after `since` (monotonic): a window of that pool's traffic
        reaching back past it mixes two policies."""
        return self.active_until.get(pool, float("-inf")) > since

    def snapshot(self) -> dict[str, Any]:
        """The running canary (None: none) and the last one that ended, as /control/canary and the state show them."""
        c = self.current
        return {"running": None if c is None else c.to_json(time.monotonic()), "last": self.last}

    def _event(self, event: str, c: RunningCanary, decision: str | None, detail: str, data: dict[str, Any]) -> None:
        t = time.monotonic() - self.t0
        plan = c.plan
        self.log.advisor_event(
            t=t, event=event, canary=c.id, kind=plan.kind.value, policy=plan.name, decision=decision, detail=detail,
            data=data,
        )
        self.events.publish(
            "canary", phase=event.removeprefix("canary_"), canary=c.id, kind=plan.kind.value, policy=plan.name,
            decision=decision, detail=detail, t=t, pool=c.pool.name,
        )

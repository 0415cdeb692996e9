"""Instance health on a live console: probe callbacks, circuit breakers, lost signals, DP rank drift."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from core.breaker import BreakerState, CircuitBreaker

if TYPE_CHECKING:
    from adapters.vllm.instances import Instance
    from console.live.config import ConsoleConfig
    from console.live.events import EventBus, InstanceListeners
    from console.live.state import InstanceRow
    from core.dispatch import Dispatcher
    from core.types import Role

RANK_IMBALANCED, RANK_BALANCED = 1.5, 1.2
"""Straggler factors (busiest rank / mean) at which a DP group is reported imbalanced, then balanced again."""


class HealthLog(Protocol):
    """Where health news goes (console.live.outcomes.Outcomes, or a fake in a test)."""

    def instance_event(self, instance_id: str, role: Role | None, event: str, detail: str, source: str = "") -> None:
        """Something happened to an instance: stored and published."""

    def instance_up(self, inst: Instance, up: bool) -> None:
        """The instance's `sibyl_instance_up` gauge."""

    def sample(self, inst: Instance, now: float) -> None:
        """Store the instance's latest /metrics sample."""


class LegHealth(Protocol):
    """What a live request tells, and asks, the instances' health (InstanceHealth) about its legs."""

    def upstream_failed(self, instance_id: str) -> None:
        """A leg failed because of the instance."""

    def upstream_ok(self, instance_id: str) -> None:
        """A leg succeeded on the instance."""

    def lost_signal(self, instance_id: str) -> asyncio.Future[None]:
        """A future done once the instance is marked down or removed."""


class InstanceHealth:
    """Whether each instance may be routed to: its probes, its breaker, and who waits for it to be lost."""

    def __init__(
        self,
        config: ConsoleConfig,
        instances: dict[str, Instance],
        dispatcher: Dispatcher,
        log: HealthLog,
        release: Callable[[], None],
        listeners: InstanceListeners,
    ) -> None:
        self.config = config
        """Breaker thresholds, the probe failures that mark an instance down, DP slots per rank."""
        self.instances = instances
        """The console's instances by id (shared with the controller and the scaler)."""
        self.dispatcher = dispatcher
        """Told which instances are routable and what each one reports."""
        self.log = log
        self.release = release
        """Called when an instance comes up (held requests may go)."""
        self.kick: Callable[[], None] = lambda: None
        """Poll the instances now (the poller's kick, set once the poller exists)."""
        self.breakers: dict[str, CircuitBreaker] = {}
        """Per-instance circuit breakers (core/breaker.py), made on an instance's first failure."""
        self._lost: dict[str, asyncio.Future[None]] = {}
        """Per instance, a future done when it is marked down (see lost_signal)."""
        self.listeners = listeners
        """Told the id of an instance the poller or the backend marked down (its cache is forgotten)."""
        self.scraped: list[Callable[[Instance, float], None]] = []
        """Who else reads each instance's scrape (the live calibration), in order."""

    # --- request outcomes ------------------------------------------------------------------------
    def upstream_failed(self, instance_id: str) -> None:
        """A leg failed because of the instance: count it on its breaker and poll it now."""
        inst = self.instances.get(instance_id)
        if inst is not None:
            inst.failed += 1
            changed = self._breaker(instance_id).failure(time.monotonic())
            if changed is not None:
                self._breaker_event(inst, changed)
        self.kick()

    def upstream_ok(self, instance_id: str) -> None:
        """A leg succeeded on the instance (cheap when its breaker is closed and clean)."""
        b = self.breakers.get(instance_id)
        if b is None or (b.consecutive == 0 and b.state == BreakerState.CLOSED):
            return
        changed = b.success()
        inst = self.instances.get(instance_id)
        if changed is not None and inst is not None:
            self._breaker_event(inst, changed)

    def tick(self, now: float) -> None:
        """Half-open the breakers whose cool-off has passed."""
        for iid, b in list(self.breakers.items()):
            if b.tick(now) is not None and iid in self.instances:
                self._breaker_event(self.instances[iid], b.state)

    def breaker_state(self, instance_id: str) -> str:
        """`closed`, `open` or `half_open` (closed for an instance that never failed)."""
        b = self.breakers.get(instance_id)
        return b.state.value if b is not None else "closed"

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
        self.log.instance_event(inst.id, inst.role, f"circuit_{state.value}", detail)

    def _apply_health(self, inst: Instance) -> None:
        """Routable when its probes pass and its breaker allows it."""
        b = self.breakers.get(inst.id)
        self.dispatcher.set_health(inst.id, inst.healthy and (b is None or b.allows))

    # --- lost signals ----------------------------------------------------------------------------
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

    def instance_lost(self, instance_id: str, reason: str) -> None:
        """The backend saw the instance's process, actor or node go: down at once, with that reason
        (recorded as well when its probes had already marked it down)."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        if inst.healthy:
            inst.healthy = False
            inst.consecutive_failures = max(inst.consecutive_failures, self.config.down_after_failures)
            self.on_status(inst, False, reason)
        else:
            self.log.instance_event(inst.id, inst.role, "lost", reason)

    # --- poller callbacks ------------------------------------------------------------------------
    def on_status(self, inst: Instance, healthy: bool, reason: str) -> None:
        """The poller marked `inst` up or down."""
        if healthy:
            self._lost.pop(inst.id, None)
        else:
            if not (lost := self.lost_signal(inst.id)).done():
                lost.set_result(None)
            self.listeners.down(inst.id)
        self._apply_health(inst)
        self.log.instance_up(inst, healthy)
        self.log.instance_event(inst.id, inst.role, "up" if healthy else "down", reason)
        if healthy:
            self.release()

    def on_sample(self, inst: Instance, now: float) -> None:
        """The poller scraped `inst`'s /metrics (or failed to: its last page stays)."""
        self.dispatcher.observe_instance(inst.state())
        self.log.sample(inst, now)
        for reader in self.scraped:
            reader(inst, now)

    def track_data_parallel(self, inst: Instance) -> None:
        """Tell the dispatcher whether `inst` is a data-parallel group (its ranks and slots per rank)."""
        self.dispatcher.set_data_parallel(inst.id, inst.dp_size, self.config.emulator.max_num_seqs or 0)


class RankWatch:
    """Reports a data-parallel group whose ranks drift apart (its busiest rank holds ≥ 1.5× the mean:
    every step then waits for it) and again when they are balanced (≤ 1.2×)."""

    def __init__(self, events: EventBus, rank_policy: Callable[[], str]) -> None:
        self.events = events
        self.rank_policy = rank_policy
        """The active rank policy's name (said in the event)."""
        self.imbalanced: set[str] = set()
        """Data-parallel groups last reported imbalanced."""

    def check(self, rows: Iterable[InstanceRow]) -> None:
        """Look at one snapshot's rows; publish a `ranks` event for each group that changed side."""
        for row in rows:
            loads = row.dp_ranks
            if not loads or sum(loads) == 0:
                continue
            factor = max(loads) / (sum(loads) / len(loads))
            iid = row.id
            flagged = iid in self.imbalanced
            if not flagged and factor >= RANK_IMBALANCED:
                self.imbalanced.add(iid)
            elif flagged and factor <= RANK_BALANCED:
                self.imbalanced.discard(iid)
            else:
                continue
            busiest = loads.index(max(loads))
            self.events.publish(
                "ranks",
                instance=iid,
                factor=round(factor, 2),
                busiest=busiest,
                loads=loads,
                balanced=iid not in self.imbalanced,
                policy=self.rank_policy(),
            )

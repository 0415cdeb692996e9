"""Scaler: carries out scaling actions on a live cluster through its backend, each with its reason.

Add: the new instance is STARTING (not routable, and the scaling policy waits for it) until it
answers /health, then ACTIVE. Remove: routing stops at once (DRAINING), the process is stopped
when nothing routed to it is in flight or after `instance_drain_timeout_s` — a scaling policy
never kills a running request (Dynamo's planner does on scale-down; we drain). Flip: with
backends that serve both legs from one engine (emulator, sim, vLLM with kv_both) a flip is a
routing change: requests already on the instance finish where they are. Every step is an
instance event (SQLite, the event bus, the dashboard's event log).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from adapters.backends import Capability, require
from adapters.errors import BackendError
from core.errors import ConfigError
from core.types import InstancePhase, Role, ScaleAction

if TYPE_CHECKING:
    from adapters.backends import Backend
    from adapters.vllm.instances import Instance
    from console.live.config import ConsoleConfig
    from console.live.events import InstanceListeners
    from console.live.metrics import GatewayMetrics
    from console.live.outcomes import InstanceLog
    from core.dispatch import Dispatcher

DRAIN_POLL_S = 0.1


class Scaler:
    """Executes ScaleActions (from a scaling policy or an operator) against the backend."""

    def __init__(
        self,
        backend: Backend,
        dispatcher: Dispatcher,
        instances: dict[str, Instance],
        config: ConsoleConfig,
        metrics: GatewayMetrics,
        log: InstanceLog,
        listeners: InstanceListeners,
        id_prefix: str = "",
    ) -> None:
        self.backend = backend
        """Starts, stops and flips the instances."""
        self.dispatcher = dispatcher
        """Told each instance's phase and role."""
        self.instances = instances
        """The console's instances by id: an added one is put here, a removed one taken out."""
        self.config = config
        """connect_timeout_s for a new instance's clients, instance_drain_timeout_s for a removal."""
        self.metrics = metrics
        """The `sibyl_instance_up` gauge."""
        self.log = log
        """Where each step goes as an instance event."""
        self.listeners = listeners
        """Told that an instance joined (after it became active) or left."""
        self.id_prefix = id_prefix
        """Before each added instance's id (its pool's, e.g. `A.`; empty with one pool)."""
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def busy(self) -> bool:
        """An add or a drain is still under way."""
        return bool(self._tasks)

    def execute(self, action: ScaleAction, source: str) -> str | None:
        """Start carrying out one action; returns the instance id it concerns (None if refused)."""
        try:
            if action.action == "add":
                require(self.backend, Capability.SCALE)
                iid = self._next_id(action.role)
                self.dispatcher.add_instance(iid, action.role, phase=InstancePhase.STARTING)
                self.log.instance_event(iid, action.role, "starting", action.reason, source)
                self._spawn(self._add(iid, action.role, action.reason, source), f"add-{iid}")
                return iid
            iid = action.instance_id or ""
            inst = self.instances.get(iid)
            if inst is None:
                raise ConfigError(f"no instance {iid!r}; instances: {', '.join(self.instances)}")
            if action.action == "remove":
                require(self.backend, Capability.SCALE)
                self.dispatcher.begin_drain(iid)
                self.metrics.instance_up.labels(instance_id=iid, role=inst.role.value).set(0)
                self.log.instance_event(iid, inst.role, "draining", action.reason, source)
                self._spawn(self._retire(iid, source), f"retire-{iid}")
                return iid
            if action.action == "flip":
                require(self.backend, Capability.ROLE_FLIP)
                self._spawn(self._flip(iid, action.role, action.reason, source), f"flip-{iid}")
                return iid
            raise ConfigError(f"unknown scaling action {action.action!r}: add, remove or flip")
        except (BackendError, ConfigError) as e:
            self.log.instance_event(action.instance_id or "-", action.role, "refused", f"{action.action}: {e}", source)
            raise

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _next_id(self, role: Role) -> str:
        prefix = self.id_prefix + role.value[0]
        n = len(prefix)
        used = [int(i[n:]) for i in self.dispatcher.view.instance_ids if i.startswith(prefix) and i[n:].isdigit()]
        return f"{prefix}{max(used, default=-1) + 1}"

    async def _add(self, iid: str, role: Role, reason: str, source: str) -> None:
        started = time.monotonic()
        try:
            inst = await self.backend.add(role, iid)
        except Exception as e:  # the instance never came up: say so, keep serving with the others
            self.dispatcher.remove_instance(iid)
            self.log.instance_event(iid, role, "failed", f"could not start: {e}", source)
            return
        inst.open(connect_timeout_s=self.config.connect_timeout_s)
        self.instances[iid] = inst
        self.dispatcher.set_phase(iid, InstancePhase.ACTIVE)
        self.metrics.instance_up.labels(instance_id=iid, role=role.value).set(1)
        ready = f"{reason} (ready after {time.monotonic() - started:.1f} s)"
        self.log.instance_event(iid, role, "added", ready, source)
        self.listeners.added(inst)  # its data-parallel ranks, its KV events, held requests may go

    async def _retire(self, iid: str, source: str) -> None:
        """Wait until nothing routed to the instance is in flight (bounded), then stop it."""
        deadline = time.monotonic() + self.config.instance_drain_timeout_s
        while self.dispatcher.in_flight(iid) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = self.dispatcher.in_flight(iid)
        inst = self.instances.pop(iid)
        self.listeners.removed(iid)
        self.dispatcher.remove_instance(iid)
        await inst.close()
        await self.backend.remove(iid)
        detail = (
            "drained"
            if not left
            else f"drain timed out after {self.config.instance_drain_timeout_s:g} s with {left} requests in flight"
        )
        self.log.instance_event(iid, inst.role, "removed", detail, source)

    async def _flip(self, iid: str, role: Role, reason: str, source: str) -> None:
        inst = self.instances[iid]
        old = inst.role
        await self.backend.flip(iid, role)
        self.dispatcher.flip_role(iid, role)
        inst.role = role
        self.metrics.instance_up.labels(instance_id=iid, role=old.value).set(0)
        self.metrics.instance_up.labels(instance_id=iid, role=role.value).set(1)
        self.log.instance_event(iid, role, "flipped", f"{old.value} -> {role.value}: {reason}", source)

    async def stop(self) -> None:
        """Cancel the adds, drains and flips under way."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

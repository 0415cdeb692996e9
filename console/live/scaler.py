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
from typing import TYPE_CHECKING, Any, Protocol

from adapters.backends import Capability, require
from adapters.errors import BackendError
from core.errors import ConfigError
from core.types import InstancePhase, Role, ScaleAction

if TYPE_CHECKING:
    from adapters.backends import Backend
    from adapters.vllm.instances import Instance
    from console.live.config import ConsoleConfig
    from console.live.metrics import GatewayMetrics
    from core.dispatch import Dispatcher

DRAIN_POLL_S = 0.1


class ScalerHost(Protocol):
    """What the scaler needs from the running console, and nothing more."""

    @property
    def backend(self) -> Backend:
        """Starts, stops and flips the instances."""

    @property
    def dispatcher(self) -> Dispatcher:
        """Told each instance's phase and role."""

    @property
    def instances(self) -> dict[str, Instance]:
        """The console's instances by id: an added one is put here, a removed one taken out."""

    @property
    def config(self) -> ConsoleConfig:
        """connect_timeout_s for a new instance's clients, instance_drain_timeout_s for a removal."""

    @property
    def metrics(self) -> GatewayMetrics:
        """The `sibyl_instance_up` gauge."""

    def instance_event(self, instance_id: str, role: Role | None, event: str, detail: str, source: str = "") -> None:
        """Something happened to an instance: stored and published."""

    def track_data_parallel(self, inst: Instance) -> None:
        """Tell the dispatcher whether a new instance is a data-parallel group."""

    def instance_ready(self, inst: Instance) -> None:
        """A started instance joined the cluster (its KV events are followed from now on)."""

    def release_queued(self) -> None:
        """Let held requests go (a new instance has room)."""

    def instance_removed(self, instance_id: str) -> None:
        """The instance left the cluster (whoever waits on its lost signal hears it)."""


class Scaler:
    """Executes ScaleActions (from a scaling policy or an operator) against its host's backend."""

    def __init__(self, host: ScalerHost) -> None:
        self.c = host
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def busy(self) -> bool:
        """An add or a drain is still under way."""
        return bool(self._tasks)

    def execute(self, action: ScaleAction, source: str) -> str | None:
        """Start carrying out one action; returns the instance id it concerns (None if refused)."""
        c = self.c
        try:
            if action.action == "add":
                require(c.backend, Capability.SCALE)
                iid = self._next_id(action.role)
                c.dispatcher.add_instance(iid, action.role, phase=InstancePhase.STARTING)
                c.instance_event(iid, action.role, "starting", action.reason, source)
                self._spawn(self._add(iid, action.role, action.reason, source), f"add-{iid}")
                return iid
            iid = action.instance_id or ""
            inst = c.instances.get(iid)
            if inst is None:
                raise ConfigError(f"no instance {iid!r}; instances: {', '.join(c.instances)}")
            if action.action == "remove":
                require(c.backend, Capability.SCALE)
                c.dispatcher.begin_drain(iid)
                c.metrics.instance_up.labels(instance_id=iid, role=inst.role.value).set(0)
                c.instance_event(iid, inst.role, "draining", action.reason, source)
                self._spawn(self._retire(iid, source), f"retire-{iid}")
                return iid
            if action.action == "flip":
                require(c.backend, Capability.ROLE_FLIP)
                self._spawn(self._flip(iid, action.role, action.reason, source), f"flip-{iid}")
                return iid
            raise ConfigError(f"unknown scaling action {action.action!r}: add, remove or flip")
        except (BackendError, ConfigError) as e:
            c.instance_event(action.instance_id or "-", action.role, "refused", f"{action.action}: {e}", source)
            raise

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _next_id(self, role: Role) -> str:
        prefix = role.value[0]
        used = [int(i[1:]) for i in self.c.dispatcher.view.instance_ids if i[0] == prefix and i[1:].isdigit()]
        return f"{prefix}{max(used, default=-1) + 1}"

    async def _add(self, iid: str, role: Role, reason: str, source: str) -> None:
        c = self.c
        started = time.monotonic()
        try:
            inst = await c.backend.add(role, iid)
        except Exception as e:  # the instance never came up: say so, keep serving with the others
            c.dispatcher.remove_instance(iid)
            c.instance_event(iid, role, "failed", f"could not start: {e}", source)
            return
        inst.open(connect_timeout_s=c.config.connect_timeout_s)
        c.instances[iid] = inst
        c.track_data_parallel(inst)
        c.instance_ready(inst)
        c.dispatcher.set_phase(iid, InstancePhase.ACTIVE)
        c.metrics.instance_up.labels(instance_id=iid, role=role.value).set(1)
        c.instance_event(iid, role, "added", f"{reason} (ready after {time.monotonic() - started:.1f} s)", source)
        c.release_queued()

    async def _retire(self, iid: str, source: str) -> None:
        """Wait until nothing routed to the instance is in flight (bounded), then stop it."""
        c = self.c
        deadline = time.monotonic() + c.config.instance_drain_timeout_s
        while c.dispatcher.in_flight(iid) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = c.dispatcher.in_flight(iid)
        inst = c.instances.pop(iid)
        c.instance_removed(iid)
        c.dispatcher.remove_instance(iid)
        await inst.close()
        await c.backend.remove(iid)
        detail = (
            "drained"
            if not left
            else f"drain timed out after {c.config.instance_drain_timeout_s:g} s with {left} requests in flight"
        )
        c.instance_event(iid, inst.role, "removed", detail, source)

    async def _flip(self, iid: str, role: Role, reason: str, source: str) -> None:
        c = self.c
        inst = c.instances[iid]
        old = inst.role
        await c.backend.flip(iid, role)
        c.dispatcher.flip_role(iid, role)
        inst.role = role
        c.metrics.instance_up.labels(instance_id=iid, role=old.value).set(0)
        c.metrics.instance_up.labels(instance_id=iid, role=role.value).set(1)
        c.instance_event(iid, role, "flipped", f"{old.value} -> {role.value}: {reason}", source)

    async def stop(self) -> None:
        """Cancel the adds, drains and flips under way."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

"""The `ray` backend: each instance is a Ray actor that runs its engine (emulator or `vllm serve`)
on the node Ray placed it on.

The console polls, routes to and scales these instances like any other backend's; what Ray adds
is placement across nodes (by the custom resources or GPUs each role requests) and a watcher that
notices an actor or its node dying and tells the console why (`on_lost`). Ray itself is an
optional extra, imported only when the backend starts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from adapters.backends.base import BackendBase, Capability, instance_ids
from adapters.backends.emulator import migrate_emulated
from adapters.backends.settings import BackendSettings
from adapters.errors import BackendError
from adapters.ray import cluster
from adapters.ray.actor import InstanceActor, Launch, Placement
from adapters.vllm.instances import Instance
from core.errors import ConfigError
from core.types import Role

WATCH_INTERVAL_S = 1.0
"""How often the watcher checks that every actor and its node are alive."""
PING_TIMEOUT_S = 2.0
"""How long one round waits for the actors' answers (a slow answer is not a death)."""
STOP_TIMEOUT_S = 15.0
"""How long an actor may take to stop its engine before it is killed anyway."""

LostCallback = Callable[[str, str], None]
"""(instance id, reason): an instance's actor or node is gone."""


@dataclass
class Member:
    """One instance's actor and what the backend knows of it."""

    role: Role
    actor: Any
    """Its Ray actor handle (None while its placement group is being reserved)."""
    placement_group: Any = None
    placement: Placement | None = None
    ping: Any = None
    """The watcher's outstanding ping (one at a time, so a stuck actor does not pile them up)."""
    lost: str | None = None


def engine_capabilities(settings: BackendSettings) -> frozenset[Capability]:
    """What instances of this engine can do: emulated ones serve both legs and migrate; vLLM
    flips only with kv_both and never migrates; PRIORITY only with a priority queue."""
    caps = {Capability.SCALE}
    if settings.ray.engine == "emulator":
        caps |= {Capability.ROLE_FLIP, Capability.MIGRATION}
        if settings.emulator.scheduling_policy == "priority":
            caps.add(Capability.PRIORITY)
    else:
        if settings.vllm.kv_role == "kv_both":
            caps.add(Capability.ROLE_FLIP)
        if settings.vllm.scheduling_policy == "priority":
            caps.add(Capability.PRIORITY)
    return frozenset(caps)


class RayBackend(BackendBase):
    """Instances as Ray actors: placed by Ray across the nodes of a cluster (or a local Ray)."""

    name: ClassVar[str] = "ray"
    summary: ClassVar[str] = (
        "instances as Ray actors placed across a Ray cluster's nodes (emulator or vLLM engine; needs the ray extra)"
    )
    capabilities = frozenset({Capability.SCALE, Capability.ROLE_FLIP, Capability.MIGRATION, Capability.PRIORITY})

    def __init__(self, settings: BackendSettings, run_dir: Path) -> None:
        super().__init__(settings, run_dir)
        if settings.emulator.data_parallel_size > 1:
            raise ConfigError(
                "emulator.data_parallel_size: the ray backend places single-engine instances; "
                "data-parallel decode groups run on the emulator backend (or attach a DP vLLM deployment)"
            )
        self.capabilities = engine_capabilities(settings)
        self.label = f"ray-{settings.ray.engine}"
        self.members: dict[str, Member] = {}
        self._owner: cluster.OwnerThread | None = None
        self._connected = False
        self._local = False
        self._actor_class: Any = None
        self._seeds = 0
        self._watcher: asyncio.Task[None] | None = None
        self._on_lost: LostCallback | None = None
        self._unreported: dict[str, str] = {}

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> list[Instance]:
        """Join (or start) Ray, place every initial instance and wait until all answer /health."""
        s = self.settings
        if s.ray.engine == "vllm" and not s.model:
            raise ConfigError("--backend ray --engine vllm needs --model PATH (a model directory every node can load)")
        cluster.import_ray()
        self._owner = cluster.OwnerThread()
        self._connected = await asyncio.wrap_future(self._owner.submit(lambda: cluster.connect(s)))
        self._local = self._connected and s.ray.address is None  # every node is this host: engines bind 127.0.0.1
        roles = s.initial_roles()
        tasks: list[asyncio.Future[Instance]] = []
        try:
            await asyncio.to_thread(cluster.check_placeable, s, roles)
            tasks = [
                asyncio.ensure_future(self._launch(iid, role))
                for iid, role in zip(instance_ids(roles, s.instance_prefix), roles, strict=True)
            ]
            instances = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:  # no sibling may place an actor after stop()
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.stop()
            raise
        self._watcher = asyncio.create_task(self._watch(), name="ray-watcher")
        return list(instances)

    async def add(self, role: Role, instance_id: str) -> Instance:
        """Place one more actor of `role` and wait until its engine answers /health."""
        self.require(Capability.SCALE)
        await asyncio.to_thread(cluster.check_placeable, self.settings, [role])
        try:
            return await self._launch(instance_id, role)
        except BaseException:
            await self.remove(instance_id)
            raise

    async def remove(self, instance_id: str) -> None:
        """Stop the (drained) instance's engine, then its actor and placement group."""
        m = self.members.pop(instance_id, None)
        self._unreported.pop(instance_id, None)
        if m is not None:
            await asyncio.to_thread(self._retire, m)

    async def flip(self, instance_id: str, role: Role) -> None:
        """Emulated (or kv_both vLLM) instances serve both legs: the flip is the console's routing change."""
        self.require(Capability.ROLE_FLIP)
        if instance_id in self.members:
            self.members[instance_id].role = role

    async def migrate(self, request_id: str, source: Instance, target: Instance) -> dict[str, Any]:
        """Llumnix-style staged KV copy between two emulated instances, wherever they run."""
        self.require(Capability.MIGRATION)
        return await migrate_emulated(request_id, source, target)

    async def stop(self) -> None:
        """Stop every instance this backend placed; leave Ray (a local Ray stops; a remote cluster keeps running)."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        members, self.members = dict(self.members), {}
        await asyncio.gather(*(asyncio.to_thread(self._retire, m) for m in members.values()))
        owner, self._owner = self._owner, None
        if owner is not None:
            if self._connected:
                self._connected = False
                await asyncio.wrap_future(owner.submit(cluster.disconnect))
            owner.close()

    # --- node and actor loss ---------------------------------------------------------------------
    def on_lost(self, callback: LostCallback) -> None:
        """Call `callback(instance_id, reason)` when an instance's actor or node dies (losses seen
        before this call are delivered now)."""
        self._on_lost = callback
        pending, self._unreported = self._unreported, {}
        for iid, why in pending.items():
            callback(iid, why)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            watched = {iid: m for iid, m in self.members.items() if m.placement is not None and m.lost is None}
            if not watched:
                continue
            try:
                found = await asyncio.to_thread(self._check, watched)
            except Exception:  # noqa: BLE001 - Ray unreachable for a moment: the next round tries again
                continue
            for iid, why in found.items():
                m = self.members.get(iid)
                if m is None or m.lost is not None:
                    continue  # removed meanwhile: not a loss
                m.lost = why
                if self._on_lost is not None:
                    self._on_lost(iid, why)
                else:
                    self._unreported[iid] = why

    def _check(self, watched: dict[str, Member]) -> dict[str, str]:
        """One round: dead nodes, then a ping to every actor (its answer says whether its engine runs)."""
        ray = cluster.import_ray()
        from ray.exceptions import ActorUnavailableError, RayActorError, RayError

        nodes = cluster.alive_nodes()
        found: dict[str, str] = {}
        for iid, m in watched.items():
            p = m.placement
            assert p is not None
            if not nodes.get(p.node_id, False):
                found[iid] = f"its Ray node {p.node} is gone"
            elif m.ping is None:
                m.ping = m.actor.ping.remote()
        pinged = {iid: m for iid, m in watched.items() if iid not in found and m.ping is not None}
        if not pinged:
            return found
        ready, _ = ray.wait([m.ping for m in pinged.values()], num_returns=len(pinged), timeout=PING_TIMEOUT_S)
        done = set(ready)
        for iid, m in pinged.items():
            if m.ping not in done:
                continue
            ref, m.ping = m.ping, None
            try:
                why = ray.get(ref)
            except ActorUnavailableError:
                continue  # unreachable for now (e.g. its node is failing): the next round decides
            except RayActorError as e:
                why = f"its Ray actor died: {cluster.death_reason(e)}"
            except RayError as e:
                why = f"its Ray actor failed: {cluster.task_error(e)}"
            if why:
                found[iid] = why
        return found

    # --- one instance ----------------------------------------------------------------------------
    async def _launch(self, iid: str, role: Role) -> Instance:
        s = self.settings
        name = f"{self.run_dir.name}-{iid}"
        m = self.members[iid] = Member(role, None, cluster.reserve(s, role, name))
        if m.placement_group is not None:
            await asyncio.to_thread(cluster.wait_reserved, s, m.placement_group, name)
        ray = cluster.import_ray()
        if self._actor_class is None:
            self._actor_class = ray.remote(InstanceActor)
        actor = m.actor = self._actor_class.options(**cluster.actor_options(s, role, name, m.placement_group)).remote()
        seed, self._seeds = self._seeds, self._seeds + 1
        launch = Launch(
            iid, role, s.ray.engine, s, str(self.log_dir), seed, s.ray.startup_timeout_s, loopback=self._local
        )
        placement = await asyncio.to_thread(self._started, iid, actor.start.remote(launch))
        m.placement = placement
        return Instance(iid, role, placement.url, pid=None, node=placement.node)

    def _started(self, iid: str, ref: Any) -> Placement:
        """Wait for an actor's start(): placement by Ray, then its engine's /health."""
        ray = cluster.import_ray()
        from ray.exceptions import GetTimeoutError, RayActorError, RayError

        timeout = self.settings.ray.startup_timeout_s + cluster.PLACEMENT_TIMEOUT_S
        try:
            placement: Placement = ray.get(ref, timeout=timeout)
        except GetTimeoutError:
            raise BackendError(
                f"{iid} was not placed and healthy within {timeout:.0f} "
                "s (are the resources it requests free on some node?)"
            ) from None
        except RayActorError as e:
            raise BackendError(f"{iid}: its Ray actor died while starting: {cluster.death_reason(e)}") from None
        except RayError as e:
            raise BackendError(f"{iid} did not start: {cluster.task_error(e)}") from None
        return placement

    def _retire(self, m: Member) -> None:
        """Ask the actor to stop its engine (bounded), then kill the actor and free its placement group."""
        ray = cluster.import_ray()
        from ray.exceptions import GetTimeoutError, RayError

        # a starting actor's stop() would queue behind its start(): it is killed at once (its engine dies with it)
        if m.actor is not None and m.lost is None and m.placement is not None:
            with contextlib.suppress(GetTimeoutError, RayError):
                ray.get(m.actor.stop.remote(), timeout=STOP_TIMEOUT_S)
        if m.actor is not None:
            with contextlib.suppress(RayError, ValueError):
                ray.kill(m.actor, no_restart=True)
        with contextlib.suppress(RayError, ValueError):
            cluster.release(m.placement_group)

"""Changes to a running cluster: scale out and in, flip a role, migrate a request (by an operator or a policy)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from adapters.backends import Capability
from adapters.backends.base import require
from console.errors import ConsoleError
from console.live.request import LiveRequest, Step
from console.live.scaler import Scaler, ScalerHost
from core.errors import ConfigError, SibylError
from core.types import Role, ScaleAction

if TYPE_CHECKING:
    from console.live.events import EventBus
    from core.types import PeriodicDecisions


class ScaleError(ConsoleError):
    """A scale request the backend cannot carry out."""


class OperationsHost(ScalerHost, Protocol):
    """What operations need from the running console: the scaler's members, the live requests, the bus."""

    @property
    def live(self) -> Mapping[str, LiveRequest]:
        """Requests in the gateway now, by id."""

    @property
    def events(self) -> EventBus:
        """Where a migration's stall is published."""


class Operations:
    """Scale, flip and migrate on the host's backend; owns the scaler and the migrations under way."""

    def __init__(self, host: OperationsHost) -> None:
        self.c = host
        self.scaler = Scaler(host)
        """Carries out add, remove and flip (each with its reason, drained first on removal)."""
        self._migrations: set[asyncio.Task[None]] = set()

    @property
    def can_scale(self) -> bool:
        """Whether the backend can add and remove instances."""
        return Capability.SCALE in self.c.backend.capabilities

    async def stop(self) -> None:
        """Cancel the scaling under way."""
        await self.scaler.stop()

    # --- periodic policies -----------------------------------------------------------------------
    def carry_out(self, decisions: PeriodicDecisions, scaling_policy: str, reschedule_policy: str) -> None:
        """The periodic policies' decisions: scaling actions, then migrations (refused with why when the backend
        cannot)."""
        for action in decisions.scale:
            with contextlib.suppress(SibylError):  # a refusal is recorded as an event by the scaler
                self.scaler.execute(action, source=f"policy:{scaling_policy}")
        policy = f"policy:{reschedule_policy}"
        c = self.c
        for m in decisions.migrations:
            if Capability.MIGRATION not in c.backend.capabilities:
                c.instance_event(
                    m.source,
                    None,
                    "refused",
                    f"migration of {m.request_id} to {m.target}: the {c.backend.label} backend cannot migrate",
                    policy,
                )
                continue
            task = asyncio.create_task(self._migrate_logged(str(m.request_id), m.target, policy, m.reason))
            self._migrations.add(task)
            task.add_done_callback(self._migrations.discard)

    # --- migration -------------------------------------------------------------------------------
    async def migrate(self, request_id: str, target: str, source: str = "api", reason: str = "") -> dict[str, Any]:
        """Move a streaming request that is decoding to the decode instance `target`.

        Returns what the source reported once the KV is on the target; the client's stream then
        continues from there (LiveRequest follows the hand-off). Raises ScaleError when the
        request or target does not qualify and BackendError when the backend gave the move up."""
        c = self.c
        require(c.backend, Capability.MIGRATION)
        live = c.live.get(request_id)
        if live is None or live.step != Step.DECODING:
            raise ScaleError(f"request {request_id!r} is not decoding in the gateway now")
        if not live.stream:
            raise ScaleError(f"request {request_id!r} is not streaming: only a stream can follow a migration")
        if live.migrating_to is not None or live.handed_over is not None:
            raise ScaleError(f"request {request_id!r} is being migrated already")
        src = live.decode_instance
        if target == src:
            raise ScaleError(f"request {request_id!r} decodes on {target} already")
        if (
            target not in c.instances
            or c.dispatcher.role_of(target) != Role.DECODE
            or c.dispatcher.phase_of(target) != "active"
        ):
            raise ScaleError(f"{target!r} is not an active decode instance")
        assert src is not None
        live.migrating_to = target
        live.open_resume(c.instances[target])
        try:
            report = await c.backend.migrate(request_id, c.instances[src], c.instances[target])
        except BaseException:
            live.migrating_to = None
            live.drop_resume()
            raise
        return {"request_id": request_id, "source": src, "target": target, "reason": reason, **report, "by": source}

    async def _migrate_logged(self, request_id: str, target: str, source: str, reason: str) -> None:
        """A policy's migration: executed, or refused with why, as an event either way."""
        live = self.c.live.get(request_id)
        src = live.decode_instance if live is not None else None
        try:
            await self.migrate(request_id, target, source, reason)
        except SibylError as e:
            self.c.instance_event(src or target, None, "migration_refused", f"{request_id} → {target}: {e}", source)

    def migration_done(
        self, live: LiveRequest, src: str, target: str, last_before: float, tokens_before: int, first_after: float
    ) -> None:
        """The first token of a migrated request arrived from its new instance: record the stall,
        also in decode steps (the request's own mean time between tokens before the move)."""
        stall = first_after - last_before
        steps = ""
        if live.first_token_at is not None and tokens_before > 1 and last_before > live.first_token_at:
            step = (last_before - live.first_token_at) / (tokens_before - 1)
            steps = f" ({stall / step:.1f} of its decode steps of {step * 1000:.1f} ms)"
        detail = (
            f"request {live.id} → {target} after {tokens_before} tokens: "
            f"the client waited {stall * 1000:.1f} ms between tokens{steps}"
        )
        self.c.metrics.migration_stall.observe(stall)
        self.c.instance_event(src, Role.DECODE, "migrated", detail)
        self.c.events.publish(
            "migration", request_id=live.id, source=src, target=target, stall_s=stall, tokens_before=tokens_before
        )

    # --- scaling by an operator ------------------------------------------------------------------
    async def scale(self, role: str, delta: int, source: str = "api") -> dict[str, Any]:
        """Add `delta` instances of a role (or remove -delta: routing stops at once, the process after draining)."""
        c = self.c
        if not self.can_scale:
            raise ScaleError(f"the {c.backend.label} backend cannot add or remove instances")
        if role not in ("prefill", "decode") or not isinstance(delta, int) or isinstance(delta, bool) or delta == 0:
            raise ScaleError('expected {"role": "prefill"|"decode", "delta": a non-zero integer}')
        r = Role(role)
        changed: list[str] = []
        reason = f"operator via {source}"
        if delta > 0:
            for _ in range(delta):
                iid = self.scaler.execute(ScaleAction("add", r, reason=reason), source)
                assert iid is not None
                changed.append(iid)
            return {"role": role, "delta": delta, "instances": changed}
        routable = [i for i in c.instances.values() if i.role == r and c.dispatcher.phase_of(i.id) == "active"]
        if len(routable) + delta < 1:
            raise ScaleError(f"at least one {role} instance must remain ({len(routable)} active)")
        for inst in routable[delta:]:
            self.scaler.execute(ScaleAction("remove", r, inst.id, reason=reason), source)
            changed.append(inst.id)
        return {"role": role, "delta": delta, "instances": changed}

    async def flip(self, instance_id: str, role: str, source: str = "api") -> dict[str, Any]:
        """Make an instance serve the other role (routing changes; requests on it finish where they are)."""
        c = self.c
        try:
            r = Role(role)
        except ValueError:
            raise ScaleError(f"unknown role {role!r}: prefill or decode") from None
        inst = c.instances.get(instance_id)
        if inst is None:
            raise ScaleError(f"no instance {instance_id!r}; instances: {', '.join(c.instances)}")
        if inst.role == r:
            raise ScaleError(f"{instance_id} already serves {role}")
        others = [
            i
            for i in c.instances.values()
            if i.role == inst.role and i.id != instance_id and c.dispatcher.phase_of(i.id) == "active"
        ]
        if not others:
            raise ScaleError(f"{instance_id} is the last active {inst.role.value} instance")
        try:
            self.scaler.execute(ScaleAction("flip", r, instance_id, reason=f"operator via {source}"), source)
        except ConfigError as e:
            raise ScaleError(str(e)) from None
        return {"instance": instance_id, "role": role}

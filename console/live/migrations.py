"""Migrations of decoding requests: which streams can move, the move itself, and the stall the client saw."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from adapters.backends import Capability
from adapters.backends.base import require
from console.errors import ConsoleError
from core.errors import SibylError
from core.types import Role

if TYPE_CHECKING:
    from adapters.backends import Backend
    from adapters.vllm.instances import Instance
    from console.live.outcomes import Outcomes
    from core.dispatch import Dispatcher
    from core.types import Migration


class ScaleError(ConsoleError):
    """A scale, flip or migration the console refuses (the request or the target does not qualify)."""


class Migratable(Protocol):
    """A decoding request's stream as a migration sees it (console.live.relay.DecodeRelay)."""

    @property
    def stream(self) -> bool:
        """Whether the client reads a stream (only a stream can follow a migration)."""

    @property
    def decode_id(self) -> str:
        """The decode instance the stream comes from now."""

    @property
    def migrating(self) -> bool:
        """A migration is asked for, or handed over and waiting for its first token."""

    def expect_migration(self, target: Instance) -> None:
        """The stream will be handed over to `target`: open its continuation there now."""

    def give_up_migration(self) -> None:
        """The migration did not happen: forget the target, close the continuation."""


class MigrationWatch(Protocol):
    """What a live request tells the migrations (Migrations): its stream can move, it left, a move landed."""

    def decoding(self, request_id: str, stream: Migratable) -> None:
        """The request decodes now: its stream may be migrated until it leaves."""

    def left(self, request_id: str) -> None:
        """The request left the gateway."""

    def landed(
        self,
        request_id: str,
        src: str,
        target: str,
        last_before: float,
        tokens_before: int,
        first_after: float,
        first_token_at: float | None,
    ) -> None:
        """The first token of a migrated request arrived from its new instance."""


class Migrations:
    """Moves decoding streams between decode instances on the backend (by an operator or the reschedule
    policy) and reports each move's stall; holds the streams that may move now, by request id."""

    def __init__(
        self, backend: Backend, dispatcher: Dispatcher, instances: Mapping[str, Instance], outcomes: Outcomes
    ) -> None:
        self.backend = backend
        self.dispatcher = dispatcher
        self.instances = instances
        self.outcomes = outcomes
        """Where refusals and stalls go (the run's instance events, the bus, the stall histogram)."""
        self.streams: dict[str, Migratable] = {}
        """The decoding requests' streams, by request id."""
        self._tasks: set[asyncio.Task[None]] = set()

    # --- what a request tells ----------------------------------------------------------------------
    def decoding(self, request_id: str, stream: Migratable) -> None:
        self.streams[request_id] = stream

    def left(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def landed(
        self,
        request_id: str,
        src: str,
        target: str,
        last_before: float,
        tokens_before: int,
        first_after: float,
        first_token_at: float | None,
    ) -> None:
        """Record the stall, also in decode steps (the request's own mean time between tokens before the move)."""
        stall = first_after - last_before
        steps = ""
        if first_token_at is not None and tokens_before > 1 and last_before > first_token_at:
            step = (last_before - first_token_at) / (tokens_before - 1)
            steps = f" ({stall / step:.1f} of its decode steps of {step * 1000:.1f} ms)"
        detail = (
            f"request {request_id} → {target} after {tokens_before} tokens: "
            f"the client waited {stall * 1000:.1f} ms between tokens{steps}"
        )
        out = self.outcomes
        out.metrics.migration_stall.observe(stall)
        out.instance_event(src, Role.DECODE, "migrated", detail)
        out.events.publish(
            "migration", request_id=request_id, source=src, target=target, stall_s=stall, tokens_before=tokens_before
        )

    # --- moves -------------------------------------------------------------------------------------
    async def migrate(self, request_id: str, target: str, source: str = "api", reason: str = "") -> dict[str, Any]:
        """Move a streaming request that is decoding to the decode instance `target`.

        Returns what the source reported once the KV is on the target; the client's stream then
        continues from there (the request's DecodeRelay follows the hand-off). Raises ScaleError when the
        request or target does not qualify and BackendError when the backend gave the move up."""
        require(self.backend, Capability.MIGRATION)
        stream = self.streams.get(request_id)
        if stream is None:
            raise ScaleError(f"request {request_id!r} is not decoding in the gateway now")
        if not stream.stream:
            raise ScaleError(f"request {request_id!r} is not streaming: only a stream can follow a migration")
        if stream.migrating:
            raise ScaleError(f"request {request_id!r} is being migrated already")
        src = stream.decode_id
        if target == src:
            raise ScaleError(f"request {request_id!r} decodes on {target} already")
        d = self.dispatcher
        if target not in self.instances or d.role_of(target) != Role.DECODE or d.phase_of(target) != "active":
            raise ScaleError(f"{target!r} is not an active decode instance")
        stream.expect_migration(self.instances[target])
        try:
            report = await self.backend.migrate(request_id, self.instances[src], self.instances[target])
        except BaseException:
            stream.give_up_migration()
            raise
        return {"request_id": request_id, "source": src, "target": target, "reason": reason, **report, "by": source}

    def carry_out(self, migrations: list[Migration], policy: str) -> None:
        """The reschedule policy's migrations, each in its own task (refused with why when the backend cannot)."""
        for m in migrations:
            if Capability.MIGRATION not in self.backend.capabilities:
                self.outcomes.instance_event(
                    m.source,
                    None,
                    "refused",
                    f"migration of {m.request_id} to {m.target}: the {self.backend.label} backend cannot migrate",
                    policy,
                )
                continue
            task = asyncio.create_task(self._migrate_logged(str(m.request_id), m.target, policy, m.reason))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _migrate_logged(self, request_id: str, target: str, source: str, reason: str) -> None:
        """A policy's migration: executed, or refused with why, as an event either way."""
        record = self.outcomes.live.get(request_id)
        src = record.decode_instance if record is not None else None
        try:
            await self.migrate(request_id, target, source, reason)
        except SibylError as e:
            detail = f"{request_id} → {target}: {e}"
            self.outcomes.instance_event(src or target, None, "migration_refused", detail, source)

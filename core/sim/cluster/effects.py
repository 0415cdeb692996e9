"""What the cluster simulator's executors (migration, scaling) ask the engine to do.

An executor decides, talks to the dispatcher and the decode models, and records what it did; it
never writes the engine's state. It returns effects, and `ClusterSimulation` applies them at once,
in order. The order matters: an effect that schedules an event takes the engine's next sequence
number, which breaks ties between events of the same time and kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.types import Role


@dataclass(frozen=True, slots=True)
class Rebind:
    """The request's decode binding moves to `instance` (dispatcher index): it resumes there."""

    request: int
    instance: int


@dataclass(frozen=True, slots=True)
class Relocate:
    """The request's recorded decode instance (ClusterSimResult.decode_instance) becomes
    `instance` (dispatcher index)."""

    request: int
    instance: int


@dataclass(frozen=True, slots=True)
class Stale:
    """The decode progress of `instance` changed: read it again before a decision needs it."""

    instance: int


@dataclass(frozen=True, slots=True)
class Wake:
    """The decode model of `instance` changed: arm its next event again."""

    instance: int


@dataclass(frozen=True, slots=True)
class TransferDone:
    """The KV transfer of a migrating request ends at `at`."""

    request: int
    at: float


@dataclass(frozen=True, slots=True)
class StartInstance:
    """A new instance joins (STARTING); its cold start ends at `ready_at`."""

    instance_id: str
    role: Role
    ready_at: float


@dataclass(frozen=True, slots=True)
class ServeRole:
    """`instance` (dispatcher index) takes work of `role` from now on (a flip is over)."""

    instance: int
    role: Role


Effect = Rebind | Relocate | Stale | Wake | TransferDone | StartInstance | ServeRole

"""Dataclass messages the dashboard's workers and widgets post upward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.message import Message

from console.live.state import ConsoleState


@dataclass
class StateArrived(Message):
    """A fresh `/control/state` snapshot; a newer one replaces an unprocessed older one."""

    state: ConsoleState

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StateArrived)


@dataclass
class ConsoleEvent(Message):
    """One event from `/control/events` (policy, instance, failure, scale, replay...)."""

    event: dict[str, Any]


@dataclass
class ConnectionChanged(Message):
    """The control API became unreachable (`error` says why) or reachable again (`error` None)."""

    error: str | None
    retry_in_s: float = 0.0

"""What a LiveRequest needs from the console that runs it (`RequestHost`), and the steps of its life."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from adapters.vllm.instances import Instance
    from console.live.config import ConsoleConfig
    from console.live.metrics import GatewayMetrics
    from console.live.request import LiveRequest
    from core.dispatch import Dispatcher


def cached_tokens(reply: dict[str, Any]) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of a prefill leg's reply, when the engine reports it."""
    details = (reply.get("usage") or {}).get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if type(value) is int else None


class Step(StrEnum):
    """Where a live request is in its life."""

    ADMITTED = "admitted"
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE_BOUND = "decode_bound"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"


class RequestHost(Protocol):
    """What a LiveRequest needs from the console that runs it, and nothing more."""

    @property
    def dispatcher(self) -> Dispatcher:
        """Every routing decision, and the request table the outcome is reported to."""

    @property
    def instances(self) -> Mapping[str, Instance]:
        """The instances by id (the legs are sent to them)."""

    @property
    def config(self) -> ConsoleConfig:
        """The console's settings (failure_migration_attempts)."""

    @property
    def metrics(self) -> GatewayMetrics:
        """The gateway's Prometheus metrics (the decision-time histogram)."""

    @property
    def engine_priorities(self) -> bool:
        """Whether the instances order their queues by `priority` (then the queue policy may set it)."""

    def request_started(self, live: LiveRequest) -> None:
        """`live` entered the gateway (counted in flight)."""

    def request_done(self, live: LiveRequest) -> None:
        """`live` left with its outcome (called exactly once)."""

    def admit_tenant(self, live: LiveRequest) -> None:
        """Charge `live` to its tenant's limits; raises console.live.channel.Rejected (429) when over them."""

    def hold(self, live: LiveRequest) -> None:
        """The queue policy holds `live` until its `released` future is resolved."""

    def unhold(self, live: LiveRequest) -> None:
        """`live` left the queue (its client went away)."""

    def release_queued(self) -> None:
        """Let held requests go while the cluster has room."""

    def retry_after_s(self) -> float:
        """What a rejected client is told to wait."""

    def upstream_failed(self, instance_id: str) -> None:
        """A leg failed because of the instance."""

    def upstream_ok(self, instance_id: str) -> None:
        """A leg succeeded on the instance."""

    def lost_signal(self, instance_id: str) -> asyncio.Future[None]:
        """A future done once the instance is marked down or removed."""

    def migration_done(
        self, live: LiveRequest, src: str, target: str, last_before: float, tokens_before: int, first_after: float
    ) -> None:
        """The first token of a migrated request arrived from its new instance."""

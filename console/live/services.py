"""What a live request uses of the running console, bundled once when the controller wires it (`RequestServices`).

Each part is named by the small Protocol declared beside the part that implements it, so "go to definition"
on what a request calls lands on that Protocol and its implementer is one module away:

    tenants     console.live.tenants.TenantGate        (Tenants)
    held        console.live.admission.HeldQueue       (HeldRequests)
    health      console.live.health.LegHealth          (InstanceHealth)
    outcomes    console.live.outcomes.OutcomeSink      (Outcomes)
    migrations  console.live.migrations.MigrationWatch (Migrations)
    lora        console.live.lora.AdapterPlacement     (LiveAdapters)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from adapters.vllm.instances import Instance
    from console.live.admission import HeldQueue
    from console.live.health import LegHealth
    from console.live.lora import AdapterPlacement
    from console.live.metrics import GatewayMetrics
    from console.live.migrations import MigrationWatch
    from console.live.outcomes import OutcomeSink
    from console.live.tenants import TenantGate
    from core.dispatch import Dispatcher
    from core.types import Request


@dataclass(frozen=True, slots=True)
class RequestServices:
    """The parts a LiveRequest (and its DecodeRelay) call, and the settings they read; none calls back."""

    dispatcher: Dispatcher
    """Every routing decision, and the request table each request reports its own progress and end to."""
    instances: Mapping[str, Instance]
    """The instances by id (the legs are sent to them)."""
    tenants: TenantGate
    held: HeldQueue
    health: LegHealth
    outcomes: OutcomeSink
    migrations: MigrationWatch
    metrics: GatewayMetrics
    """The gateway's Prometheus metrics (the decision-time histogram)."""
    engine_priorities: bool
    """Whether the instances order their queues by `priority` (then the queue policy may set it)."""
    failure_migration_attempts: int
    """How many decode instances may fail under one request before it fails (0: failure migration off)."""
    lora: AdapterPlacement | None = None
    """Loads a request's LoRA adapter where its legs run (None: this console serves no adapters)."""
    arrivals: ArrivalNotes | None = None
    """Notes each arrival's prefix keys and session for the advisor (console.live.advisor.LiveAdvisor; None: off)."""


class ArrivalNotes(Protocol):
    """Who keeps what the gateway knew of each arrival that the run store does not (the advisor's windows)."""

    def note(self, request: Request, max_tokens_set: bool = True) -> None:
        """One arrival, as the gateway keyed it (`max_tokens_set`: its client set max_tokens)."""

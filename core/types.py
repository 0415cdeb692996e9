"""Plain data types shared by every layer: requests, instance roles and states, routing decisions."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Role(StrEnum):
    """What an instance serves."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def serves_prefill(self) -> bool:
        return self in (Role.PREFILL, Role.BOTH)

    def serves_decode(self) -> bool:
        return self in (Role.DECODE, Role.BOTH)


class PolicyKind(StrEnum):
    """The kinds of policy the dispatcher holds one active instance of."""

    ROUTING = "routing"
    RESCHEDULE = "reschedule"
    QUEUE = "queue"
    SCALING = "scaling"


@dataclass(slots=True)
class Request:
    """One inference request as the dispatcher sees it."""

    id: str | int
    arrival: float
    """Arrival time in seconds (virtual in the simulator, monotonic when live)."""
    prompt_tokens: int
    max_tokens: int
    """Upper bound on output tokens (the simulator uses it as the true output length)."""
    slo_class: str = "default"
    priority: int = 0
    """Lower runs earlier, as in vLLM's priority scheduling."""


@dataclass(slots=True)
class InstanceState:
    """What is known about one serving instance (from polling or from the simulator)."""

    id: str | int
    role: Role
    healthy: bool = True
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    """KV cache usage in [0, 1]."""
    kv_capacity_tokens: int = 0
    tokens_per_s: float = 0.0
    url: str = ""


@dataclass(frozen=True, slots=True)
class Assignment:
    """A routing decision: a prefill instance and (unless bound later) a decode instance."""

    prefill: str
    decode: str | None
    projected_handoff: float = 0.0
    """When the policy expects decode to start (τ), in the dispatcher's clock."""


@dataclass(frozen=True, slots=True)
class Migration:
    """Move a running request's KV and decoding from one decode instance to another."""

    request_id: str
    source: str
    target: str


@dataclass(frozen=True, slots=True)
class ScaleAction:
    """Add or remove an instance, or flip its role."""

    action: str
    """One of "add", "remove", "flip"."""
    role: Role
    instance_id: str | None = None


@dataclass(frozen=True, slots=True)
class PolicyEvent:
    """A recorded policy swap."""

    time: float
    kind: PolicyKind
    old: str | None
    new: str
    params: dict[str, object] = field(default_factory=dict)
    source: str = "api"

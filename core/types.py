"""Plain data types shared by every layer: requests, instances and their phases, policy decisions."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal


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
    RANK = "rank"
    """Which data-parallel rank of a decode instance a request runs on (BF-IO)."""


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
    tenant: str = ""
    """Who sent it; queue policies share a priority band fairly between tenants."""
    ttft_s: float | None = None
    """Its TTFT target; the dispatcher fills it from its SLO class when the client gave none."""
    tpot_s: float | None = None
    """Its TPOT target, filled the same way."""
    prefix_keys: tuple[int, ...] = ()
    """Our chain keys (``core.cache.keys.chain_keys``) of the prompt's full blocks at the cache's
    block size, in chain order; empty when unknown (nothing is matched: the prompt counts as fresh)."""
    session: str = ""
    """Conversation or client session it belongs to (session-affinity routing); empty: none."""
    lora: str | None = None
    """The LoRA adapter it runs under (its `model` names an adapter); None: the base model. Both legs
    of a P/D request run under it, and its `prefix_keys` carry it (``core.cache.keys.adapter_extra``)."""


class InstancePhase(StrEnum):
    """Where an instance is in its life: only ACTIVE instances are routed to."""

    STARTING = "starting"
    """Added, still loading weights (cold start); not routable yet."""
    ACTIVE = "active"
    """Serving and routable."""
    DRAINING = "draining"
    """Takes no new work; finishes what it holds, then stops."""
    STOPPED = "stopped"
    """Gone; kept in the view so indices stay stable."""


class Admission(StrEnum):
    """What the dispatcher's admission control says about a new request."""

    ROUTE = "route"
    """There is capacity: route it now."""
    QUEUED = "queued"
    """Held by the queue policy until `release` returns it (or it expires)."""
    SHED = "shed"
    """The queue is full: reject it (HTTP 429)."""


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
    observed_at: float | None = None
    """When its engine reported `running`, `waiting` and `kv_usage` (the dispatcher's clock: monotonic
    seconds live); None: now."""


@dataclass(frozen=True, slots=True)
class Assignment:
    """A routing decision: a prefill instance and (unless bound later) a decode instance.

    ``prefill`` is None for a *decode-only* request (a prefix-based P/D decider found the decode
    instance already holding most of the prompt): there is no prefill leg, ``decode`` is set and
    computes the prompt's uncached part itself (one request to it, without kv_transfer_params).
    """

    prefill: str | None
    decode: str | None
    projected_handoff: float = 0.0
    """When the policy expects decode to start (τ), in the dispatcher's clock."""

    @property
    def decode_only(self) -> bool:
        """No prefill leg: the decode instance serves the whole request."""
        return self.prefill is None


@dataclass(frozen=True, slots=True)
class Migration:
    """Move a running request's KV and decoding from one decode instance to another."""

    request_id: str | int
    source: str
    """Decode instance the request runs on now."""
    target: str
    """Decode instance it should continue on."""
    reason: str = ""
    """Why, quoting the numbers that triggered it."""


ScaleVerb = Literal["add", "remove", "flip"]


@dataclass(frozen=True, slots=True)
class ScaleAction:
    """Add or remove an instance, or flip its role; executed by the backend (or the simulator)."""

    action: ScaleVerb
    """add: a new instance of `role`; remove: drain `instance_id`, then stop it;
    flip: `instance_id` takes `role` (its new role) once it has drained its old work."""
    role: Role
    instance_id: str | None = None
    reason: str = ""
    """Human-readable, quoting the numbers that triggered the action."""


@dataclass(slots=True)
class PeriodicDecisions:
    """What the periodic policies proposed at one decision point."""

    migrations: list[Migration] = field(default_factory=list)
    scale: list[ScaleAction] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.migrations or self.scale)


@dataclass(frozen=True, slots=True)
class PolicyEvent:
    """A recorded policy swap."""

    time: float
    kind: PolicyKind
    old: str | None
    new: str
    params: dict[str, object] = field(default_factory=dict)
    source: str = "api"

"""The policy protocols of every kind and the small bases (kind, params, close) they build on."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from core.decision_records import note
from core.errors import NoCapacityError
from core.types import Assignment, Migration, PolicyKind, Request, ScaleAction

if TYPE_CHECKING:
    from core.periodic import ScalingSignals
    from core.view import ClusterView

BindPoint = Literal["prefill_start", "prefill_end"]


class PolicyParams(BaseModel):
    """Base of every policy's params: frozen, unknown fields rejected, defaults documented per field."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(PolicyParams):
    """This policy takes no parameters."""


class PolicyBase:
    """Shared plumbing of every policy: name (set by the registry), kind, params, close()."""

    kind: ClassVar[PolicyKind]
    name: str = ""

    def __init__(self, params: PolicyParams) -> None:
        self.params = params

    def close(self) -> None:
        """Release anything the policy holds; called once after it is swapped out."""

    def __repr__(self) -> str:
        return f"{self.name}({self.params.model_dump()})"


# --- routing -------------------------------------------------------------------------------


@runtime_checkable
class RoutingPolicy(Protocol):
    """Chooses a prefill instance and a decode instance for one request; pure, no I/O."""

    name: str
    kind: ClassVar[PolicyKind]
    params: PolicyParams
    bind_at: BindPoint
    """When the decode instance is chosen: with the prefill (SIBYL and baselines) or after it."""
    needs_progress: bool
    """Whether decisions read per-request decode progress (lets the simulator skip syncing it)."""
    needs_true_lengths: bool
    """Whether decisions read every request's true output length (simulator only)."""
    reads_prefix: bool
    """Whether decisions read the prefix cache (the live gateway then keys text and chat prompts too)."""

    def route(self, request: Request, view: ClusterView) -> Assignment: ...

    def choose_decode(self, request: Request, view: ClusterView) -> int: ...

    def display_load(self, view: ClusterView) -> np.ndarray: ...

    def assign_targets(self, request: Request, view: ClusterView, queue: QueuePolicy) -> None:
        """Set the TTFT/TPOT targets of a request that named no SLO class (before its class default)."""

    def observe_completion(self, request: Request, ttft_s: float, tpot_s: float, queue_s: float) -> None:
        """A request finished with these latencies (policies that learn targets use it)."""

    def close(self) -> None: ...


class RoutingPolicyBase(PolicyBase):
    """Defaults for routing policies: bind with the prefill, late choice and load by requests."""

    kind: ClassVar[PolicyKind] = PolicyKind.ROUTING
    bind_at: BindPoint = "prefill_start"
    needs_progress: bool = False
    needs_true_lengths: bool = False
    """True for oracles that read `table.max_out` as the true output length (simulator only)."""
    reads_prefix: bool = False
    """Whether decisions read the prefix cache (then the live gateway tokenizes text and chat prompts
    to key them; token-id prompts are keyed always)."""

    def assign_targets(self, request: Request, view: ClusterView, queue: QueuePolicy) -> None:
        return None

    def observe_completion(self, request: Request, ttft_s: float, tpot_s: float, queue_s: float) -> None:
        return None

    def display_load(self, view: ClusterView) -> np.ndarray:
        """Load per instance index as this policy weighs it (dashboards): running + pending here."""
        load: np.ndarray = (view.running_counts() + view.pending_counts()).astype(float)
        return load

    def choose_decode(self, request: Request, view: ClusterView) -> int:
        """The decode instance index for a request bound late (at prefill end).

        Default: the routable decode instance with the least `display_load`, lowest index on ties.
        """
        mask = view.decode_mask()
        if not mask.any():
            raise NoCapacityError("no healthy decode instance")
        load = self.display_load(view)
        d = int(np.argmin(np.where(mask, load, np.inf)))
        note(view, "decode", self.name, "display_load", load, mask, d)
        return d

    def route(self, request: Request, view: ClusterView) -> Assignment:
        """Every routing policy defines its decision (see RoutingPolicy)."""
        raise NotImplementedError

    def choose_decode_at(self, request: Request, view: ClusterView, tau: float) -> int:
        """The decode instance index this policy picks for a request whose KV lands at `tau`, when
        another policy chose its prefill instance (core/policies/compose.py). Default: the decode
        instance of its own routing decision (`choose_decode` if it has none)."""
        d = self.route(request, view).decode
        return view.index[d] if d is not None else self.choose_decode(request, view)

    def decode_loads(self, request: Request, view: ClusterView, tau: float) -> np.ndarray:
        """Per instance index, what this policy ranks decode instances by (lower is better) for a
        request whose KV lands at `tau`. Default: `display_load`."""
        return self.display_load(view)


# --- queue ---------------------------------------------------------------------------------


class QueueParams(PolicyParams):
    """Admission limits every queue policy shares."""

    max_in_flight_per_instance: int = Field(
        256,
        ge=1,
        description=(
            "requests in flight per routable decode instance (vLLM's default max_num_seqs); "
            "arrivals beyond limit × routable decode instances are held"
        ),
    )
    max_queued: int = Field(1024, ge=0, description="held requests at most; beyond it new arrivals are shed (429)")
    ttl_s: float = Field(60.0, gt=0, description="a request held longer than this many seconds is failed")
    max_prefill_backlog_s: float | None = Field(
        None,
        ge=0,
        description=(
            "also hold arrivals while every routable prefill instance has more than this many "
            "seconds of routed prefill work left (none: no such limit; 0: send only to an idle "
            "one); held requests then reach a prefill instance in the queue policy's order "
            "instead of their arrival order"
        ),
    )


@runtime_checkable
class QueuePolicy(Protocol):
    """Orders the requests admission holds while the cluster is saturated."""

    name: str
    kind: ClassVar[PolicyKind]
    params: QueueParams

    def push(self, request: Request, now: float) -> None: ...

    def pop(self, now: float) -> Request | None: ...

    def remove(self, request_id: str | int) -> Request | None: ...

    def __len__(self) -> int: ...

    def items(self) -> list[Request]: ...

    def depth_by_class(self) -> dict[str, int]: ...

    def observe_completion(self, request: Request, e2e_s: float, output_tokens: int) -> None:
        """A request finished (the dispatcher reports every one; policies that learn use it)."""

    def engine_priority(self, request: Request) -> int | None:
        """The `priority` to send the engine with this request (None: leave the client's)."""

    def close(self) -> None: ...


class QueuePolicyBase(PolicyBase):
    """Base of queue policies: kind and typed params; they learn nothing from completions and
    leave the engine-side priority to the client unless they say otherwise."""

    kind: ClassVar[PolicyKind] = PolicyKind.QUEUE
    params: QueueParams
    sets_engine_priority: ClassVar[bool] = False
    """Whether `engine_priority` gives a value (the console then starts vLLM with priority scheduling)."""

    def __init__(self, params: QueueParams) -> None:
        super().__init__(params)

    def observe_completion(self, request: Request, e2e_s: float, output_tokens: int) -> None:
        return None

    def engine_priority(self, request: Request) -> int | None:
        return None


# --- periodic kinds ------------------------------------------------------------------------


class PeriodicParams(PolicyParams):
    """Params every periodic policy has."""

    period_s: float = Field(5.0, gt=0, description="seconds between two decisions")


@runtime_checkable
class ReschedulePolicy(Protocol):
    """Periodically proposes moves of running requests between decode instances."""

    name: str
    kind: ClassVar[PolicyKind]
    params: PeriodicParams
    acts: bool
    """False for the no-op baseline: the dispatcher then schedules no periodic calls for it."""

    def propose(self, view: ClusterView, now: float) -> list[Migration]: ...

    def close(self) -> None: ...


class ReschedulePolicyBase(PolicyBase):
    kind: ClassVar[PolicyKind] = PolicyKind.RESCHEDULE
    acts: bool = True
    params: PeriodicParams


@runtime_checkable
class ScalingPolicy(Protocol):
    """Periodically proposes adding, removing (after draining) or flipping instances."""

    name: str
    kind: ClassVar[PolicyKind]
    params: PeriodicParams
    acts: bool
    """False for the no-op baseline: the dispatcher then schedules no periodic calls for it."""

    def propose(self, signals: ScalingSignals, view: ClusterView, now: float) -> list[ScaleAction]: ...

    def close(self) -> None: ...


class ScalingPolicyBase(PolicyBase):
    kind: ClassVar[PolicyKind] = PolicyKind.SCALING
    acts: bool = True
    params: PeriodicParams

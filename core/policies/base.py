"""The policy protocols and the typed-params base every policy builds on."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from core.types import Assignment, PolicyKind, Request

if TYPE_CHECKING:
    from core.view import ClusterView

BindPoint = Literal["prefill_start", "prefill_end"]


class PolicyParams(BaseModel):
    """Base of every policy's params: frozen, unknown fields rejected, defaults documented per field."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(PolicyParams):
    """This policy takes no parameters."""


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

    def route(self, request: Request, view: ClusterView) -> Assignment: ...

    def close(self) -> None: ...


class RoutingPolicyBase:
    """Shared plumbing for routing policies: kind, params, defaults for bind point and close()."""

    kind: ClassVar[PolicyKind] = PolicyKind.ROUTING
    name: str = ""
    bind_at: BindPoint = "prefill_start"
    needs_progress: bool = False

    def __init__(self, params: PolicyParams) -> None:
        self.params = params

    def close(self) -> None:
        """Release anything the policy holds; called once after it is swapped out."""

    def __repr__(self) -> str:
        return f"{self.name}({self.params.model_dump()})"

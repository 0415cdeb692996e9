"""Policies on a live console: the backend capability each one needs and the startup check (catalogue: registry)."""

from __future__ import annotations

from typing import Any

from adapters.backends import Backend, Capability
from console.live.config import ConsoleConfig
from core.errors import PolicyError
from core.policies import registry
from core.types import PolicyKind

POLICY_NEEDS: dict[PolicyKind, Capability] = {
    PolicyKind.RESCHEDULE: Capability.MIGRATION,
    PolicyKind.SCALING: Capability.SCALE,
    PolicyKind.RANK: Capability.DATA_PARALLEL,
}
"""Policies that act through the backend: any but the do-nothing baseline needs this capability."""


def check_capability(backend: Backend, kind: PolicyKind, name: str, params: dict[str, Any] | None = None) -> None:
    """Refuse a periodic policy that acts through the backend when the backend cannot carry it out."""
    need = POLICY_NEEDS.get(kind)
    if need is None or need in backend.capabilities or not registry.build(kind, name, params).acts:
        return
    have = ", ".join(sorted(c.value for c in backend.capabilities)) or "none"
    what = {
        Capability.MIGRATION: "moves running requests between decode instances",
        Capability.SCALE: "adds and removes instances",
        Capability.DATA_PARALLEL: "chooses data-parallel ranks",
    }[need]
    raise PolicyError(
        f"{kind} policy {name!r} {what}, which the {backend.label} backend cannot do "
        f"(it declares no {need.value} capability; its capabilities: {have})"
    )


def check_policies(config: ConsoleConfig, backend: Backend) -> None:
    """Build every configured policy once (bad names and params fail before anything starts)."""
    registry.build(PolicyKind.ROUTING, config.policy, config.params)
    choices = (
        (PolicyKind.QUEUE, config.queue),
        (PolicyKind.RESCHEDULE, config.reschedule),
        (PolicyKind.SCALING, config.scaling),
        (PolicyKind.RANK, config.rank),
    )
    for kind, choice in choices:
        registry.build(kind, choice.name, choice.params)
        check_capability(backend, kind, choice.name, choice.params)

"""A policy canary inside the dispatcher: the candidate routing or rank policy that decides for the canary arm.

The caller says which requests are in the canary arm (`in_canary`, a stable split the console hashes by
session, tenant or request id) and the dispatcher asks it once per request, when the request is routed:
the arm is kept with the request, so a request routed under the candidate is also bound late and given
its data-parallel rank by it, even after the canary ended. Every other request, and every request while
no canary runs, is decided by the active policy, as before. Only per-request decisions can be split:
routing and rank (a queue, reschedule or scaling policy acts on both arms at once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from core.types import PolicyKind, Request

CANARY: Final = "canary"
CONTROL: Final = "control"
SPLIT_KINDS: Final = (PolicyKind.ROUTING, PolicyKind.RANK)
"""The kinds a canary can split: policies that decide request by request."""


@dataclass
class Canary:
    """The running canary: its candidate policy, which requests it decides, and how many went each way."""

    kind: PolicyKind
    policy: Any
    """The candidate (a RoutingPolicy or a rank policy), built and validated as a swap builds one."""
    in_canary: Callable[[Request], bool]
    label: str = "canary"
    routed: dict[str, int] = field(default_factory=lambda: {CANARY: 0, CONTROL: 0})
    """Requests routed in each arm since it started."""

    @property
    def name(self) -> str:
        return str(self.policy.name)

    def arm(self, request: Request) -> str:
        """The request's arm, counted."""
        arm = CANARY if self.in_canary(request) else CONTROL
        self.routed[arm] += 1
        return arm

"""Routing, rescheduling, queueing and scaling policies behind one registry."""

from core.policies.base import NoParams, PolicyParams, RoutingPolicy, RoutingPolicyBase
from core.policies.registry import (
    PolicySpec,
    build,
    parse_policy_spec,
    register,
    spec,
    specs,
)

__all__ = [
    "NoParams",
    "PolicyParams",
    "PolicySpec",
    "RoutingPolicy",
    "RoutingPolicyBase",
    "build",
    "parse_policy_spec",
    "register",
    "spec",
    "specs",
]

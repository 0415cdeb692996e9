"""The policy registry: the built-in routing policies it lists, and what it refuses (unknown names, bad params)."""

from __future__ import annotations

import pytest

from core.errors import PolicyError
from core.policies import build, specs
from core.types import PolicyKind


def test_registry_lists_builtins_and_rejects_unknown_names_and_params() -> None:
    names = {s.name for s in specs(PolicyKind.ROUTING)}
    assert {"round_robin", "least_load", "req_level", "sibyl", "clairvoyant", "hyperflexis"} <= names
    with pytest.raises(
        PolicyError,
        match=(
            "available: clairvoyant, hyperflexis, least_load, lora_affinity, oracle, prefix_aware, "
            "prefix_pd, req_level, round_robin, session_affinity, sibyl"
        ),
    ):
        build("routing", "nope")
    with pytest.raises(PolicyError, match="bogus.*params: prob_at_1"):
        build("routing", "sibyl", {"bogus": 1})
    with pytest.raises(PolicyError, match="by"):
        build("routing", "least_load", {"by": "vibes"})
    assert build("routing", "sibyl", {"no_type1": "true"}).params.no_type1 is True

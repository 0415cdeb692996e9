"""Least load (ILS) on hand-built states: by running requests it ignores pending ones; by tokens it weighs KV."""

from __future__ import annotations

from tests.core.policies.routes import route_n
from tests.helpers import add_pending, add_running, cluster


def test_least_load_by_requests_ignores_pending_bound_requests() -> None:
    d = cluster("least_load", decode=3)
    add_running(d, "a", "d0", prompt=10, generated=5, rate=10, now=0)
    add_running(d, "b", "d1", prompt=10, generated=5, rate=10, now=0)
    add_running(d, "c", "d1", prompt=10, generated=5, rate=10, now=0)
    for k in range(5):  # d2 is about to receive five requests that are still in prefill
        add_pending(d, f"p{k}", "d2", prompt=10, handoff=0.5)
    assert route_n(d) == ["d2"]  # ILS herds onto the "idle" instance


def test_least_load_by_tokens_weighs_kv_tokens() -> None:
    d = cluster("least_load", {"by": "tokens"}, decode=2)
    add_running(d, "a", "d0", prompt=1000, generated=0, rate=10, now=0)
    add_running(d, "b", "d1", prompt=10, generated=5, rate=10, now=0)
    add_running(d, "c", "d1", prompt=10, generated=5, rate=10, now=0)
    assert route_n(d) == ["d1"]

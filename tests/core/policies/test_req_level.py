"""Request-level load balancing counts the pending requests bound to an instance."""

from __future__ import annotations

from tests.core.policies.routes import route_n
from tests.helpers import add_pending, add_running, cluster


def test_req_level_counts_pending_requests() -> None:
    d = cluster("req_level", decode=3)
    add_running(d, "a", "d0", prompt=10, generated=5, rate=10, now=0)
    for k in range(2):
        add_pending(d, f"p{k}", "d2", prompt=10, handoff=0.5)
    assert route_n(d) == ["d1"]

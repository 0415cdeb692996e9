"""Round robin: it cycles over the decode instances and skips an unhealthy one."""

from __future__ import annotations

from tests.core.policies.routes import route_n
from tests.helpers import cluster


def test_round_robin_cycles_and_skips_unhealthy() -> None:
    d = cluster("round_robin", decode=3)
    assert route_n(d, 4) == ["d0", "d1", "d2", "d0"]
    d.set_health("d1", False)
    assert route_n(d, 3) == ["d2", "d0", "d2"]

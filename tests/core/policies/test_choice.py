"""The routing policies' shared choices: no healthy decode instance, ties spread round-robin, least-queued prefill."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import NoCapacityError
from core.types import Request
from tests.core.policies.routes import route_n
from tests.helpers import cluster


def test_no_healthy_decode_instance_is_a_capacity_error() -> None:
    d = cluster("least_load", decode=2)
    d.set_health("d0", False)
    d.set_health("d1", False)
    with pytest.raises(NoCapacityError, match="decode"):
        route_n(d)


def test_rotating_argmin_spreads_ties() -> None:
    d = cluster("least_load", decode=4)
    picks = route_n(d, 8)  # nothing runs, so every instance ties at zero load
    assert sorted(set(picks)) == ["d0", "d1", "d2", "d3"]


def test_prefill_choice_is_least_queued() -> None:
    d = cluster("round_robin", prefill=2, decode=1)
    a = d.route(Request("x", 0.0, 10, 10), 0.0)
    b = d.route(Request("y", 0.0, 10, 10), 0.0)
    c = d.route(Request("z", 0.0, 10, 10), 0.0)
    assert [a.prefill, b.prefill, c.prefill] == ["p0", "p1", "p0"]
    # a toy prefill step: its 1 s base and the 0.1 s engine step it runs in; z waits for x's step
    assert np.allclose(d.view.prefill_free_at[[d.index_of("p0"), d.index_of("p1")]], [2.2, 1.1])

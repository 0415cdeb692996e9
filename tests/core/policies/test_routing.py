"""Routing policies decide correctly on hand-built cluster states."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from core.errors import NoCapacityError, PolicyError
from core.policies import build, specs
from core.types import PolicyKind, Request
from tests.helpers import add_pending, add_running, cluster

_ids = itertools.count()


def route(d, n: int = 1, prompt: int = 10, now: float = 0.0) -> list[str]:
    return [d.route(Request(f"new{next(_ids)}", now, prompt, 100), now).decode for _ in range(n)]


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


def test_round_robin_cycles_and_skips_unhealthy() -> None:
    d = cluster("round_robin", decode=3)
    assert route(d, 4) == ["d0", "d1", "d2", "d0"]
    d.set_health("d1", False)
    assert route(d, 3) == ["d2", "d0", "d2"]


def test_no_healthy_decode_instance_is_a_capacity_error() -> None:
    d = cluster("least_load", decode=2)
    d.set_health("d0", False)
    d.set_health("d1", False)
    with pytest.raises(NoCapacityError, match="decode"):
        route(d)


def test_least_load_by_requests_ignores_pending_bound_requests() -> None:
    d = cluster("least_load", decode=3)
    add_running(d, "a", "d0", prompt=10, generated=5, rate=10, now=0)
    add_running(d, "b", "d1", prompt=10, generated=5, rate=10, now=0)
    add_running(d, "c", "d1", prompt=10, generated=5, rate=10, now=0)
    for k in range(5):  # d2 is about to receive five requests that are still in prefill
        add_pending(d, f"p{k}", "d2", prompt=10, handoff=0.5)
    assert route(d) == ["d2"]  # ILS herds onto the "idle" instance


def test_req_level_counts_pending_requests() -> None:
    d = cluster("req_level", decode=3)
    add_running(d, "a", "d0", prompt=10, generated=5, rate=10, now=0)
    for k in range(2):
        add_pending(d, f"p{k}", "d2", prompt=10, handoff=0.5)
    assert route(d) == ["d1"]


def test_least_load_by_tokens_weighs_kv_tokens() -> None:
    d = cluster("least_load", {"by": "tokens"}, decode=2)
    add_running(d, "a", "d0", prompt=1000, generated=0, rate=10, now=0)
    add_running(d, "b", "d1", prompt=10, generated=5, rate=10, now=0)
    add_running(d, "c", "d1", prompt=10, generated=5, rate=10, now=0)
    assert route(d) == ["d1"]


def sibyl_state(params: dict | None = None):
    """d0: one running request; d1: one pending that starts before τ; d2: one that starts after.
    In the paper's token unit (the equations below are the paper's)."""
    d = cluster("sibyl", {"unit": "tokens", **(params or {})}, decode=4, survival_delta=100, survival_prior_max=1000)
    d.view.decode_rate.value = 10.0  # v̄_sys
    add_running(d, "run", "d0", prompt=100, generated=200, rate=10, now=0)
    add_pending(d, "early", "d1", prompt=50, handoff=2.0)
    add_pending(d, "late", "d2", prompt=300, handoff=9.0)
    return d


def test_sibyl_projected_load_matches_hand_computation_for_the_three_types() -> None:
    d = sibyl_state()
    d.view.now = 0.0
    loads = d.routing.projected_load(5.0, d.view)
    # Ŝ(l) = 1 − l/1000 (uniform prior).  Type 1: l(τ) = 200 + 10·5 = 250 →
    # (100 + 250)·Ŝ(250)/Ŝ(200) = 350·0.75/0.8.  Type 2: l = (5 − 2)·10 = 30 → (50 + 30)·0.97.
    # Type 3: max(0, 300 − 10·(9 − 5)) = 260.
    assert loads[d.index_of("d0")] == pytest.approx(350 * 0.75 / 0.8)
    assert loads[d.index_of("d1")] == pytest.approx(80 * 0.97)
    assert loads[d.index_of("d2")] == pytest.approx(260.0)
    assert loads[d.index_of("d3")] == 0.0


@pytest.mark.parametrize(
    ("params", "zeroed", "kept"),
    [({"no_type1": True}, "d0", "d1"), ({"no_type2": True}, "d1", "d2"), ({"no_type3": True}, "d2", "d0")],
)
def test_sibyl_ablations_drop_exactly_their_type(params: dict, zeroed: str, kept: str) -> None:
    full = sibyl_state().routing.projected_load(5.0, sibyl_state().view)
    d = sibyl_state(params)
    loads = d.routing.projected_load(5.0, d.view)
    assert loads[d.index_of(zeroed)] == 0.0
    assert loads[d.index_of(kept)] == pytest.approx(full[d.index_of(kept)])


def test_sibyl_prob_at_1_ignores_survival() -> None:
    d = sibyl_state({"prob_at_1": True})
    loads = d.routing.projected_load(5.0, d.view)
    assert loads[d.index_of("d0")] == pytest.approx(350.0)
    assert loads[d.index_of("d1")] == pytest.approx(80.0)


def test_sibyl_type3_interference_decays_with_the_gap() -> None:
    """Eq. 8, not Algorithm 1's line 17: a request starting further after τ weighs less."""
    d = sibyl_state()
    near = d.routing.projected_load(8.0, d.view)[d.index_of("d2")]
    far = d.routing.projected_load(5.0, d.view)[d.index_of("d2")]
    assert near == pytest.approx(290.0) and far == pytest.approx(260.0)
    assert far < near


def test_sibyl_avoids_the_instance_that_ils_herds_onto() -> None:
    """d0 looks idle now but three long prompts bound to it start decoding before τ."""
    kw = dict(decode=2, survival_delta=100, survival_prior_max=1000)
    s = cluster("sibyl", **kw)
    ils = cluster("least_load", **kw)
    for d in (s, ils):
        d.view.decode_rate.value = 10.0
        add_running(d, "old", "d1", prompt=20, generated=980, rate=10, now=0)  # nearly done
        for k in range(3):
            add_pending(d, f"p{k}", "d0", prompt=400, handoff=0.2)
    assert route(ils) == ["d0"]
    assert route(s) == ["d1"]


def test_rotating_argmin_spreads_ties() -> None:
    d = cluster("least_load", decode=4)
    picks = route(d, 8)  # nothing runs, so every instance ties at zero load
    assert sorted(set(picks)) == ["d0", "d1", "d2", "d3"]


def test_prefill_choice_is_least_queued() -> None:
    d = cluster("round_robin", prefill=2, decode=1)
    a = d.route(Request("x", 0.0, 10, 10), 0.0)
    b = d.route(Request("y", 0.0, 10, 10), 0.0)
    c = d.route(Request("z", 0.0, 10, 10), 0.0)
    assert [a.prefill, b.prefill, c.prefill] == ["p0", "p1", "p0"]
    # a toy prefill step: its 1 s base and the 0.1 s engine step it runs in; z waits for x's step
    assert np.allclose(d.view.prefill_free_at[[d.index_of("p0"), d.index_of("p1")]], [2.2, 1.1])

"""SIBYL on hand-built states: the τ projection of the paper's three request types, its ablations, and the lifetime
horizon (uniform and TPOT-weighted), the unit it resolves and the load it displays."""

from __future__ import annotations

import numpy as np
import pytest

from core.dispatch import Dispatcher
from tests.core.policies.routes import route_n, route_one
from tests.helpers import add_pending, add_running, cluster, toy_profile

# --- the τ projection ---------------------------------------------------------------------------


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
    assert route_n(ils) == ["d0"]
    assert route_n(s) == ["d1"]


# --- SIBYL's lifetime horizon ----------------------------------------------------------------


def young_vs_old(params: dict) -> Dispatcher:
    """d0: two requests that just started; d1: three requests at age 900 of at most 1,000.

    Ŝ(l) = 1 − l/1000 (uniform prior), v̄ = 10 tok/s, τ = 1 s (the toy prefill takes 1 s).
    """
    d = cluster("sibyl", params, decode=2, survival_delta=100, survival_prior_max=1000)
    d.view.decode_rate.value = 10.0
    for k in range(2):
        add_running(d, f"young{k}", "d0", prompt=10, generated=0, rate=10, now=0)
    for k in range(3):
        add_running(d, f"old{k}", "d1", prompt=10, generated=900, rate=10, now=0)
    return d


def test_lifetime_horizon_and_tau_horizon_choose_differently() -> None:
    tau = young_vs_old({"unit": "requests"})
    life = young_vs_old({"unit": "requests", "horizon": "lifetime"})
    # At τ = 1 s all five are very likely still alive: d0 holds 2·Ŝ(10) = 1.98 expected requests,
    # d1 3·Ŝ(910)/Ŝ(900) = 2.7, so the τ projection prefers d0.
    at_tau = tau.routing.projected_load(1.0, tau.view)
    assert at_tau[tau.index_of("d0")] == pytest.approx(1.98)
    assert at_tau[tau.index_of("d1")] == pytest.approx(2.7)
    # Over the new request's expected lifetime, T = E[L]/v̄ = 500/10 = 50 s, the old ones are gone
    # within 9 s while the young ones stay for most of it:
    # young: [I(510) − I(10)]/(v·T) = 370/500 = 0.74; old: [I(1000) − I(910)]/(v·T·Ŝ(900)) = 0.081.
    over_life = life.routing.projected_load(1.0, life.view)
    assert over_life[life.index_of("d0")] == pytest.approx(2 * 0.74, rel=1e-3)
    assert over_life[life.index_of("d1")] == pytest.approx(3 * 0.081, rel=1e-3)
    assert route_one(tau) == "d0"
    assert route_one(life) == "d1"


def test_lifetime_counts_a_pending_request_for_the_part_of_the_window_it_lives() -> None:
    d = cluster("sibyl", {"horizon": "lifetime"}, decode=3, survival_delta=100, survival_prior_max=1000)
    d.view.decode_rate.value = 10.0
    add_pending(d, "early", "d0", prompt=10, handoff=0.0)  # alive from τ − 1 s
    add_pending(d, "late", "d1", prompt=10, handoff=41.0)  # starts 40 s into the 50 s window
    loads = d.routing.projected_load(1.0, d.view)
    sv = d.view.survival
    expect_early = (sv.integral_at(np.array([510.0])) - sv.integral_at(np.array([10.0])))[0] / 500
    expect_late = sv.integral_at(np.array([100.0]))[0] / 500
    assert loads[d.index_of("d0")] == pytest.approx(expect_early)
    assert loads[d.index_of("d1")] == pytest.approx(expect_late)
    assert loads[d.index_of("d2")] == 0.0


def test_tpot_weighting_weighs_each_moment_by_its_share_of_the_new_requests_tpot() -> None:
    """One fresh request (Ŝ uniform on [0, 1000], same speed as the newcomer): it is present at
    the newcomer's token u with Ŝ(u), and token u weighs w(u) = Σ_{l>u} P(L=l)/l in its TPOT."""
    d = cluster(
        "sibyl",
        {"horizon": "lifetime", "lifetime_weighting": "tpot"},
        decode=1,
        survival_delta=100,
        survival_prior_max=1000,
    )
    d.view.decode_rate.value = 10.0
    add_running(d, "r", "d0", prompt=10, generated=0, rate=10, now=0)
    u = np.arange(1000)
    w = np.cumsum(1 / (1000 * np.arange(1000, 0, -1)))[::-1]  # Σ_{l=u+1}^{1000} 1/(1000·l)
    w = np.append(w[1:], 0.0)
    exact = float((w * (1 - u / 1000)).sum())
    got = d.routing.projected_load(0.0, d.view)[d.index_of("d0")]
    assert got == pytest.approx(exact, rel=0.03)  # a 7-cell quadrature
    # Front-loaded: the old requests of `young_vs_old` weigh more than over a uniform window.
    uniform = young_vs_old({"unit": "requests", "horizon": "lifetime"})
    tpot = young_vs_old({"unit": "requests", "horizon": "lifetime", "lifetime_weighting": "tpot"})
    old_u = uniform.routing.projected_load(1.0, uniform.view)[uniform.index_of("d1")]
    old_t = tpot.routing.projected_load(1.0, tpot.view)[tpot.index_of("d1")]
    assert pytest.approx(old_u, rel=1e-3) == 3 * 0.081 and old_t > 2 * old_u


def test_unit_auto_resolves_from_horizon_and_profile() -> None:
    assert cluster("sibyl").routing.unit(cluster("sibyl").view) == "requests"  # the default: the sweep's best
    d = cluster("sibyl", {"unit": "auto"})
    assert d.routing.unit(d.view) == "tokens"  # auto with τ: the paper, reproducible as one setting
    life = cluster("sibyl", {"horizon": "lifetime", "unit": "auto"})
    assert life.routing.unit(life.view) == "requests"  # TPS(N) curve: speed depends on N only
    kv = Dispatcher(
        toy_profile(tps_curve=None, decode_step_per_kv_token_s=1e-6),
        "sibyl",
        {"horizon": "lifetime", "unit": "auto"},
    )
    assert kv.routing.unit(kv.view) == "step_time"


def test_sibyl_display_load_is_the_projection_at_now() -> None:
    d = young_vs_old({"unit": "requests"})
    d.view.now = 0.0
    assert np.allclose(d.routing.display_load(d.view), d.routing.projected_load(0.0, d.view))

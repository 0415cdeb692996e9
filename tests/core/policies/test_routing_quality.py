"""Routing quality: the clairvoyant reference, SIBYL's lifetime horizon, and the routing sweep."""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from core.dispatch import Dispatcher
from core.errors import PolicyError
from core.policies import build
from core.types import Request, Role
from tests.helpers import add_pending, add_running, cluster, toy_profile

_ids = itertools.count()
ROOT = Path(__file__).resolve().parents[3]
ORACLE_KW = {"true_lengths": True} if "true_lengths" in inspect.signature(Dispatcher.__init__).parameters else {}
"""What a dispatcher needs to be allowed to run an oracle (the simulator says lengths are true)."""


def route(d: Dispatcher, prompt: int = 10, out: int = 100, now: float = 0.0) -> str:
    a = d.route(Request(f"new{next(_ids)}", now, prompt, out), now)
    assert a.decode is not None
    return a.decode


def set_true_length(d: Dispatcher, rid: str, out: int) -> None:
    d.view.table.max_out[d.view.table.row[rid]] = out


# --- clairvoyant ----------------------------------------------------------------------------


def nearly_done_vs_long_running(policy: str, params: dict | None = None) -> Dispatcher:
    """d0: two requests 10 tokens from their end; d1: one request with 9,000 tokens to go.

    The toy profile decodes TPS(N) = 10 tok/s in total, so one token costs N/10 s per request.
    """
    d = cluster(policy, params, decode=2, **ORACLE_KW)
    d.view.decode_rate.value = 10.0
    for k in range(2):
        add_running(d, f"short{k}", "d0", prompt=10, generated=990, rate=5, now=0)
        set_true_length(d, f"short{k}", 1000)
    add_running(d, "long", "d1", prompt=10, generated=1000, rate=10, now=0)
    set_true_length(d, "long", 10_000)
    return d


@pytest.mark.parametrize("objective", ["sum", "self"])
def test_clairvoyant_picks_where_true_remaining_work_makes_the_request_fastest(
    objective: str,
) -> None:
    assert route(nearly_done_vs_long_running("least_load")) == "d1"  # fewest running now
    d = nearly_done_vs_long_running("clairvoyant", {"objective": objective})
    # A 1,000-token request shares d0 for ~10 tokens then decodes alone (≈ 0.1 s/token); on d1 it
    # shares with the long request all its life (0.2 s/token).
    costs = d.routing.costs(Request("x", 0.0, 10, 1000), 0.0, d.view)
    if objective == "self":
        assert costs[d.index_of("d1")] == pytest.approx(0.2)
        assert costs[d.index_of("d0")] == pytest.approx((10 * 0.3 + 990 * 0.1) / 1000)
    assert costs[d.index_of("d0")] < costs[d.index_of("d1")]
    assert route(d, out=1000) == "d0"


def test_clairvoyant_counts_pending_requests_by_their_true_length() -> None:
    """d0 is empty but two long requests bound to it start decoding at once."""
    d = cluster("clairvoyant", decode=2, **ORACLE_KW)
    d.view.decode_rate.value = 10.0
    for k in range(2):
        add_pending(d, f"p{k}", "d0", prompt=10, handoff=0.5)
        set_true_length(d, f"p{k}", 5000)
    add_running(d, "r", "d1", prompt=10, generated=0, rate=10, now=0)
    set_true_length(d, "r", 5000)
    assert route(d, out=1000) == "d1"


def test_clairvoyant_iteration_model_avoids_kv_overflow() -> None:
    prof = toy_profile(
        tps_curve=None,
        decode_step_per_seq_s=0.01,
        decode_step_per_kv_token_s=1e-5,
        kv_capacity_tokens=3000,
    )
    d = Dispatcher(prof, "clairvoyant", {"model": "iteration"}, **ORACLE_KW)
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    d.add_instance("d1", Role.DECODE)
    d.view.decode_rate.value = 10.0
    # d0: one request that will hold 2,500 KV tokens; d1: two short ones, 400 tokens together.
    add_running(d, "big", "d0", prompt=500, generated=0, rate=10, now=0)
    set_true_length(d, "big", 2000)
    for k in range(2):
        add_running(d, f"s{k}", "d1", prompt=100, generated=0, rate=10, now=0)
        set_true_length(d, f"s{k}", 100)
    costs = d.routing.costs(Request("x", 0.0, 500, 1000), 0.0, d.view)
    assert costs[d.index_of("d0")] > 1.0  # the KV overflow penalty
    assert route(d, prompt=500, out=1000) == "d1"


def test_clairvoyant_declares_it_needs_true_lengths() -> None:
    policy = build("routing", "clairvoyant")
    assert type(policy).needs_true_lengths is True
    assert getattr(build("routing", "sibyl"), "needs_true_lengths", False) is False
    if "true_lengths" not in inspect.signature(Dispatcher.__init__).parameters:
        pytest.skip("Dispatcher has no true_lengths flag yet (the refusal lives there)")
    with pytest.raises(PolicyError, match="simulator"):
        Dispatcher(toy_profile(), "clairvoyant", None, true_lengths=False)
    Dispatcher(toy_profile(), "clairvoyant", None, true_lengths=True)


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
    assert route(tau) == "d0"
    assert route(life) == "d1"


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


def test_survival_integrals_match_the_curve() -> None:
    from core.estimators import SurvivalEstimator

    sv = SurvivalEstimator(delta=100, max_len=1000, prior_max=1000)
    x = np.array([0.0, 10.0, 500.0, 999.5, 1000.0])
    assert np.allclose(sv.integral_at(x), x - x * x / 2000, atol=1e-3)
    assert np.allclose(sv.integral_at(x, moment=True), x**2 / 2 - x**3 / 3000, rtol=1e-3, atol=0.5)
    assert sv.mean_length() == pytest.approx(500.0)


# --- the sweep ---------------------------------------------------------------------------------


def _sweep_module():
    return importlib.import_module("benchmarks.routing_sweep")


def test_sweep_cells_produce_rows_and_resume(tmp_path: Path) -> None:
    sw = _sweep_module()
    from core.perf import get_profile

    cells = [
        sw.Cell("random", "ps", 4, "1:4", 0.9, "poisson"),
        sw.Cell("reasoning-chat", "iteration", 4, "1:1", 0.8, "bursty"),
    ]
    policies = [p for p in sw.POLICIES if p.label in ("least_load", "sibyl(lifetime)", "clairvoyant")]
    out = tmp_path / "sweep.jsonl"
    logs: list[str] = []
    prof = get_profile("h20-qwen3-32b")
    rows = sw.sweep(cells, policies, out, requests=150, seed=3, profile=prof, log=logs.append)
    assert len(rows) == 6 and len(out.read_text().splitlines()) == 6
    for r in rows:
        assert {
            "cell",
            "policy",
            "tpot_p99",
            "tpot_p999",
            "tpot_mean",
            "slo_attainment",
            "mode",
            "decode",
            "prefill",
            "load",
            "arrival",
            "workload",
        } <= set(r)
        assert r["completed"] == 150 and r["tpot_p99"] > 0
    assert rows[-1]["params"] == {"model": "iteration"}  # the oracle is told the decode model
    assert cells[1].prefill == 4 and cells[0].prefill == 1
    logs.clear()
    again = sw.sweep(cells, policies, out, requests=150, seed=3, profile=prof, log=logs.append)
    assert "0 to go" in logs[0] and len(again) == 6
    assert len(out.read_text().splitlines()) == 6  # nothing re-run
    md, js = sw.write_report(again, out, [p.label for p in policies])
    assert "headroom" in md.read_text()
    summary = json.loads(js.read_text())
    assert {s["cell"] for s in summary} == {c.key for c in cells}
    assert all("headroom" in s for s in summary)


def test_bench_decision_times_policy_settings_and_oracles() -> None:
    from console.offline.benchmarking import decision_latency, loaded_dispatcher
    from core.errors import PolicyError
    from core.policies import parse_policy_spec

    assert parse_policy_spec("sibyl") == ("sibyl", {})
    assert parse_policy_spec("sibyl:horizon=lifetime,unit=requests") == (
        "sibyl",
        {"horizon": "lifetime", "unit": "requests"},
    )
    assert parse_policy_spec("least_load(by=tokens, bind=arrival)") == (
        "least_load",
        {"by": "tokens", "bind": "arrival"},
    )
    for bad in ("sibyl:horizon", "(by=tokens)", "x(=1)"):
        with pytest.raises(PolicyError, match="key=value|no name"):
            parse_policy_spec(bad)
    for name, params in (("sibyl", {"horizon": "lifetime"}), ("clairvoyant", {})):
        d = loaded_dispatcher(
            toy_profile(),
            name,
            params,
            prefill_instances=1,
            decode_instances=4,
            running_per_instance=4,
            pending_per_instance=1,
        )
        row = decision_latency(d, iterations=20, warmup=2)
        assert row["tracked_requests"] == 20 and row["p99_us"] > 0

"""SIBYL's projection on hand-built states, and bit for bit the plain whole-column form it replaced (issue 27)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from core.dispatch import Dispatcher
from core.policies.choice import RotatingArgmin
from core.policies.compose import guarded_argmin
from core.request_table import PENDING, RUNNING
from core.types import Request, Role
from core.view import ClusterView
from tests.helpers import add_pending, add_running, cluster, toy_profile

_EPS = 1e-9


def tau_reference(policy: Any, tau: float, view: ClusterView) -> np.ndarray:
    """L_j(τ) as core/policies/sibyl.py computed it before issue 27: np.where over whole columns."""
    t, prm, now = view.table, policy.params, view.now
    n = t.n
    inst, l_in = t.inst[:n], t.l_in[:n]
    run = t.state[:n] == RUNNING
    v_sys = view.decode_rate.value
    v = t.v[:n]
    l_now = (now - t.t_obs[:n]) * v + t.l_obs[:n]
    gap = tau - t.tau[:n]
    l_eval = np.where(run, v * (tau - now) + l_now, np.maximum(gap, 0.0) * v_sys)
    sv = view.survival
    prob = np.ones(n) if prm.prob_at_1 else sv(l_eval) / np.maximum(sv(l_now), _EPS)
    after = (gap < 0) & ~run
    decayed = np.maximum(v_sys * gap + l_in, 0.0)
    unit = policy.unit(view)
    if unit == "tokens":
        weights = (l_eval + l_in) * prob
    elif unit == "requests":
        weights = prob
        decayed = decayed / np.maximum(l_in, 1.0)
    else:
        a, b = view.profile.decode_step_per_seq_s, view.profile.decode_step_per_kv_token_s
        weights = (a + b * (l_in + l_eval)) * prob
        decayed = a * decayed / np.maximum(l_in, 1.0) + b * decayed
    weights = np.where(after, decayed, weights)
    if prm.no_type1:
        weights = np.where(run, 0.0, weights)
    if prm.no_type2:
        weights = np.where(~run & ~after, 0.0, weights)
    if prm.no_type3:
        weights = np.where(after, 0.0, weights)
    bound = inst >= 0
    return np.bincount(np.where(bound, inst, 0), weights=np.where(bound, weights, 0.0), minlength=view.n_instances)


def lifetime_reference(policy: Any, tau: float, view: ClusterView) -> np.ndarray:
    """The lifetime horizon (uniform and tpot weighting) as computed before issue 27."""
    t, prm, now = view.table, policy.params, view.now
    n = t.n
    run = t.state[:n] == RUNNING
    sv = view.survival
    v_sys = max(view.decode_rate.value, _EPS)
    v = np.where(run, t.v[:n], v_sys)
    v = np.where(v > _EPS, v, v_sys)
    l_now = np.where(run, t.l_obs[:n] + t.v[:n] * (now - t.t_obs[:n]), 0.0)
    unit = policy.unit(view)
    a_s, b_s = view.profile.decode_step_per_seq_s, view.profile.decode_step_per_kv_token_s
    if prm.lifetime_weighting == "tpot":
        ages, cw, ext = policy._tpot_nodes(view)
        age = np.where(run, l_now + v * (tau - now), (tau - t.tau[:n]) * v_sys) + 1.0
        acc, tok = np.zeros(n), np.zeros(n)
        for u, c in zip(ages.tolist(), cw.tolist(), strict=True):
            x = v / v_sys * u + age
            p = np.take(ext, x.astype(np.int64), mode="clip") * c
            acc += p
            tok += (np.maximum(x - 1.0, 0.0) + t.l_in[:n]) * p
        norm = 1.0 if prm.prob_at_1 else np.maximum(sv(l_now), _EPS)
        presence, tokens = acc / norm, tok / norm
        weights = {"requests": presence, "tokens": tokens}.get(unit, a_s * presence + b_s * tokens)
    else:
        T = float(prm.lifetime_tokens or max(sv.mean_length(), 1.0)) / v_sys
        start = np.where(run, now, t.tau[:n])
        x0 = np.maximum(l_now + v * (tau - start), l_now)
        x1 = np.maximum(l_now + v * (tau + T - start), l_now)
        norm = v * T
        if not prm.prob_at_1:
            norm = norm * np.maximum(sv(l_now), _EPS)
            d_int = sv.integral_at(x1) - sv.integral_at(x0)
            d_mom = sv.integral_at(x1, moment=True) - sv.integral_at(x0, moment=True)
        else:
            d_int, d_mom = x1 - x0, 0.5 * (x1 * x1 - x0 * x0)
        tokens = (t.l_in[:n] * d_int + d_mom) / norm
        weights = {"requests": d_int / norm, "tokens": tokens}.get(unit, a_s * d_int / norm + b_s * tokens)
    if prm.no_type1:
        weights = np.where(run, 0.0, weights)
    before = t.tau[:n] <= tau
    if prm.no_type2:
        weights = np.where(~run & before, 0.0, weights)
    if prm.no_type3:
        weights = np.where(~run & ~before, 0.0, weights)
    inst = t.inst[:n]
    bound = inst >= 0
    return np.bincount(np.where(bound, inst, 0), weights=np.where(bound, weights, 0.0), minlength=view.n_instances)


def random_state(rng: np.random.Generator, params: dict[str, Any]) -> Dispatcher:
    """Running and pending rows on random decode instances (some unbound), pending rows before and after τ,
    zero and tiny rates, a folded survival curve."""
    prof = toy_profile(decode_step_per_seq_s=1e-3, decode_step_per_kv_token_s=1e-6, max_model_len=4096)
    d = Dispatcher(prof, "sibyl", params, survival_delta=64, survival_prior_max=4096)
    for i in range(2):
        d.add_instance(f"p{i}", Role.PREFILL)
    decode = [d.add_instance(f"d{i}", Role.DECODE) for i in range(int(rng.integers(1, 8)))]
    t, v = d.view.table, d.view
    v.now = now = float(rng.uniform(0, 50))
    unbound = float(rng.choice([0.0, 0.2]))
    for k in range(int(rng.choice([0, 1, 5, 200]))):
        i = t.add(f"r{k}")
        running = bool(rng.random() < 0.7)
        t.state[i] = RUNNING if running else PENDING
        t.inst[i] = -1 if rng.random() < unbound else int(rng.choice(decode))
        t.l_in[i] = float(rng.choice([0, 1, rng.integers(1, 3000)]))
        t.l_obs[i] = float(rng.integers(0, 4500)) if running else 0.0
        t.t_obs[i] = now - float(rng.uniform(0, 3))
        t.v[i] = float(rng.choice([0.0, 1e-12, rng.uniform(0, 60)])) if running else 0.0
        t.tau[i] = 0.0 if running else now + float(rng.uniform(-5, 20))
    for length in rng.integers(1, 5000, int(rng.integers(0, 40))):
        v.survival.observe(int(length))
    v.decode_rate.value = float(rng.choice([rng.uniform(1, 60), 1e-12]))
    return d


SETTINGS = [
    {"unit": u, "horizon": h, "lifetime_weighting": w, "prob_at_1": p}
    for u, (h, w), p in itertools.product(
        ("requests", "tokens", "step_time"), (("tau", "uniform"), ("lifetime", "uniform"), ("lifetime", "tpot")), (0, 1)
    )
] + [
    {"unit": u, "horizon": h, f"no_type{k}": True}
    for u in ("requests", "tokens")
    for h in ("tau", "lifetime")
    for k in (1, 2, 3)
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_projection_is_bit_identical_to_the_plain_form(params: dict[str, Any]) -> None:
    rng = np.random.default_rng(27)
    for _ in range(25):
        d = random_state(rng, params)
        policy, view = d.routing, d.view
        reference = tau_reference if params["horizon"] == "tau" else lifetime_reference
        for tau in (view.now, view.now + float(rng.uniform(0, 10))):
            got = policy.projected_load(tau, view)
            assert got.tobytes() == reference(policy, tau, view).tobytes()


@pytest.mark.parametrize(
    ("unit", "want"),
    [
        # d0: Ŝ(250)/Ŝ(200) = 0.75/0.8; d1: Ŝ(30) = 0.97; d2 (Type 3): max(0, 300 − 10·4)/300.
        ("requests", {"d0": 0.75 / 0.8, "d1": 0.97, "d2": 260 / 300}),
        # (a + b·(l_in + l)) · P and, Type 3, a·decayed/l_in + b·decayed with a = 0.01, b = 1e-4.
        (
            "step_time",
            {"d0": (0.01 + 1e-4 * 350) * 0.75 / 0.8, "d1": (0.01 + 1e-4 * 80) * 0.97, "d2": 0.01 * 260 / 300 + 0.026},
        ),
    ],
)
def test_tau_projection_by_hand_with_an_unbound_request(unit: str, want: dict[str, float]) -> None:
    """The three types at τ = 5 s (Ŝ(l) = 1 − l/1000, v̄ = 10), and a pending request bound to no
    instance yet, which counts nowhere."""
    d = Dispatcher(
        toy_profile(decode_step_per_seq_s=0.01, decode_step_per_kv_token_s=1e-4),
        "sibyl",
        {"unit": unit},
        survival_delta=100,
        survival_prior_max=1000,
    )
    d.add_instance("p0", Role.PREFILL)
    for i in range(4):
        d.add_instance(f"d{i}", Role.DECODE)
    d.view.decode_rate.value = 10.0
    add_running(d, "run", "d0", prompt=100, generated=200, rate=10, now=0)
    add_pending(d, "early", "d1", prompt=50, handoff=2.0)
    add_pending(d, "late", "d2", prompt=300, handoff=9.0)
    t = d.view.table
    i = t.add("unbound")
    t.l_in[i], t.tau[i] = 500.0, 1.0
    loads = d.routing.projected_load(5.0, d.view)
    assert loads.sum() == pytest.approx(sum(want.values()))
    for iid, value in {**want, "d3": 0.0}.items():
        assert loads[d.index_of(iid)] == pytest.approx(value)


def test_rotating_argmin_rotates_over_ties_within_tolerance_and_skips_masked() -> None:
    pick = RotatingArgmin()
    values = np.array([0.0, 5.0, 1e-12, 0.0, -1.0])
    mask = np.array([True, True, True, True, False])
    assert [pick(values, mask) for _ in range(4)] == [2, 3, 0, 2]  # 0, 1e-12 and 0 tie; -1 is masked


def test_guarded_argmin_guards_by_the_least_finite_queue() -> None:
    pick = RotatingArgmin()
    queued = np.array([np.inf, 3.0, np.nan, 0.5, 2.4])
    ttft = np.array([0.1, 0.2, 0.0, 9.0, 3.0])
    # finite: 3.0, 0.5, 2.4; within 2 s of 0.5: indices 3 and 4; the least TTFT among them is 4.
    assert guarded_argmin(ttft, queued, 2.0, pick) == 4
    assert guarded_argmin(ttft, queued, None, pick) == 1
    with pytest.raises(ValueError):
        guarded_argmin(ttft, np.array([np.inf, np.nan, np.inf, np.inf, np.inf]), 2.0, pick)


def test_sibyl_routes_by_the_projection_on_a_cluster() -> None:
    """End to end through the dispatcher: the instance least loaded at τ wins."""
    d = cluster("sibyl", decode=2, survival_delta=100, survival_prior_max=1000)
    d.view.decode_rate.value = 10.0
    add_running(d, "old", "d1", prompt=20, generated=980, rate=10, now=0)
    for k in range(3):
        add_pending(d, f"p{k}", "d0", prompt=400, handoff=0.2)
    assert d.route(Request("new", 0.0, 10, 100), 0.0).decode == "d1"

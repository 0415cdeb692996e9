"""ARES rescheduling: the policy round on hand-built states, and migration in the simulator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import core.policies.ares  # noqa: F401  (registers ares, current_load, ares_oracle)
from core.dispatch import Dispatcher
from core.errors import PolicyError
from core.policies import registry
from core.predict import SurvivalPredictor
from core.sim.cluster import ClusterSimulation
from core.sim.cluster.decode_iter import IterationDecodeInstance
from core.types import Migration, PolicyKind
from tests.core.policies.states import decode_cluster, run_observed
from tests.helpers import toy_profile

# --- hand-built dispatcher states ------------------------------------------------------------


def _policy(name: str, **params: Any) -> Any:
    return registry.build(PolicyKind.RESCHEDULE, name, params)


def _sigma(loads: np.ndarray, weights: np.ndarray) -> float:
    return float(loads.var(axis=0) @ weights)


def _trajectories(tokens: np.ndarray, rem: np.ndarray, h: int, delta: int) -> np.ndarray:
    steps = np.arange(h + 1) * delta
    return np.where(steps[None, :] < rem[:, None], tokens[:, None] + steps[None, :], 0.0)


def test_theta_decides_which_instances_are_overloaded() -> None:
    d = decode_cluster(4)
    for k, load in enumerate([1000, 1000, 1000, 1500]):
        run_observed(d, f"r{k}", f"d{k}", prompt=load - 100, generated=100, out=10_000)
    run_observed(d, "small", "d3", prompt=50, generated=0, out=10_000)  # d3: 1550
    # mean 1137.5: θ=0.1 flags d3 (1550 > 1251); θ=0.5 flags nobody (1550 < 1706).
    p = _policy("current_load", theta=0.1)
    moves = p.propose(d.view, 0.0)
    assert p.last.overloaded == ["d3"] and p.last.underloaded == ["d0", "d1", "d2"]
    assert [(m.request_id, m.source) for m in moves] == [("small", "d3")]
    strict = _policy("current_load", theta=0.1, underload="strict")
    strict.propose(d.view, 0.0)
    assert strict.last.underloaded == ["d0", "d1", "d2"]  # w < 0.9·1137.5 = 1024
    calm = _policy("current_load", theta=0.5)
    assert calm.propose(d.view, 0.0) == [] and calm.last.overloaded == []


def test_best_move_rejected_for_oom_on_target_then_second_best_is_chosen() -> None:
    # KV capacity 10k (limit 9.5k with the 5 % margin); H = 10 steps of 20 tokens, γ = 0.8.
    d = decode_cluster(4, kv_capacity_tokens=10_000, max_model_len=100_000)
    big = 100_000
    sizes0 = [2000, 1900, 1800, 1700]
    for k, n in enumerate(sizes0):  # d0: long requests, 7400 now
        run_observed(d, f"s{k}", "d0", prompt=n - 100, generated=100, out=big)
    for k in range(30):  # d1: light now (3000) but grows to 9000 within the horizon
        run_observed(d, f"a{k}", "d1", prompt=50, generated=50, out=big)
    for k in range(5):  # d2: 5500 → 6500
        run_observed(d, f"b{k}", "d2", prompt=1000, generated=100, out=big)
    for k in range(5):  # d3: 6500 → 7500
        run_observed(d, f"c{k}", "d3", prompt=1200, generated=100, out=big)
    params = dict(horizon_steps=10, step_tokens=20, gamma=0.8, worth_filter=False)
    p = _policy("ares_oracle", **params)
    moves = p.propose(d.view, 0.0)
    assert len(moves) == 1 and p.last.overloaded == ["d0"]

    # Brute force: σ̂² after every move (r on d0 → t), from the trajectories directly.
    t = d.view.table
    rows = np.arange(t.n)
    tokens = t.l_in[rows] + t.l_obs[rows]
    rem = t.max_out[rows] - t.l_obs[rows]
    traj = _trajectories(tokens, rem, 10, 20)
    inst = t.inst[rows] - 1  # decode positions (index 0 is the prefill instance)
    loads = np.zeros((4, 11))
    np.add.at(loads, inst, traj)
    beta = 0.8 ** np.arange(1, 11)
    weights = np.concatenate([[1.0], beta / beta.sum()])
    base = _sigma(loads, weights)
    ranked = []
    for r in np.flatnonzero(inst == 0):
        for u in (1, 2, 3):
            after = loads.copy()
            after[0] -= traj[r]
            after[u] += traj[r]
            fits = bool(np.max(after[u]) <= 0.95 * 10_000)
            ranked.append((base - _sigma(after, weights), t.ids[r], f"d{u}", fits))
    ranked.sort(reverse=True)
    best, second = ranked[0], next(x for x in ranked if x[3])
    assert best[2] == "d1" and not best[3], "the best move must overflow d1 within the horizon"
    assert second[2] != "d1"
    assert (moves[0].request_id, moves[0].target) == (second[1], second[2])
    rejected = p.last.rejected_oom
    assert rejected and rejected[0][:2] == (best[1], best[2])
    assert rejected[0][2] == pytest.approx(best[0], rel=1e-6)
    assert p.last.sigma_before - p.last.sigma_after == pytest.approx(second[0], rel=1e-6)
    # The paper's literal rule (current target load + N̂(r) ≤ capacity) adds the whole predicted
    # remaining length (99,900 tokens here), so no move passes it.
    literal = _policy("ares_oracle", **params, oom_check="literal")
    assert literal.propose(d.view, 0.0) == []
    assert len(literal.last.rejected_oom) == sum(1 for x in ranked if x[0] > 0)


def test_max_moves_per_round_and_each_instance_moves_once() -> None:
    d = decode_cluster(6)
    for src in ("d0", "d1", "d2"):
        for k in range(3):
            run_observed(d, f"{src}-{k}", src, prompt=900, generated=100, out=10_000)
    for dst in ("d3", "d4", "d5"):
        run_observed(d, f"{dst}-x", dst, prompt=100, generated=0, out=10_000)
    one = _policy("current_load")
    assert len(one.propose(d.view, 0.0)) == 1
    many = _policy("current_load", max_moves=3)
    moves = many.propose(d.view, 0.0)
    assert len(moves) == 3
    assert len({m.source for m in moves}) == 3 and len({m.target for m in moves}) == 3
    assert {m.source for m in moves} == {"d0", "d1", "d2"}
    assert many.last.sigma_after < many.last.sigma_before
    # Moved requests rest for cooldown_s: the next round may not move them again.
    again = many.propose(d.view, 1.0)
    assert not {m.request_id for m in again} & {m.request_id for m in moves}
    restless = _policy("current_load", cooldown_s=0)
    first = restless.propose(d.view, 0.0)
    assert restless.propose(d.view, 1.0) == first  # same state, nothing resting: same move


def test_prediction_matters_current_load_vs_ares() -> None:
    # Every completion so far had 1000 output tokens. d0 holds four requests about to finish
    # (990 generated: heavy now, empty in 10 tokens); d1 four young ones (10 generated) that will
    # grow for ~1000 tokens. current_load moves a dying request d0 → d1; ARES sees d0 drain and
    # moves a young request d1 → d0 instead.
    d = decode_cluster(2, max_model_len=2000)
    for _ in range(600):
        d.view.survival.observe(1000)
    for k in range(4):
        run_observed(d, f"old{k}", "d0", prompt=100, generated=990, out=1000)
        run_observed(d, f"new{k}", "d1", prompt=100, generated=10, out=1000)
    # (Both with the strict underload rule: the literal one — current load < (1+θ)·w̄ — never
    # calls d0 underloaded while it still holds its dying requests.)
    cur = _policy("current_load", underload="strict").propose(d.view, 0.0)
    ares_policy = _policy("ares", underload="strict")
    ares = ares_policy.propose(d.view, 0.0)
    assert [(m.source, m.target) for m in cur] == [("d0", "d1")]
    assert str(cur[0].request_id).startswith("old")
    assert ares_policy.last.overloaded == ["d1"]
    assert [(m.source, m.target) for m in ares] == [("d1", "d0")]
    assert str(ares[0].request_id).startswith("new")
    assert _policy("ares").propose(d.view, 0.0) == []  # literal: no underloaded target


def test_worth_filter_drops_requests_that_end_before_their_transfer() -> None:
    # Transfer 0.01 s per token, 0.1 s steps: moving 1000 KV tokens costs 100 decode steps.
    d = decode_cluster(2, kv_transfer_per_token_s=0.01, max_model_len=100_000)
    run_observed(d, "short", "d0", prompt=900, generated=100, out=150)  # 50 tokens left < 100 steps
    run_observed(d, "long", "d0", prompt=900, generated=100, out=50_000)
    run_observed(d, "x", "d1", prompt=10, generated=0, out=50_000)
    p = _policy("ares_oracle", worth_filter=True)
    p.propose(d.view, 0.0)
    assert p.last.overloaded == ["d0"] and p.last.candidates == 1
    q = _policy("ares_oracle", worth_filter=False)
    q.propose(d.view, 0.0)
    assert q.last.candidates == 2


def test_policy_params_are_validated() -> None:
    with pytest.raises(PolicyError, match="model_path"):
        _policy("ares", predictor="learned")
    with pytest.raises(PolicyError, match="theta"):
        _policy("ares", theta=-1)
    with pytest.raises(PolicyError, match="bogus"):
        _policy("current_load", bogus=1)
    with pytest.raises(PolicyError, match="cannot load"):
        _policy("ares", predictor="learned", model_path="/nonexistent/model.pt")
    with pytest.raises(PolicyError, match="simulator"):
        Dispatcher(toy_profile(), reschedule=("ares_oracle", {}))


# --- the survival predictor ----------------------------------------------------------------


def test_survival_predictor_residual_life_on_a_known_distribution() -> None:
    lengths = np.arange(1, 1001)  # uniform on 1..1000
    sp = SurvivalPredictor.from_lengths(lengths, max_len=1000, delta=8)
    ages = np.array([0.0, 200.0, 600.0, 990.0])
    assert sp.mean_remaining(ages) == pytest.approx((1000 - ages) / 2, abs=6)
    assert sp.median_remaining(ages) == pytest.approx((1000 - ages) / 2, abs=10)
    assert sp.conditional(np.array([200.0]), 400.0) == pytest.approx([0.5], abs=0.02)
    assert sp.remaining(np.array([999.0]))[0] == 1.0  # clamped to the cap
    delta, values = sp.table()
    again = SurvivalPredictor.from_table(values, delta=delta, max_len=1000)
    assert np.allclose(again.mean_remaining(ages), sp.mean_remaining(ages))


def test_core_predict_imports_without_torch() -> None:
    root = Path(__file__).resolve().parents[3]
    code = "import core.predict, core.policies.ares, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert out.stdout.strip() == "False"


# --- migration in the simulator ------------------------------------------------------------


class Scripted:
    """A reschedule policy stand-in proposing fixed migrations at its first call."""

    name = "scripted"
    kind = PolicyKind.RESCHEDULE
    acts = True
    needs_progress = False

    def __init__(self, at: float, moves: list[Migration]) -> None:
        self.params = SimpleNamespace(period_s=at)
        self.moves = moves
        self.calls = 0

    def propose(self, view: Any, now: float) -> list[Migration]:
        self.calls += 1
        return self.moves if self.calls == 1 else []

    def close(self) -> None:
        pass


def _sim(profile: Any, prompts: list[int], outputs: list[int], moves: list[Migration] | None, at: float = 2.1) -> Any:
    d = Dispatcher(profile, "round_robin")
    if moves is not None:
        policy = Scripted(at, moves)
        d.policies[PolicyKind.RESCHEDULE] = policy
        d.runner.schedule(PolicyKind.RESCHEDULE, policy, 0.0)
    sim = ClusterSimulation(
        arrivals=np.zeros(len(prompts)),
        prompt_tokens=np.array(prompts),
        output_tokens=np.array(outputs),
        profile=profile,
        n_prefill=2,
        n_decode=2,
        dispatcher=d,
        mode="iteration",
    )
    return sim.run()


# Prefill 1 s; steps 0.1 s whatever the batch; any KV transfer 0.05 s + 0.01 s per token.
_MIG = dict(kv_transfer_base_s=0.05, kv_transfer_per_token_s=0.01)


def test_migration_stalls_only_the_migrating_request() -> None:
    prof = toy_profile(**_MIG)
    # Round robin: A → p0/d0, B → p1/d1, C → p0/d0. P→D transfer of 10 tokens: 0.15 s.
    prompts, outputs = [10, 10, 10], [50, 40, 30]
    base = _sim(prof, prompts, outputs, None, at=2.2)
    r = _sim(prof, prompts, outputs, [Migration(0, "d0", "d1", "test")], at=2.2)
    # Each prefill is 1 s plus the 0.1 s step it runs in. Without migration A and B decode from
    # 1.25, a token per 0.1 s each. C (second on p0) ends its prefill at 2.2, mid-step on d0: its KV
    # read starts at the step's end, 2.25, ends at 2.40 mid-step, and C joins at 2.45.
    assert base.finish == pytest.approx([6.25, 5.25, 5.45])
    # Proposed at 2.2 (mid-step): A holds 10 + 9 KV tokens, reserved on d1; d0 pauses it at the
    # 2.25 boundary with 10 generated (20 KV) → transfer 0.05 + 0.2 s → arrives 2.5, mid-step on
    # d1 → joins at 2.55 → its 40 remaining tokens take 4 s: done at 6.55 (0.3 s stall). B on the
    # target is not delayed; C's read ends at 2.40 on a source left idle, so C joins at once.
    ev = [(e.outcome, round(e.time, 9), e.tokens) for e in r.migration_events]
    assert ev == [("accepted", 2.2, 19), ("started", 2.25, 20), ("done", 2.5, 20)]
    assert r.migration_events[1].transfer_s == pytest.approx(0.25)
    assert r.finish == pytest.approx([6.55, 5.25, 5.40])
    assert r.first_token == pytest.approx([*base.first_token[:2], 2.50])
    assert r.migrations == 1 and r.migrated_tokens == 20 and r.migrations_refused == {}
    assert r.request_migrations.tolist() == [1, 0, 0]
    assert r.decode_instance.tolist() == [1, 1, 0]
    assert r.ok.all() and r.preemptions == 0


def test_migration_refused_without_kv_room_on_the_target() -> None:
    # KV 100 tokens. B (80-token prompt) decodes on d1 from 1.95; at 2.2 it holds 82 tokens, so
    # A's 19 (+ one token each for the next step) do not fit.
    prof = toy_profile(**_MIG, kv_capacity_tokens=100)
    r = _sim(prof, [10, 80], [50, 15], [Migration(0, "d0", "d1", "test")], at=2.2)
    assert r.migrations == 0 and r.migrations_refused == {"no_kv_room": 1}
    assert [(e.outcome, e.detail) for e in r.migration_events] == [("refused", "no_kv_room")]
    assert r.finish == pytest.approx([6.25, 3.45]) and r.preemptions == 0
    refused = _sim(
        prof,
        [10, 80],
        [50, 15],
        [
            Migration(1, "d0", "d1", "wrong source"),
            Migration(0, "d0", "d0", "same"),
            Migration(99, "d0", "d1", "unknown"),
        ],
    )
    assert refused.migrations_refused == {"wrong_source": 1, "same_instance": 1, "unknown_request": 1}


def test_migration_under_processor_sharing() -> None:
    # Each instance decodes 10 tok/s in total (toy TPS curve), shared by its running requests.
    prof = toy_profile(**_MIG)
    d = Dispatcher(prof, "round_robin")
    policy = Scripted(2.1, [Migration(0, "d0", "d1", "test")])
    d.policies[PolicyKind.RESCHEDULE] = policy
    d.runner.schedule(PolicyKind.RESCHEDULE, policy, 0.0)
    sim = ClusterSimulation(
        arrivals=np.zeros(2),
        prompt_tokens=np.array([10, 10]),
        output_tokens=np.array([50, 40]),
        profile=prof,
        n_prefill=2,
        n_decode=2,
        dispatcher=d,
        mode="ps",
    )
    r = sim.run()
    # A and B decode alone from 1.15. At 2.1 A has 9.5 tokens: it pauses at once, moves
    # 10 + 9 KV tokens in 0.05 + 0.19 s and resumes on d1 at 2.34, where B has 11.9 tokens.
    # Sharing 5 tok/s each, B's 28.1 left end at 7.96; A then has 12.4 left alone: 9.2.
    assert [e.outcome for e in r.migration_events] == ["accepted", "started", "done"]
    assert [e.time for e in r.migration_events] == pytest.approx([2.1, 2.1, 2.34])
    assert r.finish == pytest.approx([9.2, 7.96])
    assert r.first_token == pytest.approx([1.25, 1.25]) and r.migrations == 1
    assert d.migrations == 1 and d.view.running_n.sum() == 0


def test_kv_is_accounted_on_both_sides_during_a_migration() -> None:
    prof = toy_profile(kv_capacity_tokens=100, decode_step_per_kv_token_s=0.001)
    src, dst = IterationDecodeInstance(prof), IterationDecodeInstance(prof)
    src.admit(1, 50, 20, 0.0)
    src.admit(2, 50, 20, 0.0)
    dst.admit(3, 50, 30, 0.0)
    src.fire(0.0)
    dst.fire(0.0)
    assert src.kv0 == 40 and dst.kv0 == 30
    # Step 1 on src: 0.1 + 0.001·40 = 0.14 s. Reserve at 0.07 (mid-step), pause at 0.14.
    assert dst.can_host(src.tokens_of(1, 0.07), 0.07)
    dst.reserve(1, src.tokens_of(1, 0.07), 0.07)
    assert dst.reserved == 20 and dst.resident_tokens(0.07) == 50
    assert src.request_detach(1, 0.07) and src.next_event_time() == pytest.approx(0.14)
    src.fire(0.14)
    assert src.detached == [(1, 20, 1.0, 50)]
    # Source: request 2 alone in the batch (21 tokens), request 1's 21 tokens still held.
    assert src.running == [2] and src.kv0 == 21 and src.reserved == 21
    assert src.resident_tokens(0.14) == 42
    # Its steps no longer read request 1's KV: 0.1 + 0.001·21.
    assert src.next_event_time() - 0.14 > 0
    assert src._t(1) == pytest.approx(0.121)
    src.release_outgoing(1, 0.3)
    assert src.reserved == 0
    dst.attach(1, 20, 1.0, 50, 0.3)
    assert dst.reserved == 21 and 1 in dst.waiting
    # A new 60-token request does not fit next to the held one (30+k + 21 + 60 > 100) ...
    assert not dst.can_host(60, 0.3)
    t = dst.next_event_time()
    dst.fire(t)
    # ... and the migrated one joins first, without a recompute, its KV moved into the batch.
    assert 1 in dst.running and dst.reserved == 0 and dst.extra == 0.0
    assert dst.kv0 == sum(dst.seqs[r].prompt + dst.seqs[r].generated for r in dst.running)


def test_ares_in_the_simulator_moves_load_and_keeps_every_request() -> None:
    # Two decode instances; round robin puts every long request on d0 and every short one on d1.
    prof = toy_profile(
        prefill_base_s=0.01,
        decode_step_base_s=0.01,
        decode_step_per_kv_token_s=1e-6,
        kv_transfer_per_token_s=1e-5,
        kv_capacity_tokens=20_000,
        max_model_len=10_000,
    )
    n = 40
    out = np.where(np.arange(n) % 2 == 0, 2000, 50)
    d = Dispatcher(prof, "round_robin", reschedule=("ares", {"period_s": 0.5}))
    sim = ClusterSimulation(
        arrivals=np.arange(n) * 0.05,
        prompt_tokens=np.full(n, 200),
        output_tokens=out,
        profile=prof,
        n_prefill=1,
        n_decode=2,
        dispatcher=d,
        mode="iteration",
    )
    r = sim.run()
    assert r.ok.all()
    assert r.migrations > 0 and r.migrations_proposed >= r.migrations
    moved = r.request_migrations > 0
    assert np.all(out[moved] == 2000)  # only long requests are worth moving
    done = [e for e in r.migration_events if e.outcome == "done"]
    assert all(e.source == "d0" and e.target == "d1" for e in done[:1])

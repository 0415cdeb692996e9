"""HyperFlexis on hand-built states: the latency fit, the token budget, the SLO queue and the
Migrator's decode choice (its scaling policy: tests/core/policies/test_hyperflexis_scaling.py)."""

from __future__ import annotations

from typing import Any

import pytest

from core.dispatch import Dispatcher
from core.latency_model import LatencyModel
from core.policies import build
from core.types import Request, Role
from tests.helpers import add_running, toy_profile

DECODE = dict(
    decode_step_base_s=0.01,
    decode_step_per_seq_s=0.001,
    decode_step_per_kv_token_s=1e-7,
    kv_capacity_tokens=100_000,
    prefill_base_s=0.02,
    prefill_per_token_s=1e-4,
    prefill_per_token2_s=1e-9,
    max_model_len=32_768,
)


def test_the_fit_recovers_the_profile_exactly_without_noise_and_closely_with_it() -> None:
    prof = toy_profile(**DECODE)
    m = LatencyModel.from_profile(prof, noise_sigma=0.0)
    assert (m.a, m.b, m.c) == pytest.approx((0.02, 1e-4, 1e-9), rel=1e-6)
    assert (m.a_d, m.b_d, m.c_d) == pytest.approx((0.01, 1e-7, 0.001), rel=1e-6)
    assert m.prefill_rel_rmse < 1e-9 and m.decode_rel_rmse < 1e-9
    noisy = LatencyModel.from_profile(prof, noise_sigma=0.05, seed=3)
    assert 0.03 < noisy.decode_rel_rmse < 0.08  # the noise shows up as residual, not as bias
    assert noisy.decode_step(50_000, 64) == pytest.approx(prof.step_time(64, 50_000), rel=0.05)
    assert noisy.prefill(2000) == pytest.approx(float(prof.prefill_time(2000)), rel=0.05)


def test_token_budget_is_eq5_and_zero_when_decoding_eats_the_tpot() -> None:
    m = LatencyModel(a=0.02, b=1e-4, c=0.0, a_d=0.0, b_d=0.0, c_d=0.0)
    # the spec's example: (0.7·(1 − 0.05/0.5) − 0.02) / 1e-4 = 6100 tokens
    assert m.token_budget(0.7, 0.5, 0.05) == pytest.approx(6100.0)
    assert m.token_budget(0.7, 0.05, 0.05) == 0.0
    assert m.token_budget(0.01, 0.5, 0.05) == 0.0  # the intercept alone misses the TTFT


def req(rid: int, arrival: float, *, ttft: float, tpot: float, slo: str = "default", prompt: int = 100) -> Request:
    return Request(rid, arrival, prompt, 50, slo_class=slo, ttft_s=ttft, tpot_s=tpot)


def test_the_slo_queue_releases_tightest_tpot_first_then_arrival_and_defers_the_hopeless() -> None:
    q: Any = build("queue", "hyperflexis")
    q.push(req(1, 0.0, ttft=20.0, tpot=1.0, slo="wikisql"), 0.0)
    q.push(req(2, 0.1, ttft=0.7, tpot=0.5, slo="medical"), 0.1)
    q.push(req(3, 0.2, ttft=2.0, tpot=0.9, slo="headline"), 0.2)
    q.push(req(4, 0.3, ttft=0.7, tpot=0.5, slo="medical"), 0.3)
    q.push(req(5, 0.05, ttft=0.5, tpot=0.5, slo="medical"), 0.3)  # tight, but its deadline is 0.55
    assert len(q) == 5 and q.depth_by_class() == {"wikisql": 1, "medical": 3, "headline": 1}
    assert q.remove(4).id == 4 and q.remove(4) is None
    order = [q.pop(0.6).id for _ in range(4)]
    # at t=0.6: 5 (arrived first of the tightest class) is past its deadline → after the feasible ones
    assert order == [2, 3, 1, 5]
    assert q.pop(0.6) is None and len(q) == 0


def hf_cluster(prefill: int, decode: int) -> Dispatcher:
    d = Dispatcher(toy_profile(**DECODE), "hyperflexis", {"fit_noise": 0.0})
    for k in range(prefill):
        d.add_instance(f"p{k}", Role.PREFILL)
    for k in range(decode):
        d.add_instance(f"d{k}", Role.DECODE)
    return d


def hyperflexis_cluster() -> Any:
    d = hf_cluster(1, 4)
    t = d.view.table
    # d0: 3 light requests, one of them with a tight TPOT (0.015 s): adding one more breaks it
    for k in range(3):
        add_running(d, f"a{k}", "d0", prompt=1000, generated=0, rate=10, now=0)
    t.tpot_slo[t.row["a0"]] = 0.015
    # d1: two requests fill its KV
    for k in range(2):
        add_running(d, f"b{k}", "d1", prompt=49_950, generated=0, rate=10, now=0)
    # d2: 10 requests of 1000 tokens; d3: 12 of them
    for k in range(10):
        add_running(d, f"c{k}", "d2", prompt=1000, generated=0, rate=10, now=0)
    for k in range(12):
        add_running(d, f"e{k}", "d3", prompt=1000, generated=0, rate=10, now=0)
    return d


def test_the_migrator_takes_the_smallest_predicted_step_that_keeps_every_tpot_and_fits() -> None:
    d = hyperflexis_cluster()
    policy = d.routing
    r = req(99, 0.0, ttft=2.0, tpot=0.1)
    steps, ok = policy.decode_steps(r, d.view)
    idx = [d.index_of(f"d{k}") for k in range(4)]
    # E_d(B+1, K+100) = 0.01 + 0.001·(B+1) + 1e-7·(K+100)
    assert steps[idx] == pytest.approx([0.01431, 0.01 + 0.003 + 1e-7 * 100_000, 0.02201, 0.02421])
    # d0 breaks its tight neighbour (0.01431 > 0.9·0.015); d1 has no KV room
    assert list(ok[idx]) == [False, False, True, True]
    assert policy.choose_decode(r, d.view) == idx[2]
    # least outstanding requests would have put it on d1, whose KV is full
    assert build("routing", "least_load").choose_decode(r, d.view) == idx[1]
    # a request nobody can serve within its TPOT still lands somewhere: the smallest step
    assert policy.choose_decode(req(100, 0.0, ttft=2.0, tpot=0.001), d.view) == idx[0]


def test_routing_binds_late_and_reports_the_ttft_admission_test() -> None:
    d = hf_cluster(2, 1)
    d.view.prefill_free_at[d.index_of("p0")] = 3.0  # p0 is busy for 3 s
    now = 0.0
    d.view.now = now
    policy = d.routing
    a = policy.assess(req(1, now, ttft=0.7, tpot=0.5, prompt=1000), d.view)
    assert a.instance == d.index_of("p1") and a.admitted and a.p > 0.99
    d.view.prefill_free_at[d.index_of("p1")] = 0.65  # both busy: its TTFT cannot be met
    late = policy.assess(req(2, now, ttft=0.7, tpot=0.5, prompt=1000), d.view)
    assert late.instance == d.index_of("p1") and not late.admitted and late.t_rem_s < 0
    assignment = d.route(req(3, now, ttft=0.7, tpot=0.5), now)
    assert assignment.decode is None and policy.bind_at == "prefill_end"
    assert d.bind_late(3, 0.1) == "d0"


def test_params_are_validated() -> None:
    with pytest.raises(Exception, match="hysteresis"):
        build("scaling", "hyperflexis", {"util_low": 0.9, "util_high": 0.85})
    with pytest.raises(Exception, match="theta"):
        build("routing", "hyperflexis", {"theta": 1.5})


def test_the_central_queue_holds_arrivals_while_prefill_is_backlogged_and_releases_tightest_first() -> None:
    d = Dispatcher(toy_profile(), "hyperflexis", queue=("hyperflexis", {"max_prefill_backlog_s": 0.5}))
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    loose, tight = dict(ttft=20.0, tpot=1.0), dict(ttft=5.0, tpot=0.1)
    first = req(1, 0.0, **loose)
    assert d.admit(first, 0.0).value == "route"
    d.route(first, 0.0)  # the toy profile prefills in 1 s, in a 0.1 s engine step: p0 is busy until t=1.1
    assert [d.admit(r, r.arrival).value for r in (req(2, 0.1, **loose), req(3, 0.2, **tight))] == ["queued", "queued"]
    assert d.release(0.4) == []  # 0.7 s of prefill left ≥ 0.5
    assert [r.id for r in d.release(0.7)] == [3]  # under the limit: one request, the tightest first
    assert d.queue_depth() == 1


def pm(window: int = 200) -> Any:
    from core.policies.priority_slo import PrioritySLO, PrioritySLOParams

    return PrioritySLO(PrioritySLOParams(midpoints=[(1.0, 0.1), (4.0, 0.4)], spread=0.25, window=window))


def fill(m: Any, p1_ttft: float = 3.0, p1_queue: float = 0.5) -> None:
    for _ in range(10):
        m.observe(0, 0.9, 0.09, 0.1)
    for k in range(10):  # p1: TTFT p1_ttft + 0.1k, TPOT 0.3 + 0.01k
        m.observe(1, p1_ttft + 0.1 * k, 0.3 + 0.01 * k, p1_queue)


def test_priority_to_slo_reads_the_priority_quantile_of_recent_completions() -> None:
    m = pm()
    assert m.assign(1, higher_pending=True) == (4.0, 0.4)  # cold start (< 10·N completions): the midpoint
    fill(m)
    # idx = C0 + ⌊(1+1)/(2+1)·C1⌋ = 10 + 6 = 16 → the 7th p1 entry: TTFT 3.6, TPOT 0.36; in range [3, 5] × [0.3, 0.5]
    assert m.assign(1, higher_pending=True) == pytest.approx((3.6, 0.36))
    # p0: idx = ⌊1/3·10⌋ = 3 → TTFT 0.9 (its queue 0.1 is also p0's last), TPOT 0.09, in [0.75, 1.25] × [0.075, 0.125]
    assert m.assign(0, higher_pending=False) == pytest.approx((0.9, 0.09))


def test_priority_to_slo_corrects_for_a_queue_spike_and_relaxes_its_floor_only_when_alone() -> None:
    m = pm()
    fill(m, p1_ttft=1.0)
    m.observe(0, 0.9, 0.09, 0.1)  # 21 entries: p1's index is now 11 + 6 = 17 → TTFT 1.6 − 0 correction
    m.last_queue[1] = 0.2  # p1's latest completion queued 0.3 s less than the reference did
    ttft, _ = m.assign(1, higher_pending=False)
    assert ttft == pytest.approx(1.6 - 0.3)  # below p1's own floor (3.0) but above p0's (0.75): kept
    assert m.assign(1, higher_pending=True)[0] == pytest.approx(3.0)  # a higher priority waits: p1's floor


def test_priority_to_slo_forgets_completions_past_its_window() -> None:
    m = pm(window=15)
    fill(m)
    assert sum(m.counts) == 15 and m.counts == [5, 10]  # the five oldest (p0) left


def test_hyperflexis_gives_priority_only_requests_targets_and_learns_from_completions() -> None:
    d = Dispatcher(toy_profile(**DECODE), "hyperflexis", {"priority_slo": {"midpoints": [[1.0, 0.1], [4.0, 0.4]]}})
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    named = Request("named", 0.0, 100, 10, slo_class="default", ttft_s=9.0, tpot_s=0.9)
    d.set_targets(named)
    assert (named.ttft_s, named.tpot_s) == (9.0, 0.9)  # the client's own targets win
    r = Request("r", 0.0, 100, 10, priority=1)
    d.admit(r, 0.0)
    d.route(r, 0.0)
    assert (r.ttft_s, r.tpot_s) == (4.0, 0.4)
    d.on_prefill_end("r", 0.5)
    d.on_decode_start("r", 0.5)
    d.on_finish("r", 1.4, 10, first_token_at=0.5)
    assert d.routing.mapper.counts == [0, 1] and d.routing.mapper.last_queue[1] == 0.0

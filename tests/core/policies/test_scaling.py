"""Scaling policies (core/policies/scaling.py) on hand-built signals: thresholds, cooldown, hysteresis, scale-in,
limits, and admission's refusals as demand for the pool they were refused for."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from core.periodic import ScalingSignals
from core.policies import build
from core.types import InstancePhase, Role
from tests.helpers import cluster

VIEW: Any = None  # threshold reads only the signals


def signals(
    *,
    kv: list[float] | None = None,
    in_flight: list[int] | None = None,
    queue: int = 0,
    starting: int = 0,
    draining: int = 0,
    max_num_seqs: int = 100,
    now: float = 0.0,
    prefill: int = 1,
    backlog: float = 0.0,
    refused: dict[Role, float] | None = None,
) -> ScalingSignals:
    n = len(kv or in_flight or [0, 0])
    kv_a = np.asarray(kv if kv is not None else [0.0] * n, dtype=float)
    fl = np.asarray(in_flight if in_flight is not None else [0] * n, dtype=np.int64)
    phases = {InstancePhase.ACTIVE: n}
    if starting:
        phases[InstancePhase.STARTING] = starting
    if draining:
        phases[InstancePhase.DRAINING] = draining
    return ScalingSignals(
        now=now,
        phases={Role.DECODE: phases, Role.PREFILL: {InstancePhase.ACTIVE: prefill}},
        decode_ids=[f"d{k}" for k in range(n)],
        decode_in_flight=fl,
        decode_util=fl / max_num_seqs,
        decode_kv=kv_a,
        prefill_ids=[f"p{k}" for k in range(prefill)],
        prefill_backlog_s=np.full(prefill, backlog),
        queue_len=queue,
        oldest_wait_s=0.0,
        arrival_rate=0.0,
        window_s=5.0,
        refused_rate=refused or {},
    )


def threshold(**params: Any) -> Any:
    return build("scaling", "threshold", {"cooldown_s": 0, "scale_in_after_s": 30, **params})


def test_scales_out_at_kv_080_not_before() -> None:
    p = threshold()
    assert p.propose(signals(kv=[0.79, 0.79]), VIEW, 0.0) == []
    [a] = p.propose(signals(kv=[0.78, 0.82]), VIEW, 5.0)
    assert (a.action, a.role, a.instance_id) == ("add", Role.DECODE, None)
    assert "KV mean 0.8 ≥ 0.8" in a.reason and "2 active" in a.reason


def test_scales_out_at_queue_5_not_before() -> None:
    p = threshold()
    assert p.propose(signals(queue=4), VIEW, 0.0) == []
    [a] = p.propose(signals(queue=5), VIEW, 5.0)
    assert a.action == "add" and "queue 5 ≥ 5" in a.reason


def test_scales_out_on_utilisation() -> None:
    p = threshold(util_high=0.5)
    assert p.propose(signals(in_flight=[40, 50]), VIEW, 0.0) == []
    [a] = p.propose(signals(in_flight=[50, 50]), VIEW, 5.0)
    assert "utilisation 0.5 ≥ 0.5" in a.reason


def test_cooldown_spaces_actions() -> None:
    p = threshold(cooldown_s=60)
    hot = signals(queue=10)
    assert len(p.propose(hot, VIEW, 0.0)) == 1
    assert p.propose(hot, VIEW, 30.0) == []
    assert p.propose(hot, VIEW, 59.9) == []
    assert len(p.propose(hot, VIEW, 60.0)) == 1


def test_no_action_while_an_instance_starts_or_drains_and_never_above_max() -> None:
    p = threshold(max_instances=3)
    assert p.propose(signals(queue=10, starting=1), VIEW, 0.0) == []
    assert p.propose(signals(queue=10, draining=1), VIEW, 0.0) == []
    assert p.propose(signals(queue=10, kv=[0.9, 0.9, 0.9]), VIEW, 0.0) == []
    assert len(p.propose(signals(queue=10, kv=[0.9, 0.9]), VIEW, 0.0)) == 1


def test_scale_in_only_after_sustained_low_and_picks_least_loaded() -> None:
    p = threshold()
    low = signals(in_flight=[5, 1, 3])
    assert p.propose(low, VIEW, 0.0) == []  # low from 0
    assert p.propose(low, VIEW, 29.0) == []
    [a] = p.propose(low, VIEW, 30.0)
    assert (a.action, a.instance_id, a.role) == ("remove", "d1", Role.DECODE)
    assert "low for 30 s ≥ 30 s" in a.reason and "d1 is the least loaded (1)" in a.reason


def test_hysteresis_band_restarts_the_low_timer() -> None:
    p = threshold(util_low=0.2, util_high=0.9)
    low, middle = signals(in_flight=[10, 10]), signals(in_flight=[50, 50])
    assert p.propose(low, VIEW, 0.0) == []
    assert p.propose(middle, VIEW, 20.0) == []  # between the thresholds: neither out nor in
    assert p.propose(low, VIEW, 25.0) == []
    assert p.propose(low, VIEW, 50.0) == []  # low only since 25
    assert len(p.propose(low, VIEW, 55.0)) == 1


def test_scale_in_respects_min_instances() -> None:
    p = threshold(min_instances=2, scale_in_after_s=0)
    assert p.propose(signals(in_flight=[0, 0]), VIEW, 0.0) == []
    [a] = p.propose(signals(in_flight=[0, 0, 0]), VIEW, 1.0)
    assert a.instance_id == "d2"  # ties: the newest goes


def test_prefill_pool_scales_on_backlog() -> None:
    p = threshold(role="prefill", backlog_high_s=2.0)
    s = signals()
    s.prefill_backlog_s = np.array([1.9])
    assert p.propose(s, VIEW, 0.0) == []
    s.prefill_backlog_s = np.array([2.5])
    [a] = p.propose(s, VIEW, 5.0)
    assert a.role == Role.PREFILL and "prefill backlog 2.50 s ≥ 2 s" in a.reason


def test_bad_threshold_params_are_rejected() -> None:
    from core.errors import PolicyError

    with pytest.raises(PolicyError, match="hysteresis"):
        build("scaling", "threshold", {"util_low": 0.9, "util_high": 0.5})


def test_static_never_acts_and_schedules_nothing() -> None:
    p = build("scaling", "static")
    assert p.acts is False
    assert p.propose(signals(queue=100, kv=[1.0, 1.0]), VIEW, 0.0) == []
    d = cluster()
    assert d.next_periodic_at() == float("inf")
    assert not d.periodic(1e9)


def _slo(
    role: Role, attainment: float | None, samples: int = 20, p90: float = 0.3, target: float = 0.1
) -> dict[Role, Any]:
    from core.periodic import RoleSlo

    return {role: RoleSlo("tpot" if role == Role.DECODE else "ttft", samples, attainment, p90, target)}


def test_a_missed_tpot_slo_scales_the_decode_pool_out_even_at_low_utilisation() -> None:
    p = threshold()
    s = signals(in_flight=[20, 20])  # KV, utilisation and queue all low
    s.slo = _slo(Role.DECODE, 0.95)
    assert p.propose(s, VIEW, 0.0) == []  # met: nothing (and the pool is low)
    s.slo = _slo(Role.DECODE, 0.4)
    [a] = p.propose(s, VIEW, 5.0)
    assert (a.action, a.role) == ("add", Role.DECODE)
    assert "TPOT attainment 40% < 90% over 20 requests (p90 300 ms, target 100 ms)" in a.reason


def test_the_slo_signal_needs_enough_samples_is_per_role_and_can_be_turned_off() -> None:
    s = signals(in_flight=[20, 20])
    s.slo = _slo(Role.DECODE, 0.0, samples=3)
    assert threshold().propose(s, VIEW, 0.0) == []  # too few requests in the window
    s.slo = _slo(Role.PREFILL, 0.0)  # a TTFT miss is the prefill pool's, not decode's
    assert threshold().propose(s, VIEW, 0.0) == []
    [a] = threshold(role="prefill").propose(s, VIEW, 0.0)
    assert a.role == Role.PREFILL and "TTFT attainment 0%" in a.reason
    s.slo = _slo(Role.DECODE, 0.0)
    assert threshold(slo_attainment=0).propose(s, VIEW, 0.0) == []


def test_a_missed_slo_keeps_the_pool_from_scaling_in_then_it_drains_once_met() -> None:
    p = threshold(scale_in_after_s=10, cooldown_s=20)
    s = signals(in_flight=[1, 1])
    s.slo = _slo(Role.DECODE, 0.5)
    [a] = p.propose(s, VIEW, 0.0)
    assert a.action == "add"
    s3 = signals(in_flight=[1, 1, 0])
    s3.slo = _slo(Role.DECODE, 1.0)
    assert p.propose(s3, VIEW, 5.0) == []  # low from 5, cooldown until 20
    [b] = p.propose(s3, VIEW, 20.0)
    assert (b.action, b.instance_id) == ("remove", "d2")


def test_the_dispatcher_windows_ttft_and_tpot_per_role() -> None:
    from core.periodic import SloWindow

    w = SloWindow(window_s=30.0)
    for k in range(10):
        w.add(float(k), 0.5 if k < 8 else 3.0, 2.0, 0.05 if k < 3 else 0.2, 0.1)
    w.add(9.0, None, 2.0, None, 0.1)  # a whole reply's TPOT is unknown: left out
    slo = w.role_slo(10.0)
    assert (slo[Role.PREFILL].metric, slo[Role.PREFILL].samples, slo[Role.PREFILL].attainment) == ("ttft", 10, 0.8)
    assert (slo[Role.DECODE].samples, slo[Role.DECODE].attainment) == (10, 0.3)
    assert slo[Role.DECODE].p90_s == pytest.approx(0.2)
    assert w.role_slo(45.0)[Role.DECODE].samples == 0 and w.role_slo(45.0)[Role.DECODE].attainment is None


def test_the_dispatchers_scaling_signals_carry_the_windowed_slo_of_each_role() -> None:
    from core.dispatch import Dispatcher
    from core.perf import get_profile
    from core.types import Request

    d = Dispatcher(get_profile("h20-qwen3-32b"), "round_robin")
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    for k in range(10):  # TTFT 0.5 s (met); TPOT 0.05 s for three, 0.2 s for seven (missed)
        r = Request(k, float(k), 64, 11)
        d.route(r, float(k))
        d.on_prefill_end(k, k + 0.4, 0.4)
        d.on_decode_start(k, k + 0.45)
        d.on_finish(k, k + 0.5 + 10 * (0.05 if k < 3 else 0.2), 11, k + 0.5)
    s = d.scaling_signals(15.0)
    assert (s.slo_of(Role.PREFILL).samples, s.slo_of(Role.PREFILL).attainment) == (10, 1.0)
    assert (s.slo_of(Role.DECODE).samples, s.slo_of(Role.DECODE).attainment) == (10, 0.3)
    [a] = build("scaling", "threshold", {"cooldown_s": 0}).propose(s, VIEW, 15.0)
    assert a.action == "add" and "TPOT attainment 30%" in a.reason


def test_the_dispatcher_counts_refusals_by_the_pool_that_was_short() -> None:
    from core.admission import SloAdmission
    from core.dispatch import Dispatcher
    from core.perf import get_profile
    from core.types import Admission, Request

    d = Dispatcher(get_profile("h20-qwen3-32b"), "round_robin")
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    d.use_slo_admission(SloAdmission(evidence_hold_s=0.0))  # refuse on the prior at once
    d.start_periodic(0.0)
    for k in range(40):  # one prefill instance cannot start 40 prompts of 512 tokens within 2 s
        if d.admit(Request(k, 0.0, 512, 100), 0.0) == Admission.ROUTE:
            d.route(Request(k, 0.0, 512, 100), 0.0)
    s = d.scaling_signals(2.0)
    assert s.refused_rate[Role.PREFILL] > 10 and s.refused_rate[Role.DECODE] == 0
    assert d.scaling_signals(4.0).refused_rate[Role.PREFILL] == 0  # a new window


# --- admission's refusals are demand for the pool they were refused for ----------------------------


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_prefill_backlog_refusals_add_a_prefill_instance_whichever_pool_the_policy_sizes(role: str) -> None:
    s = signals(in_flight=[1], refused={Role.PREFILL: 3.0, Role.DECODE: 0.0})
    [a] = threshold(role=role).propose(s, VIEW, 0.0)
    assert (a.action, a.role, a.instance_id) == ("add", Role.PREFILL, None)
    assert "admission refused 3.0/s ≥ 0.5/s for want of prefill capacity" in a.reason and "1 active" in a.reason
    below = signals(in_flight=[1], refused={Role.PREFILL: 0.4})
    assert threshold(role=role).propose(below, VIEW, 0.0) == []  # under refused_high
    assert threshold(role=role, refused_high=0).propose(s, VIEW, 0.0) == []  # the signal turned off


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_decode_slot_or_kv_refusals_add_a_decode_instance_at_low_utilisation(role: str) -> None:
    # admission lets in only what fits its decode slots, so the engine itself never looks loaded
    s = signals(in_flight=[20], kv=[0.2], refused={Role.DECODE: 2.0})
    [a] = threshold(role=role).propose(s, VIEW, 0.0)
    assert (a.action, a.role) == ("add", Role.DECODE)
    assert "admission refused 2.0/s ≥ 0.5/s for want of decode capacity" in a.reason
    assert "utilisation 0.20" in a.reason and "refused 2.00/s" in a.reason


def test_refusal_driven_adds_stop_at_max_instances_and_wait_for_the_previous_one() -> None:
    p = threshold(max_instances=2)
    refused = {Role.PREFILL: 5.0}
    assert p.propose(signals(in_flight=[1], prefill=2, refused=refused), VIEW, 0.0) == []  # the prefill pool is full
    assert p.propose(signals(in_flight=[1], refused=refused, starting=1), VIEW, 0.0) == []  # one is starting
    [a] = p.propose(signals(in_flight=[1], prefill=1, refused=refused), VIEW, 0.0)
    assert (a.action, a.role) == ("add", Role.PREFILL)


def test_when_both_pools_are_saturated_the_one_refused_more_grows_first() -> None:
    both = {Role.PREFILL: 1.0, Role.DECODE: 4.0}
    [a] = threshold(role="prefill").propose(signals(in_flight=[1], refused=both), VIEW, 0.0)
    assert a.role == Role.DECODE
    # the own pool saturated by its KV, admission refusing for want of prefill: prefill first
    s = signals(kv=[0.9], refused={Role.PREFILL: 2.0})
    [b] = threshold().propose(s, VIEW, 0.0)
    assert b.role == Role.PREFILL
    [c] = threshold().propose(signals(kv=[0.9]), VIEW, 0.0)
    assert c.role == Role.DECODE and "KV mean 0.9 ≥ 0.8" in c.reason


def test_the_pool_refusals_grew_drains_back_to_its_size_once_nothing_is_refused() -> None:
    p = threshold(scale_in_after_s=30, cooldown_s=10)  # sizes decode; prefill grows only by refusals

    def prefill_pool(n: int, backlog: float, refused: float = 0.0) -> ScalingSignals:
        return signals(in_flight=[1], prefill=n, backlog=backlog, refused={Role.PREFILL: refused})

    assert p.propose(prefill_pool(1, 1.0, 3.0), VIEW, 0.0)[0].role == Role.PREFILL  # p1
    assert p.propose(prefill_pool(2, 0.5, 1.0), VIEW, 10.0)[0].role == Role.PREFILL  # p2
    assert p.propose(prefill_pool(3, 0.05, 0.2), VIEW, 20.0) == []  # still refusing a little: not low
    assert p.propose(prefill_pool(3, 0.05), VIEW, 25.0) == []  # low from 25
    assert p.propose(prefill_pool(3, 0.05), VIEW, 54.0) == []
    [a] = p.propose(prefill_pool(3, 0.05), VIEW, 55.0)
    assert (a.action, a.role, a.instance_id) == ("remove", Role.PREFILL, "p2")
    assert "prefill low for 30 s ≥ 30 s" in a.reason and "3 active > 1 before admission's refusals" in a.reason
    assert p.propose(prefill_pool(2, 0.05), VIEW, 65.0) == []  # low again from 65
    [b] = p.propose(prefill_pool(2, 0.05), VIEW, 95.0)
    assert (b.action, b.instance_id) == ("remove", "p1")
    assert p.propose(prefill_pool(1, 0.0), VIEW, 200.0) == []  # back to the size it had: nothing more


def test_the_other_pool_is_never_shrunk_below_what_the_operator_gave_it() -> None:
    p = threshold(scale_in_after_s=0)
    assert p.propose(signals(in_flight=[1], prefill=3), VIEW, 0.0) == []  # low, but this policy added none


def test_the_own_pool_is_not_low_while_anything_is_refused_for_want_of_it() -> None:
    s = signals(prefill=2, refused={Role.PREFILL: 0.1})
    assert threshold(role="prefill", scale_in_after_s=0).propose(s, VIEW, 0.0) == []
    [a] = threshold(role="prefill", scale_in_after_s=0).propose(signals(prefill=2), VIEW, 0.0)
    assert (a.action, a.role, a.instance_id) == ("remove", Role.PREFILL, "p1")


def test_decode_slot_refusals_queue_full_sheds_and_expiries_count_as_decode_demand() -> None:
    from core.admission import SloAdmission
    from core.dispatch import Dispatcher
    from core.types import Admission, Request
    from tests.helpers import toy_profile

    d = Dispatcher(
        toy_profile(prefill_base_s=0.01, decode_step_base_s=0.01),
        "round_robin",
        queue=("fcfs", {"ttl_s": 0.5, "max_queued": 3}),
    )
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    gate = d.use_slo_admission(SloAdmission(decode_slots=2, extra_wait_s=30))  # a long wait bound: held, not refused
    d.start_periodic(0.0)
    decisions = []
    for k in range(8):
        r = Request(k, 0.0, 16, 10)
        decisions.append(d.admit(r, 0.0))
        if decisions[-1] == Admission.ROUTE:
            d.route(r, 0.0)
    # two slots, three held, three shed for a full queue while no decode slot is free
    assert [x.name for x in decisions] == ["ROUTE"] * 2 + ["QUEUED"] * 3 + ["SHED"] * 3
    assert gate.refusals_by_cause()["queue_full"]["count"] == 3
    assert [r.id for r in d.expire(0.6)] == [2, 3, 4]  # past ttl_s
    s = d.scaling_signals(2.0)
    assert s.refused_rate == {Role.PREFILL: 0.0, Role.DECODE: 6 / 2.0}
    [a] = build("scaling", "threshold", {"role": "prefill"}).propose(s, VIEW, 2.0)
    assert (a.action, a.role) == ("add", Role.DECODE) and "admission refused 3.0/s" in a.reason

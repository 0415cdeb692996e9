"""HyperFlexis scaling (core/policies/hyperflexis_scaling.py) on hand-built signals: flips, adds and drains,
and admission's refusals as demand for the pool they were refused for."""

from __future__ import annotations

from typing import Any

import numpy as np

from core.periodic import ScalingSignals
from core.policies import build
from core.types import InstancePhase, Role


def sig(
    *,
    p_backlog: list[float],
    d_util: list[float],
    waits: list[float] | None = None,
    arrivals: float = 0.0,
    done: float = 0.0,
    starting: int = 0,
    now: float = 0.0,
    refused: dict[Role, float] | None = None,
) -> ScalingSignals:
    nd, npf = len(d_util), len(p_backlog)
    phases = {Role.PREFILL: {InstancePhase.ACTIVE: npf}, Role.DECODE: {InstancePhase.ACTIVE: nd}}
    if starting:
        phases[Role.DECODE][InstancePhase.STARTING] = starting
    return ScalingSignals(
        now=now,
        phases=phases,
        decode_ids=[f"d{k}" for k in range(nd)],
        decode_in_flight=np.zeros(nd),
        decode_util=np.asarray(d_util, dtype=float),
        decode_kv=np.zeros(nd),
        prefill_ids=[f"p{k}" for k in range(npf)],
        prefill_backlog_s=np.asarray(p_backlog, dtype=float),
        queue_len=len(waits or []),
        oldest_wait_s=0.0,
        arrival_rate=arrivals,
        window_s=1.0,
        completion_rate=done,
        queued_wait_ratios=np.asarray(waits or [], dtype=float),
        refused_rate=refused or {},
    )


def test_scaling_flips_a_low_pool_to_a_hot_one_before_adding_and_explains_why() -> None:
    p: Any = build("scaling", "hyperflexis", {"no_scale_in_after_out_s": 0})
    # prefill hot by waits (p90 of wait/TTFT 0.88), decode low: one of the decode instances flips
    [a] = p.propose(sig(p_backlog=[0.5, 0.5], d_util=[0.1, 0.05], waits=[0.2, 0.9, 0.8]), None, 1.0)
    assert (a.action, a.role, a.instance_id) == ("flip", Role.PREFILL, "d1")
    assert "p90 wait/TTFT 0.88 > 0.5" in a.reason and "d1" in a.reason
    # decode hot, prefill busy but not hot: nothing to flip, so an instance is added
    [b] = p.propose(sig(p_backlog=[0.5, 0.5], d_util=[0.95, 0.9]), None, 2.0)
    assert (b.action, b.role) == ("add", Role.DECODE) and "decode utilisation 0.93 > 0.85" in b.reason
    # a starting instance counts as capacity: no second add for the same surge
    assert p.propose(sig(p_backlog=[0.5, 0.5], d_util=[0.95, 0.9], starting=1), None, 3.0) == []


def test_scaling_adds_on_input_outpacing_processing_and_respects_the_cap() -> None:
    p: Any = build("scaling", "hyperflexis", {"max_instances": 5, "flips": False, "rate_window_s": 5.0})
    # completions trail arrivals at the start: the ratio counts only once the averages span 5 s
    assert p.propose(sig(p_backlog=[0.2, 0.2], d_util=[0.5, 0.5], arrivals=12.0, done=0.0, now=0.0), None, 0.0) == []
    assert p.propose(sig(p_backlog=[0.2, 0.2], d_util=[0.5, 0.5], arrivals=12.0, done=10.0, now=4.0), None, 4.0) == []
    [a] = p.propose(sig(p_backlog=[0.2, 0.2], d_util=[0.5, 0.5], arrivals=12.0, done=10.0, now=6.0), None, 6.0)
    assert (a.action, a.role) == ("add", Role.PREFILL) and "input/processing" in a.reason
    capped: Any = build("scaling", "hyperflexis", {"max_instances": 4, "flips": False})
    assert capped.propose(sig(p_backlog=[0.9, 0.9], d_util=[0.95, 0.95]), None, 1.0) == []  # 4 active already


def test_scale_in_needs_sustained_low_and_waits_a_cold_start_after_a_scale_out() -> None:
    p: Any = build("scaling", "hyperflexis", {"low_ticks": 3, "no_scale_in_after_out_s": 10})
    assert p.propose(sig(p_backlog=[0.9], d_util=[0.95]), None, 0.0)[0].action == "add"  # scale-out at t=0
    quiet = dict(p_backlog=[0.0], d_util=[0.1, 0.0, 0.2])
    assert [p.propose(sig(**quiet), None, t) for t in (1.0, 2.0, 3.0, 4.0)] == [[], [], [], []]  # too soon after
    [a] = p.propose(sig(**quiet), None, 11.0)
    assert (a.action, a.role, a.instance_id) == ("remove", Role.DECODE, "d1") and "low for" in a.reason
    # the pool low count restarts after an action; a busy tick restarts it too
    assert p.propose(sig(**quiet), None, 12.0) == []
    assert p.propose(sig(p_backlog=[0.0], d_util=[0.5, 0.5, 0.5]), None, 13.0) == []
    assert p.propose(sig(**quiet), None, 14.0) == [] and p.propose(sig(**quiet), None, 15.0) == []
    assert p.propose(sig(**quiet), None, 16.0)[0].action == "remove"


# --- admission's refusals are demand for the pool they were refused for ----------------------------


def test_prefill_backlog_refusals_make_the_prefill_pool_hot_though_its_utilisation_is_low() -> None:
    p: Any = build("scaling", "hyperflexis", {})
    refused = {Role.PREFILL: 3.0, Role.DECODE: 0.0}
    [a] = p.propose(sig(p_backlog=[0.2], d_util=[0.5], refused=refused), None, 1.0)  # decode at min_per_role: add
    assert (a.action, a.role) == ("add", Role.PREFILL)
    assert "admission refused 3.0/s ≥ 0.5/s for want of prefill" in a.reason and "2 active < max 8" in a.reason
    # a low decode pool above min_per_role gives one of its instances instead
    fresh: Any = build("scaling", "hyperflexis", {})
    [b] = fresh.propose(sig(p_backlog=[0.2], d_util=[0.1, 0.0], refused=refused), None, 1.0)
    assert (b.action, b.role, b.instance_id) == ("flip", Role.PREFILL, "d1")
    assert build("scaling", "hyperflexis", {"refused_high": 0}).propose(
        sig(p_backlog=[0.2], d_util=[0.5], refused=refused), None, 1.0
    ) == []


def test_decode_slot_or_kv_refusals_add_a_decode_instance_below_its_utilisation_threshold() -> None:
    # admission's decode slots (say 154 of max_num_seqs 256) cap utilisation at 0.6 < util_high 0.85
    p: Any = build("scaling", "hyperflexis", {})
    [a] = p.propose(sig(p_backlog=[0.2], d_util=[0.6], refused={Role.DECODE: 1.2}), None, 1.0)
    assert (a.action, a.role) == ("add", Role.DECODE)
    assert "admission refused 1.2/s ≥ 0.5/s for want of decode" in a.reason


def test_refusal_driven_adds_stop_at_max_instances_and_the_pool_refused_more_goes_first() -> None:
    capped: Any = build("scaling", "hyperflexis", {"max_instances": 3, "flips": False})
    assert capped.propose(sig(p_backlog=[0.2, 0.2], d_util=[0.5], refused={Role.PREFILL: 9.0}), None, 1.0) == []
    p: Any = build("scaling", "hyperflexis", {"flips": False})
    [a] = p.propose(sig(p_backlog=[0.2], d_util=[0.5], refused={Role.PREFILL: 1.0, Role.DECODE: 2.0}), None, 1.0)
    assert a.role == Role.DECODE


def test_a_pool_drains_back_only_once_nothing_is_refused_for_want_of_it() -> None:
    p: Any = build("scaling", "hyperflexis", {"low_ticks": 2, "no_scale_in_after_out_s": 0})
    two_decode = dict(p_backlog=[0.0], d_util=[0.1, 0.0])
    assert p.propose(sig(**two_decode, refused={Role.DECODE: 0.2}), None, 1.0) == []  # refusing a little: not low
    assert p.propose(sig(**two_decode, refused={Role.DECODE: 0.2}), None, 2.0) == []
    assert p.propose(sig(**two_decode), None, 3.0) == []  # low once
    [a] = p.propose(sig(**two_decode), None, 4.0)
    assert (a.action, a.role, a.instance_id) == ("remove", Role.DECODE, "d1")

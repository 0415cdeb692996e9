"""Scaling policies on hand-built signals: thresholds, cooldown, hysteresis, scale-in, limits."""

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
        phases={Role.DECODE: phases, Role.PREFILL: {InstancePhase.ACTIVE: 1}},
        decode_ids=[f"d{k}" for k in range(n)],
        decode_in_flight=fl,
        decode_util=fl / max_num_seqs,
        decode_kv=kv_a,
        prefill_ids=["p0"],
        prefill_backlog_s=np.zeros(1),
        queue_len=queue,
        oldest_wait_s=0.0,
        arrival_rate=0.0,
        window_s=5.0,
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

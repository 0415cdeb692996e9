"""The periodic runner's cadence and the scaling signals the dispatcher computes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from core.periodic import PeriodicRunner
from core.types import InstancePhase, InstanceState, PolicyKind, Request, Role, ScaleAction
from tests.helpers import add_pending, add_running, cluster


class Recorder:
    """A periodic policy stand-in that records when it is called."""

    def __init__(self, period: float, acts: bool = True) -> None:
        self.params = SimpleNamespace(period_s=period)
        self.acts = acts
        self.calls: list[float] = []

    def propose(self, *args: Any) -> list[Any]:
        now = args[-1]
        self.calls.append(now)
        return [ScaleAction("add", Role.DECODE, reason=f"t={now}")] if len(args) == 3 else []


def test_runner_calls_each_kind_at_its_own_period() -> None:
    runner = PeriodicRunner()
    scaling, resched = Recorder(5.0), Recorder(2.0)
    policies: dict[PolicyKind, Any] = {PolicyKind.SCALING: scaling, PolicyKind.RESCHEDULE: resched}
    runner.schedule(PolicyKind.SCALING, scaling, 0.0)
    runner.schedule(PolicyKind.RESCHEDULE, resched, 0.0)
    t = runner.next_at()
    decisions = []
    while t <= 10.0:
        decisions.append(runner.run(t, None, policies, lambda: None))  # type: ignore[arg-type]
        t = runner.next_at()
    assert resched.calls == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert scaling.calls == [5.0, 10.0]
    assert sum(len(d.scale) for d in decisions) == 2


def test_runner_catches_up_without_bursts_and_skips_no_ops() -> None:
    runner = PeriodicRunner()
    p = Recorder(5.0)
    runner.schedule(PolicyKind.SCALING, p, 0.0)
    runner.run(23.0, None, {PolicyKind.SCALING: p}, lambda: None)  # type: ignore[arg-type]
    assert p.calls == [23.0] and runner.next_at() == 28.0
    runner.schedule(PolicyKind.SCALING, Recorder(5.0, acts=False), 23.0)
    assert runner.next_at() == float("inf")


def test_dispatcher_schedules_periodic_policies_from_their_swap() -> None:
    d = cluster(scaling=("threshold", {"period_s": 4}))
    assert d.next_periodic_at() == 4.0
    assert not d.periodic(3.9)
    d.set_policy("scaling", "static", now=10.0)
    assert d.next_periodic_at() == float("inf")
    d.set_policy("scaling", "threshold", {"period_s": 2}, now=100.0)
    assert d.next_periodic_at() == 102.0


def test_scaling_signals_from_the_table_and_observations() -> None:
    d = cluster("round_robin", decode=3, queue=("fcfs", {"max_in_flight_per_instance": 1}))
    d.add_instance("d3", Role.DECODE, phase=InstancePhase.STARTING)
    add_running(d, "a", "d0", prompt=100_000, generated=0, rate=10, now=0)
    add_running(d, "b", "d1", prompt=10, generated=0, rate=10, now=0)
    add_pending(d, "c", "d1", prompt=10, handoff=1.0)
    for k in range(3):
        d.admit(Request(f"q{k}", 1.0, 10, 10), 1.0 + k)  # 3 in flight = 1 × 3: all held
    d.observe_instance(InstanceState("d2", Role.DECODE, kv_usage=0.5, waiting=7))
    s = d.scaling_signals(10.0)
    assert s.decode_ids == ["d0", "d1", "d2"]  # d3 is still starting
    assert s.count(Role.DECODE) == 3 and s.count(Role.DECODE, InstancePhase.STARTING) == 1
    assert s.transitioning()
    assert s.decode_in_flight.tolist() == [1, 2, 0]
    assert s.decode_util == pytest.approx(np.array([1, 2, 0]) / 256)
    # KV: d0 holds 100k prompt + 100 generated (10 s at 10 tok/s) of 1M tokens; d2 observed.
    assert s.decode_kv[0] == pytest.approx(0.1001) and s.decode_kv[2] == 0.5
    assert s.queue_len == 3 and s.oldest_wait_s == 9.0
    assert s.arrival_rate == pytest.approx(3 / 10.0) and s.window_s == 10.0
    assert d.view.waiting_obs[d.index_of("d2")] == 7
    assert d.scaling_signals(20.0).arrival_rate == 0.0  # the window restarts at each call


def test_a_live_clock_re_anchors_the_cadence() -> None:
    d = cluster(scaling=("threshold", {"period_s": 5}))
    d.start_periodic(1000.0)
    assert d.next_periodic_at() == 1005.0
    assert d.scaling_signals(1010.0).window_s == 10.0

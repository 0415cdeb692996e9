"""Queue policies and the dispatcher's admission: order, fairness, holding, shedding, expiry, swap."""

from __future__ import annotations

from core.policies import build
from core.types import Admission, Request
from tests.helpers import cluster


def req(rid: str, priority: int = 0, tenant: str = "", slo: str = "default") -> Request:
    return Request(rid, 0.0, 10, 10, slo_class=slo, priority=priority, tenant=tenant)


def drain(q) -> list[str]:
    out = []
    while (r := q.pop(0.0)) is not None:
        out.append(r.id)
    return out


def test_fcfs_releases_in_arrival_order_and_counts_by_slo_class() -> None:
    q = build("queue", "fcfs")
    for rid, slo in (("a", "x"), ("b", "y"), ("c", "x")):
        q.push(req(rid, slo=slo), 0.0)
    assert q.depth_by_class() == {"x": 2, "y": 1}
    assert [r.id for r in q.items()] == ["a", "b", "c"]
    assert q.remove("b").id == "b" and q.remove("b") is None
    assert len(q) == 2
    assert drain(q) == ["a", "c"]


def test_priority_serves_lower_values_first() -> None:
    q = build("queue", "priority")
    for rid, p in (("low", 5), ("urgent", -1), ("mid", 2), ("urgent2", -1)):
        q.push(req(rid, priority=p), 0.0)
    assert q.depth_by_class() == {"-1": 2, "2": 1, "5": 1}
    assert [r.id for r in q.items()] == ["urgent", "urgent2", "mid", "low"]
    assert drain(q) == ["urgent", "urgent2", "mid", "low"]


def test_priority_round_robins_tenants_inside_a_band() -> None:
    q = build("queue", "priority")
    for k in range(4):
        q.push(req(f"a{k}", tenant="a"), 0.0)  # tenant a bursts first
    q.push(req("b0", tenant="b"), 0.0)
    q.push(req("b1", tenant="b"), 0.0)
    q.push(req("c0", tenant="c"), 0.0)
    q.push(req("hi", priority=-1, tenant="a"), 0.0)
    expected = ["hi", "a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert [r.id for r in q.items()] == expected  # items() is the release order, without releasing
    assert q.remove("b1") is not None
    expected.remove("b1")
    assert drain(q) == expected


def test_admission_holds_when_saturated_and_releases_as_capacity_frees() -> None:
    d = cluster("round_robin", decode=2, queue=("fcfs", {"max_in_flight_per_instance": 1}))
    assert d.admit(req("r0"), 0.0) is Admission.ROUTE
    d.route(req("r0"), 0.0)
    assert d.admit(req("r1"), 0.0) is Admission.ROUTE
    d.route(req("r1"), 0.0)
    assert d.admit(req("r2"), 0.1) is Admission.QUEUED  # 2 in flight = 1 × 2 decode instances
    assert d.admit(req("r3"), 0.2) is Admission.QUEUED
    assert d.queue_depth() == 2 and d.release(0.3) == []
    d.on_finish("r0", 1.0, 10)
    assert [r.id for r in d.release(1.0)] == ["r2"]
    assert d.queue_depth() == 1


def test_nothing_jumps_the_queue_while_requests_are_held() -> None:
    d = cluster("round_robin", decode=1, queue=("fcfs", {"max_in_flight_per_instance": 1}))
    d.route(req("r0"), 0.0)
    assert d.admit(req("r1"), 0.0) is Admission.QUEUED
    d.on_finish("r0", 1.0, 10)
    # Capacity is free, but r1 is held: a new arrival queues behind it.
    assert d.admit(req("r2"), 1.0) is Admission.QUEUED
    assert [r.id for r in d.release(1.0)] == ["r1"]


def test_arrivals_beyond_max_queued_are_shed() -> None:
    d = cluster("round_robin", decode=1, queue=("fcfs", {"max_in_flight_per_instance": 1, "max_queued": 2}))
    d.route(req("r0"), 0.0)
    verdicts = [d.admit(req(f"r{k}"), 0.0) for k in (1, 2, 3)]
    assert verdicts == [Admission.QUEUED, Admission.QUEUED, Admission.SHED]
    assert d.arrivals_total == 3


def test_held_requests_expire_after_ttl_and_can_be_cancelled() -> None:
    d = cluster("round_robin", decode=1, queue=("fcfs", {"max_in_flight_per_instance": 1, "ttl_s": 10}))
    d.route(req("r0"), 0.0)
    d.admit(req("a"), 1.0)
    d.admit(req("b"), 2.0)
    d.admit(req("c"), 3.0)
    assert d.next_expiry_at() == 11.0
    assert d.expire(10.9) == []
    assert d.cancel("b") is True and d.cancel("b") is False
    assert [r.id for r in d.expire(13.0)] == ["a", "c"]
    assert d.queue_depth() == 0 and d.next_expiry_at() == float("inf")


def test_swapping_the_queue_policy_hands_over_held_requests() -> None:
    d = cluster("round_robin", decode=1, queue=("priority", {"max_in_flight_per_instance": 1, "ttl_s": 10}))
    d.route(req("r0"), 0.0)
    for rid, p, t in (("x", 3, 1.0), ("y", 1, 2.0), ("z", 2, 3.0)):
        d.admit(req(rid, priority=p), t)
    old = d.queue
    closed = []
    old.close = lambda: closed.append(True)  # type: ignore[method-assign]
    d.set_policy("queue", "fcfs", {"max_in_flight_per_instance": 1, "ttl_s": 10}, now=4.0)
    assert closed == [True]
    # The new policy got them in the old release order; waiting times are kept (x expires at 11).
    assert [r.id for r in d.queue.items()] == ["y", "z", "x"]
    assert [r.id for r in d.expire(11.5)] == ["x"]
    d.on_finish("r0", 12.0, 10)
    assert [r.id for r in d.release(12.0)] == ["y"]


def test_the_dispatcher_reports_every_completion_to_the_queue_policy_and_tail_aware_sets_the_engine_priority() -> None:
    from core.dispatch import Dispatcher
    from core.types import Request, Role
    from tests.helpers import toy_profile

    d = Dispatcher(toy_profile(), "round_robin", queue=("tail_aware", {"tau_s": 0.01}))
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    q = d.queue
    for k in range(3):
        r = Request(f"r{k}", float(k), 100, 10)
        d.route(r, float(k))
        d.on_prefill_end(r.id, k + 1.0)
        d.on_decode_start(r.id, k + 1.0)
        d.on_finish(r.id, k + 2.0, 10)
    assert len(q._ada.window(5.0)) == 3  # γ-Ada saw each E2E (2 s each)
    held = Request("h", 10.0, 900, 4)
    assert q.engine_priority(held) == round(q.phi(held) * 1000) < 10_000  # boosted ahead of its arrival
    assert build("queue", "fcfs").engine_priority(held) is None  # others leave the client's priority

"""The dispatcher: lifecycle bookkeeping, hot swap, shadow scoring, instance health."""

from __future__ import annotations

import pytest

from core.dispatch import Dispatcher
from core.errors import PolicyError
from core.types import InstancePhase, InstanceState, PolicyKind, Request, Role
from tests.helpers import add_pending, add_running, cluster, toy_profile


def test_lifecycle_moves_counts_and_feeds_estimators() -> None:
    d = cluster("round_robin", decode=2)
    a = d.route(Request("r1", 0.0, 100, 50), 0.0)
    i = d.index_of(a.decode)
    assert d.view.pending_n[i] == 1 and d.view.running_n[i] == 0
    d.on_prefill_start("r1", 0.0)
    d.on_prefill_end("r1", 1.0, seconds=1.0)
    d.on_decode_start("r1", 1.0)
    assert d.view.pending_n[i] == 0 and d.view.running_n[i] == 1
    d.on_progress("r1", 20, 2.0)
    row = d.view.table.row["r1"]
    assert d.view.table.v[row] == pytest.approx(20.0)
    assert d.view.table.generated_at(2.5)[row] == pytest.approx(30.0)
    before = d.view.survival(128)
    d.on_finish("r1", 3.5, 200)
    assert "r1" not in d.view.table and d.view.running_n[i] == 0
    d.view.survival.flush()  # completions are folded in batches; force this one in
    assert d.view.survival(128) > before  # a 200-token completion raises Ŝ(128)
    assert d.view.decode_rate.observations == 1


def test_a_prefill_that_ends_on_time_leaves_the_backlog_behind_it_intact() -> None:
    """Three prompts on p0 at once, batched as the engine batches them (the toy profile's prefill
    step is its 1 s base plus the 0.1 s engine step it runs in): r0 alone in the first step (0 to
    1.1 s), r1 and r2 together in the second (1.1 to 2.2 s). r0 ends on time: p0 is still busy
    until 2.2 s, so the next arrival goes to idle p1 (subtracting the finished work would have
    made p0 look free and piled the arrival onto it)."""
    d = cluster("round_robin", prefill=1, decode=1)
    for k in range(3):
        d.route(Request(f"r{k}", 0.0, 10, 5), 0.0)
    d.add_instance("p1", Role.PREFILL)
    p0 = d.index_of("p0")
    assert d.view.prefill_free_at[p0] == pytest.approx(2.2)
    d.on_prefill_end("r0", 1.1, seconds=1.1)
    assert d.view.prefill_free_at[p0] == pytest.approx(2.2)
    d.on_prefill_end("r1", 2.7, seconds=2.7)  # half a second late: its step, r2 with it, ended then
    assert d.view.prefill_free_at[p0] == pytest.approx(2.7)
    assert d.route(Request("r3", 2.5, 10, 5), 2.5).prefill == "p1"


def test_lateness_is_counted_once_for_the_requests_queued_behind_it() -> None:
    """Four prompts on p0 at once: r0 alone in the first step (due 1.1 s), r1 to r3 sharing the
    second (due 2.2 s). r0 ends 0.7 s late, so the second step ends 0.7 s late too, and the
    instance frees at 2.9 s, not 2.2 + 3 × 0.7 (each queued request comparing its old due with its
    end and adding the same lateness again: a phantom backlog that left a second prefill instance
    idle while arrivals queued on the first)."""
    d = cluster("round_robin", prefill=1, decode=1)
    for k in range(4):
        d.route(Request(f"r{k}", 0.0, 10, 5), 0.0)
    p0 = d.index_of("p0")
    assert d.view.prefill_free_at[p0] == pytest.approx(2.2)
    d.on_prefill_end("r0", 1.8, seconds=1.8)
    assert d.view.prefill_free_at[p0] == pytest.approx(2.9)
    for k in range(1, 4):
        d.on_prefill_end(f"r{k}", 2.9, seconds=2.9)
        assert d.view.prefill_free_at[p0] == pytest.approx(2.9), k
    alone = d.view.queues.terms.alone_s(10)  # the estimator learned from r0, which ran alone
    d.route(Request("r4", 2.9, 10, 5), 2.9)
    assert d.view.prefill_free_at[p0] == pytest.approx(2.9 + alone)


def test_only_a_prefill_that_ran_alone_teaches_the_prefill_time_estimator() -> None:
    """A prefill measured beside or behind others includes them: folding it in as one prompt's
    cost would count the queueing twice. One that ran alone is folded in less the engine step the
    batching model adds itself."""
    d = cluster("round_robin", prefill=1, decode=1)
    for k in range(3):
        d.route(Request(f"r{k}", 0.0, 10, 5), 0.0)
    d.on_prefill_end("r0", 1.1, seconds=1.1)
    assert d.view.prefill_time.observations == 1  # 1.1 s less the 0.1 s step: exactly the prior
    assert float(d.view.prefill_time(10)) == pytest.approx(1.0)
    d.on_prefill_end("r1", 4.0, seconds=4.0)
    d.on_prefill_end("r2", 4.0, seconds=4.0)
    assert d.view.prefill_time.observations == 1


def test_failure_releases_the_prefill_projection() -> None:
    d = cluster("round_robin", decode=1)
    d.route(Request("r1", 0.0, 10, 5), 0.0)
    p = d.index_of("p0")
    assert d.view.prefill_free_at[p] == pytest.approx(1.1)  # 1 s prefill + the 0.1 s step it runs in
    d.on_fail("r1", 0.0)
    assert d.view.prefill_free_at[p] == pytest.approx(0.0)
    assert len(d.view.table) == 0 and d.view.pending_n.sum() == 0


def test_hot_swap_builds_first_records_and_keeps_bindings() -> None:
    d = cluster("round_robin", decode=2)
    a = d.route(Request("r1", 0.0, 10, 5), 0.0)
    with pytest.raises(PolicyError):
        d.set_policy("routing", "sibyl", {"nope": 1})
    assert d.routing.name == "round_robin"  # a failed build leaves the old policy in place
    old = d.routing
    closed = []
    old.close = lambda: closed.append(True)  # type: ignore[method-assign]
    ev = d.set_policy("routing", "least_load", {"by": "tokens"}, source="cli", now=3.0)
    assert (ev.kind, ev.old, ev.new, ev.params, ev.source, ev.time) == (
        PolicyKind.ROUTING,
        "round_robin",
        "least_load",
        {"by": "tokens", "bind": "arrival"},
        "cli",
        3.0,
    )
    assert closed == [True]
    assert d.view.table.inst[d.view.table.row["r1"]] == d.index_of(a.decode)
    assert [(e.kind, e.new, e.source) for e in d.policy_events] == [
        ("routing", "round_robin", "config"),
        ("queue", "fcfs", "config"),
        ("reschedule", "none", "config"),
        ("scaling", "static", "config"),
        ("rank", "engine", "config"),
        ("routing", "least_load", "cli"),
    ]
    active = d.active_policies()
    assert active["routing"] == {"name": "least_load", "params": {"by": "tokens", "bind": "arrival"}}
    assert [active[k]["name"] for k in ("queue", "reschedule", "scaling")] == ["fcfs", "none", "static"]


def test_unknown_kind_is_rejected() -> None:
    d = cluster()
    with pytest.raises(PolicyError, match="kinds"):
        d.set_policy("weather", "sunny")


def test_shadow_policies_are_scored_at_handoff() -> None:
    d = cluster("round_robin", decode=2, shadow=[("least_load", {})])
    # r1 → d0 and starts decoding; r2 → d1 by round robin, least_load (shadow) would pick d1 too.
    for rid in ("r1", "r2", "r3"):
        d.route(Request(rid, 0.0, 10, 100), 0.0)
        d.on_decode_start(rid, 0.0)
    # r1 at handoff: both empty → hit for both. r2 → d1 (empty) hit; r3 → d0 (1 running vs 1) hit.
    assert d.score.total == 3 and d.score.hits == 3
    assert d.assignment_ratios()["least_load"] == pytest.approx(1.0)


def test_health_changes_are_reported_once() -> None:
    d = cluster()
    assert d.set_health("d0", False) is True
    assert d.set_health("d0", False) is False
    assert not d.view.decode_mask()[d.index_of("d0")]


def test_retry_prefill_moves_to_an_untried_healthy_instance() -> None:
    d = cluster("round_robin", prefill=3, decode=1)
    a = d.route(Request("r1", 0.0, 10, 5), 0.0)
    assert a.prefill == "p0"
    d.set_health("p2", False)
    assert d.retry_prefill("r1", ["p0"], 0.0) == "p1"
    assert d.view.prefill_free_at[d.index_of("p0")] == 0.0
    assert d.view.prefill_free_at[d.index_of("p1")] == pytest.approx(1.1)
    assert d.retry_prefill("r1", ["p0", "p1"], 0.0) is None


def test_instance_lifecycle_phases_and_in_flight() -> None:
    d = cluster("round_robin", decode=1)
    d.add_instance("d1", Role.DECODE, phase=InstancePhase.STARTING)
    assert d.phase_of("d1") is InstancePhase.STARTING
    assert not d.view.decode_mask()[d.index_of("d1")]
    d.set_phase("d1", InstancePhase.ACTIVE)
    assert d.view.decode_mask()[d.index_of("d1")]
    a = d.route(Request("r1", 0.0, 10, 5), 0.0)
    assert (a.prefill, a.decode) == ("p0", "d0")
    assert d.in_flight("p0") == 1 and d.in_flight("d0") == 1
    d.on_prefill_end("r1", 1.0)
    assert d.in_flight("p0") == 0 and d.in_flight("d0") == 1
    d.begin_drain("d0")
    assert d.phase_of("d0") is InstancePhase.DRAINING
    assert d.route(Request("r2", 1.0, 10, 5), 1.0).decode == "d1"
    d.on_decode_start("r1", 1.0)
    assert d.in_flight("d0") == 1  # draining still tracks what it holds
    d.on_finish("r1", 2.0, 5)
    assert d.in_flight("d0") == 0
    d.remove_instance("d0")
    assert d.phase_of("d0") is InstancePhase.STOPPED
    d.flip_role("d1", Role.PREFILL)
    assert d.view.prefill_mask()[d.index_of("d1")] and not d.view.decode_mask().any()
    d.observe_instance(InstanceState("d1", Role.PREFILL, kv_usage=0.25, waiting=3))
    d.observe_instance(InstanceState("zz", Role.PREFILL))  # unknown: ignored
    assert d.view.kv_usage[d.index_of("d1")] == 0.25


def late_binding_state(bind: str) -> Dispatcher:
    """At arrival d1 is busier than d0; by prefill end d0 has filled up and d1 has emptied."""
    d = cluster("least_load", {"bind": bind}, decode=2)
    add_running(d, "old1", "d1", prompt=10, generated=5, rate=10, now=0)
    add_running(d, "old2", "d1", prompt=10, generated=5, rate=10, now=0)
    d.route(Request("r", 0.0, 10, 50), 0.0)
    d.on_prefill_start("r", 0.0)
    d.on_finish("old1", 0.5, 10)
    d.on_finish("old2", 0.5, 10)
    for k in range(3):
        add_running(d, f"new{k}", "d0", prompt=10, generated=0, rate=10, now=0.5)
    d.on_prefill_end("r", 1.0)
    return d


def test_late_binding_chooses_the_least_loaded_decode_at_prefill_end() -> None:
    early = late_binding_state("arrival")
    assert early.decode_of("r") == "d0"  # chosen at arrival, when d0 was idle
    late = late_binding_state("prefill_end")
    assert late.decode_of("r") is None
    assert late.bind_late("r", 1.0) == "d1"  # the fresher state at handoff
    assert late.view.pending_n[late.index_of("d1")] == 1
    with pytest.raises(ValueError, match="already bound"):
        late.bind_late("r", 1.0)
    late.on_decode_start("r", 1.1)
    assert late.view.running_n[late.index_of("d1")] == 1
    assert late.score.hits == 1  # d1 was the least loaded at handoff


def test_late_binding_is_done_by_the_policy_that_routed_the_request() -> None:
    d = cluster("least_load", {"bind": "prefill_end"}, decode=2)
    d.route(Request("r", 0.0, 10, 50), 0.0)
    add_pending(d, "p0", "d0", prompt=10, handoff=5.0)
    add_pending(d, "p1", "d0", prompt=10, handoff=5.0)
    add_running(d, "run", "d1", prompt=10, generated=0, rate=10, now=0)
    d.set_policy("routing", "req_level", now=0.5)  # counts pending: it would pick d1
    assert d.bind_late("r", 1.0) == "d0"  # least_load counts running only


def test_oracle_policies_run_only_with_true_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    from core.policies.least_load import LeastLoad

    monkeypatch.setattr(LeastLoad, "needs_true_lengths", True)
    msg = "least_load knows every request's true output length, so it runs only in the simulator"
    with pytest.raises(PolicyError, match=msg):
        Dispatcher(toy_profile(), "least_load")
    with pytest.raises(PolicyError, match=msg):
        Dispatcher(toy_profile(), "round_robin", shadow=[("least_load", {})])
    d = Dispatcher(toy_profile(), "round_robin")
    with pytest.raises(PolicyError, match=msg):
        d.set_policy("routing", "least_load")
    assert d.routing.name == "round_robin"
    assert Dispatcher(toy_profile(), "least_load", true_lengths=True).routing.name == "least_load"


def test_projected_loads_use_the_policy_display_load() -> None:
    d = cluster("least_load", {"by": "tokens"}, decode=2)
    add_running(d, "a", "d0", prompt=100, generated=0, rate=0, now=0)
    add_pending(d, "b", "d1", prompt=10, handoff=1.0)
    assert d.projected_loads()["d0"] == 100.0 and d.projected_loads()["d1"] == 0.0
    d.set_policy("routing", "round_robin")
    assert d.projected_loads()["d1"] == 1.0  # the base: running + pending

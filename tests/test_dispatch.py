"""The dispatcher: lifecycle bookkeeping, hot swap, shadow scoring, instance health."""

from __future__ import annotations

import pytest

from core.errors import PolicyError
from core.types import PolicyKind, Request
from tests.helpers import cluster


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


def test_failure_releases_the_prefill_projection() -> None:
    d = cluster("round_robin", decode=1)
    d.route(Request("r1", 0.0, 10, 5), 0.0)
    p = d.index_of("p0")
    assert d.view.prefill_free_at[p] == pytest.approx(1.0)
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
        PolicyKind.ROUTING, "round_robin", "least_load", {"by": "tokens"}, "cli", 3.0,
    )
    assert closed == [True]
    assert d.view.table.inst[d.view.table.row["r1"]] == d.index_of(a.decode)
    assert [e.new for e in d.policy_events] == ["round_robin", "least_load"]
    assert d.active_policies() == {"routing": {"name": "least_load", "params": {"by": "tokens"}}}


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
    assert d.view.prefill_free_at[d.index_of("p1")] == 1.0
    assert d.retry_prefill("r1", ["p0", "p1"], 0.0) is None

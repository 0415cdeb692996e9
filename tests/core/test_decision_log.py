"""Decision records on constructed states: every routing policy's candidates, scores, margin and ties;
late binds, handoffs, queue releases and periodic actions; sampling and its per-second bound."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from core.decision_log import DecisionLog
from core.decision_records import Decision
from core.dispatch import Dispatcher
from core.policies import registry
from core.types import Admission, PolicyKind, Request
from tests.core.policies.states import prefix_cluster, prefix_request
from tests.helpers import add_running, cluster


class Ring:
    """The decisions a log holds, made when read."""

    def __init__(self, log: DecisionLog) -> None:
        self.log = log

    def __iter__(self) -> Iterator[Decision]:
        return iter([r.get() for r in self.log.ring])


def recorded(d: Dispatcher, **kw: Any) -> Ring:
    log = DecisionLog(**kw)
    d.use_decisions(log)
    return Ring(log)


def by_stage(records: list[Decision], kind: str = "route") -> dict[str, Decision]:
    return {r.stage: r for r in records if r.kind == kind}


def test_sibyl_records_every_decode_candidate_with_its_projected_load_margin_and_ties() -> None:
    d = cluster("sibyl", decode=3)
    add_running(d, "a", "d0", prompt=100, generated=10, rate=10.0, now=0.0)
    add_running(d, "b", "d0", prompt=100, generated=10, rate=10.0, now=0.0)
    add_running(d, "c", "d1", prompt=100, generated=10, rate=10.0, now=0.0)
    ring = recorded(d)
    a = d.route(Request("r", 0.0, 100, 50), 0.0)
    rec = by_stage(list(ring))
    dec = rec["decode"]
    assert a.decode == "d2" and dec.chosen == "d2" and dec.request_id == "r"
    assert dec.names == ("d0", "d1", "d2") and dec.score_name == "projected_load_at_tau"
    assert dec.scores is not None and dec.scores[2] == min(dec.scores) and dec.scores[0] > dec.scores[1] > 0
    assert dec.margin == pytest.approx(dec.scores[1] - dec.scores[2]) and dec.ties == 0
    assert dec.feature("running") == [2.0, 1.0, 0.0]
    assert "tau_in_s" in dec.info
    pre = rec["prefill"]
    assert (
        pre.chosen == "p0" and pre.names == ("p0",) and {"queued_s", "est_ttft_s", "cached_tokens"} <= set(pre.features)
    )
    js = dec.to_json()
    assert [c["chosen"] for c in js["candidates"]] == [False, False, True] and js["margin"] == dec.margin


def test_ties_are_counted_and_a_margin_of_zero_reported() -> None:
    d = cluster("least_load", decode=3)
    ring = recorded(d)
    d.route(Request("r", 0.0, 100, 50), 0.0)
    dec = by_stage(list(ring))["decode"]
    assert dec.ties == 2 and dec.margin == 0.0 and dec.score_name == "load_requests"


def test_a_late_bind_is_recorded_when_the_request_was_sampled() -> None:
    d = cluster("least_load", {"bind": "prefill_end"}, decode=2)
    add_running(d, "a", "d0", prompt=100, generated=10, rate=10.0, now=0.0)
    ring = recorded(d)
    a = d.route(Request("r", 0.0, 100, 50), 0.0)
    assert a.decode is None and set(by_stage(list(ring))) == {"prefill"}
    d.on_prefill_end("r", 1.0)
    assert d.bind_late("r", 1.0) == "d1"
    bind = by_stage(list(ring), "bind")["decode"]
    assert bind.chosen == "d1" and bind.scores == [1.0, 0.0] and bind.margin == 1.0
    d.on_decode_start("r", 1.0)
    hand = by_stage(list(ring), "handoff")["decode"]
    assert hand.chosen == "d1" and hand.info["still_best"] == 1


def test_prefix_aware_records_the_estimated_ttft_the_overlap_and_the_load_guard() -> None:
    d = prefix_cluster("prefix_aware", {"balance_s": 1.0, "decode": "least_load"}, held={"p0": 40, "p1": 10})
    d.view.prefill_free_at[d.index_of("p0")] = 5.0  # p0 holds the whole prompt but is far behind
    ring = recorded(d)
    a = d.route(prefix_request(), 0.0)
    pre = by_stage(list(ring))["prefill"]
    assert a.prefill == pre.chosen == "p1"
    assert pre.score_name == "est_ttft_s" and pre.eligible == [False, True, True]
    assert pre.feature("cached_tokens") == [624.0, 160.0, 0.0]  # at most prompt − 1, in whole blocks
    assert pre.margin is not None and pre.margin > 0  # p2 (nothing cached) is slower; p0 is guarded out
    assert d.prefix_hits.achievable_tokens == 624 and d.prefix_hits.achieved_tokens == 160


@pytest.mark.parametrize("name", [s.name for s in registry.specs(PolicyKind.ROUTING) if not s.sim_only])
def test_every_live_routing_policy_records_candidates_for_each_choice_it_makes(name: str) -> None:
    d = prefix_cluster(name, held={"p1": 20, "d0": 5}, decode_only=False)
    add_running(d, "a", "d0", prompt=100, generated=10, rate=10.0, now=0.0)
    ring = recorded(d)
    a = d.route(prefix_request(session="s"), 0.0)
    if a.decode is None:
        d.on_prefill_end("r", 1.0)
        d.bind_late("r", 1.0)
    stages = {(r.kind, r.stage): r for r in ring}
    assert ("route", "prefill") in stages or a.prefill is None
    decode = stages.get(("route", "decode")) or stages[("bind", "decode")]
    for rec in stages.values():
        assert rec.policy == name and rec.chosen in rec.names and len(rec.names) == 3
    assert decode.score_name, f"{name} recorded no decode scores"


def test_queue_releases_say_who_went_before_whom() -> None:
    d = cluster("round_robin", decode=1, queue=("priority", {"max_in_flight_per_instance": 1}))
    ring = recorded(d)
    assert d.admit(Request("first", 0.0, 10, 5), 0.0) == Admission.ROUTE
    d.route(Request("first", 0.0, 10, 5), 0.0)
    for rid, prio in (("low", 5), ("high", 1), ("mid", 3)):
        assert d.admit(Request(rid, 0.1, 10, 5, priority=prio), 0.1) == Admission.QUEUED
    d.on_fail("first", 1.0)
    assert [r.id for r in d.release(1.0)] == ["high"]
    rel = by_stage(list(ring), "release")["queue"]
    assert rel.chosen == "high" and rel.names == ("high", "mid", "low") and rel.feature("priority") == [1.0, 3.0, 5.0]
    assert rel.policy == "priority" and rel.margin == 1.0


def test_sample_rate_and_the_per_second_bound() -> None:
    d = cluster("round_robin", decode=2)
    log = DecisionLog(sample_rate=0.5, max_per_s=3)
    d.use_decisions(log)
    for k in range(20):
        d.route(Request(f"r{k}", 0.0, 10, 5), 0.0)
    assert log.requests_sampled == 3 and log.skipped_rate == 10 and log.skipped_bound == 7
    assert {r.request_id for r in log.ring} == {"r1", "r3", "r5"}
    d.route(Request("later", 1.0, 10, 5), 1.0)
    d.route(Request("later2", 1.0, 10, 5), 1.0)
    assert log.requests_sampled == 4  # a new second, a new allowance (every other request)
    off = cluster("round_robin", decode=2)
    off.use_decisions(DecisionLog(sample_rate=0.0))
    assert off.decisions is None


def test_scaling_actions_are_recorded_with_their_reason() -> None:
    d = cluster(
        "round_robin",
        decode=1,
        scaling=("threshold", {"period_s": 1.0, "cooldown_s": 0.0, "util_high": 0.05, "util_low": 0.01}),
    )
    ring = recorded(d)
    for k in range(40):
        d.route(Request(f"r{k}", 0.0, 10, 5), 0.0)
    out = d.periodic(1.0)
    recs = [r for r in ring if r.kind == "scale"]
    assert len(recs) == len(out.scale) >= 1
    assert recs[0].policy == "threshold" and recs[0].info["reason"] == out.scale[0].reason


def test_a_rank_choice_records_each_ranks_load() -> None:
    d = cluster("round_robin", decode=1, rank=("jsq", {}))
    d.set_data_parallel("d0", 2, slots=4)
    ring = recorded(d)
    for rid, prompt in (("big", 1000), ("small", 100)):
        d.route(Request(rid, 0.0, prompt, 50), 0.0)
        d.on_prefill_end(rid, 0.0)
        d.on_decode_start(rid, 0.0)
        d.choose_rank(rid, 0.0)
    rank = [r for r in ring if r.kind == "rank" and r.request_id == "small"][0]
    assert rank.names == ("d0/rank0", "d0/rank1") and rank.scores == [1000.0, 0.0]
    assert rank.chosen == "d0/rank1" and rank.policy == "jsq" and rank.margin == 1000.0


def test_only_sampled_requests_get_later_records_and_every_request_is_forgotten_when_it_leaves() -> None:
    d = cluster("least_load", {"bind": "prefill_end"}, decode=2)
    log = DecisionLog(sample_rate=0.5)
    d.use_decisions(log)
    ids = [f"r{k}" for k in range(4)]
    for rid in ids:
        d.route(Request(rid, 0.0, 10, 5), 0.0)
    assert [rid for rid in ids if log.sampled(rid)] == ["r1", "r3"]
    for rid in ids:
        d.on_prefill_end(rid, 1.0)
        d.bind_late(rid, 1.0)
        d.on_decode_start(rid, 1.0)
    kinds = {(r.kind, r.request_id) for r in Ring(log)}
    assert {rid for kind, rid in kinds if kind in ("bind", "handoff")} == {"r1", "r3"}
    d.on_finish("r0", 2.0, 5)
    d.on_finish("r1", 2.0, 5)
    d.on_fail("r3", 2.0)
    assert not any(log.sampled(rid) for rid in ids)

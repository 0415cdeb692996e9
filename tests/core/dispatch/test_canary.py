"""The dispatcher's canary: the canary arm's requests are routed (and bound late, and given their rank) by the
candidate, the rest by the active policy, each request keeping the router it was routed under."""

from __future__ import annotations

import pytest

from core.dispatch import Dispatcher
from core.errors import PolicyError
from core.types import PolicyKind, Request, Role
from tests.helpers import toy_profile


def cluster(routing: str = "round_robin", rank: str = "engine") -> Dispatcher:
    d = Dispatcher(toy_profile(), routing, rank=(rank, {}))
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("p1", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    d.add_instance("d1", Role.DECODE)
    return d


def even(request: Request) -> bool:
    return int(str(request.id)[1:]) % 2 == 0


def test_the_canary_arm_is_routed_by_the_candidate_and_the_rest_by_the_active_policy() -> None:
    d = cluster("round_robin")
    # d0 carries three running requests: least_load sends everything to d1, round robin alternates
    for k in range(3):
        d.route(Request(f"busy{k}", 0.0, 10, 10), 0.0)
        t = d.view.table
        t.inst[t.row[f"busy{k}"]] = d.index_of("d0")
    d.view.running_n[:] = 0
    d.view.pending_n[:] = 0
    d.view.running_n[d.index_of("d0")] = 3
    canary = d.start_canary("routing", "least_load", {}, even)
    assert d.canary is canary and canary.name == "least_load"
    decodes = {}
    for k in range(8):
        rid = f"r{k}"
        decodes[rid] = d.route(Request(rid, 0.0, 10, 10), 0.0).decode
        d.view.pending_n[:] = 0  # each decision on the same state
    assert {rid: d.arm_of(rid) for rid in decodes} == {f"r{k}": "canary" if k % 2 == 0 else "control" for k in range(8)}
    assert all(decodes[f"r{k}"] == "d1" for k in range(0, 8, 2))  # the candidate: the least loaded
    assert {decodes[f"r{k}"] for k in range(1, 8, 2)} == {"d0", "d1"}  # the active policy: round robin
    assert canary.routed == {"canary": 4, "control": 4}
    assert d._tracked["r0"].router is canary.policy and d._tracked["r1"].router is d.routing


def test_requests_keep_their_router_after_the_canary_ends_and_new_ones_have_no_arm() -> None:
    d = cluster("round_robin")
    canary = d.start_canary(PolicyKind.ROUTING, "least_load", {}, lambda r: True)
    d.route(Request("r0", 0.0, 10, 10), 0.0)
    assert d.stop_canary() is canary and d.canary is None
    d.route(Request("r1", 0.0, 10, 10), 0.0)
    assert d.arm_of("r0") == "canary" and d._tracked["r0"].router is canary.policy
    assert d.arm_of("r1") is None and d._tracked["r1"].router is d.routing
    assert d.stop_canary() is None
    d.on_prefill_end("r0", 1.0, 1.0)
    d.on_decode_start("r0", 1.0)
    d.on_finish("r0", 2.0, 10, 1.5)
    assert d.arm_of("r0") is None  # forgotten once finished


def test_a_rank_canary_chooses_the_rank_of_its_arm() -> None:
    d = cluster("round_robin", rank="engine")
    d.set_data_parallel("d0", 2, slots=4)
    d.start_canary("rank", "bf_io", {}, even)
    chosen = {}
    for k in range(4):
        rid = f"r{k}"
        d.route(Request(rid, 0.0, 100, 10), 0.0)
        t = d.view.table
        t.inst[t.row[rid]] = d.index_of("d0")
        d.on_prefill_end(rid, 0.0, 0.0)
        d.on_decode_start(rid, 0.0)
        chosen[rid] = d.choose_rank(rid, 0.0)
    assert chosen["r1"] is None and chosen["r3"] is None  # engine: the group decides
    assert chosen["r0"] in (0, 1) and chosen["r2"] in (0, 1) and chosen["r0"] != chosen["r2"]  # bf_io balances


def test_what_cannot_be_canaried_is_refused_with_the_reason() -> None:
    d = cluster()
    with pytest.raises(PolicyError, match="a queue policy cannot be canaried.*canaries split routing, rank"):
        d.start_canary("queue", "priority", {}, even)
    with pytest.raises(PolicyError, match="unknown routing policy"):
        d.start_canary("routing", "nope", {}, even)
    with pytest.raises(PolicyError, match="simulator"):
        d.start_canary("routing", "oracle", {}, even)
    d.start_canary("routing", "least_load", {}, even)
    with pytest.raises(PolicyError, match="already running"):
        d.start_canary("routing", "sibyl", {}, even)
    assert not d.reads_prefix
    d.stop_canary()
    d.start_canary("routing", "prefix_aware", {}, even)
    assert d.reads_prefix and not d.routing.reads_prefix

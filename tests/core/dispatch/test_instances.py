"""The dispatcher's data-parallel groups: each rank's load tracked, a rank chosen per decode leg and
forgotten when the request moves."""

from __future__ import annotations

from core.dispatch import Dispatcher
from core.request_table import RUNNING
from core.types import PolicyKind, Request, Role
from tests.helpers import toy_profile


def test_the_dispatcher_tracks_each_ranks_load_and_forgets_a_rank_when_the_request_moves() -> None:
    d = Dispatcher(toy_profile(), "round_robin", rank=("bf_io", {}))
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    d.add_instance("d1", Role.DECODE)
    d.set_data_parallel("d0", 2, slots=4)
    assert (
        d.rank_loads("d0", 0.0) == [0, 0] and d.rank_loads("d1", 0.0) is None
    )  # a group of two ranks, and not a group
    chosen = {}
    for k, prompt in enumerate([1000, 100, 100, 100]):
        rid = f"r{k}"
        d.route(Request(rid, 0.0, prompt, 50), 0.0)
        t = d.view.table
        t.inst[t.row[rid]] = d.index_of("d0")  # bound to the group (whatever round robin chose)
        d.on_prefill_end(rid, 0.0, 0.0)
        d.on_decode_start(rid, 0.0)
        chosen[rid] = d.choose_rank(rid, 0.0)
    # the 1,000-token prompt takes rank 0; the short ones fill rank 1 while it stays lighter
    assert chosen == {"r0": 0, "r1": 1, "r2": 1, "r3": 1}
    assert d.rank_loads("d0", 0.0) == [1000, 300] and d.rank_loads("d1", 0.0) is None
    t = d.view.table
    assert all(t.state[t.row[r]] == RUNNING for r in chosen)
    d.on_migrated("r3", "d1", 0.0)
    assert t.rank[t.row["r3"]] == -1 and d.rank_loads("d0", 0.0) == [1000, 200]
    assert d.choose_rank("r3", 0.0) is None  # d1 is not a group
    d.set_policy(PolicyKind.RANK, "engine")
    d.on_migrated("r3", "d0", 0.0)
    assert d.choose_rank("r3", 0.0) is None  # engine: the group decides, no rank sent

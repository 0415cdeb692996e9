"""Rank policies (kind `rank`) on hand-built data-parallel states, and the dispatcher's rank bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from core.dispatch import Dispatcher
from core.errors import PolicyError
from core.policies import registry
from core.policies.rank import dp_state
from core.request_table import RUNNING
from core.types import PolicyKind, Request, Role
from tests.helpers import toy_profile


def choose(
    name: str, state_args: tuple[int, int, list[int], list[int], list[int] | None], prompt: int, **params: object
) -> int | None:
    policy = registry.build(PolicyKind.RANK, name, params)
    ranks, slots, rank_of, size, remaining = state_args
    return policy.choose(
        dp_state(ranks, slots, np.array(rank_of), np.array(size), None if remaining is None else np.array(remaining)),
        prompt,
    )


def test_each_baseline_and_bf_io_pick_the_rank_their_rule_names() -> None:
    # rank 0: two requests of 500 tokens; rank 1: three of 100; rank 2: one of 900; 4 slots each
    state = (3, 4, [0, 0, 1, 1, 1, 2], [500, 500, 100, 100, 100, 900], None)
    assert choose("fcfs", state, 50) == 0  # the first rank with a free slot
    assert choose("jsq", state, 50) == 1  # fewest resident tokens (300)
    assert choose("jsq", state, 50, by="requests") == 2  # fewest requests (1)
    assert choose("bf_io", state, 50) == 1  # H = 0: the least loaded rank
    assert choose("engine", state, 50) is None  # the group's own balancer decides


def test_bf_io_looks_ahead_to_the_rank_whose_requests_are_about_to_finish() -> None:
    """Rank 0 holds 1,200 tokens in requests that end next step; rank 1 holds 1,000 that stay for
    hundreds of steps. jsq (and bf_io with H = 0) see rank 1 as lighter; bf_io with H = 8 sees
    rank 0 empty from the next step on and puts the new request there."""
    state = (2, 8, [0, 0, 1, 1], [600, 600, 500, 500], [1, 1, 400, 400])
    assert choose("jsq", state, 200) == 1
    assert choose("bf_io", state, 200) == 1
    assert choose("bf_io", state, 200, horizon=8) == 0


def test_full_ranks_queue_the_request_on_the_lightest_and_fcfs_skips_full_ones() -> None:
    full = (2, 2, [0, 0, 1, 1], [300, 300, 100, 100], None)
    assert choose("bf_io", full, 10) == 1 and choose("fcfs", full, 10) == 1 and choose("jsq", full, 10) == 1
    assert choose("fcfs", (2, 2, [0, 0, 1], [5, 5, 5], None), 10) == 1  # rank 0 has no slot left


def test_bad_rank_params_are_refused_with_the_field() -> None:
    with pytest.raises(PolicyError, match="horizon"):
        registry.build(PolicyKind.RANK, "bf_io", {"horizon": -1})
    with pytest.raises(PolicyError, match="by"):
        registry.build(PolicyKind.RANK, "jsq", {"by": "vibes"})


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


def test_the_console_reports_a_group_whose_ranks_drift_apart_once_and_again_when_balanced() -> None:
    from types import SimpleNamespace

    from console.live.health import RankWatch
    from console.live.state import InstanceRow
    from console.tui.events import describe
    from console.tui.fmt import Palette

    published: list[dict[str, object]] = []
    events = SimpleNamespace(publish=lambda kind, **kw: published.append({"type": kind, **kw}))
    watch = RankWatch(events, lambda: "jsq")  # type: ignore[arg-type]
    for loads in (
        [100, 100, 100, 100],
        [400, 100, 100, 100],
        [500, 100, 100, 100],
        [130, 100, 100, 100],
        [110, 100, 100, 100],
    ):
        watch.check(
            [InstanceRow(id="d0", role="decode", dp_ranks=loads), InstanceRow(id="d1", role="decode", dp_ranks=None)]
        )
    # x2.29 is reported once (not again at x2.5); x1.24 is not yet balanced; x1.07 is
    assert [(e["factor"], e["busiest"], e["balanced"]) for e in published] == [(2.29, 0, False), (1.07, 0, True)]
    tag, text, _ = describe(published[0], Palette("g", "y", "r", "b", "d"))
    assert tag == "RANKS" and "rank 0 at x2.29" in text and "jsq" in text
    tag, text, _ = describe(
        {"type": "recovered", "request_id": "r1", "detail": "decode d0 failed mid-stream: resumed on d1"},
        Palette("g", "y", "r", "b", "d"),
    )
    assert tag == "MOVED" and "resumed on d1" in text

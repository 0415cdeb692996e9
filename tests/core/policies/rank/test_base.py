"""Every rank policy through the registry: a whole admission round fills exactly the free slots, and one
request live is a round of one (the rank each rule names, full ranks, bad params)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import PolicyError
from core.policies import registry
from core.policies.rank.state import DPState, Waiting, check_assignment, dp_state
from core.types import PolicyKind


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    running=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    sizes=st.lists(st.integers(0, 3000), min_size=0, max_size=20),
    policy=st.sampled_from(
        [
            ("fcfs", {}),
            ("jsq", {}),
            ("jsq", {"by": "requests"}),
            ("bf_io", {}),
            ("bf_io", {"admit": "pool"}),
            ("bf_io", {"horizon": 4}),
            ("bf_io", {"horizon": 4, "admit": "pool", "max_wait_steps": 1}),
        ]
    ),
    seed=st.integers(0, 2**16),
)
def test_every_policy_admits_exactly_the_fillable_requests_into_free_slots(
    running: list[int], sizes: list[int], policy: tuple[str, dict[str, object]], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    rank_of = np.repeat(np.arange(len(running)), running)
    state = DPState.from_requests(
        len(running),
        4,
        rank_of,
        rng.integers(1, 2000, len(rank_of)),
        rng.integers(1, 8, len(rank_of)),
    )
    waiting = Waiting(np.array(sizes, dtype=np.int64), rng.integers(0, 3, len(sizes)))
    pairs = registry.build(PolicyKind.RANK, policy[0], policy[1]).assign(state, waiting)
    check_assignment(state, waiting, pairs)  # raises unless distinct, in free slots, n_k of them


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

"""Rank policy bf_io on hand-built states: H = 0 and its exchange pass, the lookahead, pool admission, params."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from core.errors import PolicyError
from core.policies import registry
from core.policies.rank.bf_io import BfIoParams, BfIoRank
from core.policies.rank.fcfs import FcfsRank
from core.policies.rank.jsq import JsqParams
from core.policies.rank.state import DPState, Waiting, assignment_cost
from core.sim.dp.oracle import solve_round
from core.types import PolicyKind


def test_bf_io_h0_puts_the_largest_new_request_on_the_least_loaded_rank() -> None:
    state = DPState.from_loads([1000, 0, 500], running=[1, 1, 1], slots=2)
    waiting = Waiting(np.array([900, 100, 400]))
    pairs = BfIoRank().assign(state, waiting)
    assert sorted(pairs) == [(0, 1), (1, 0), (2, 2)]  # loads 1100, 900, 900
    assert FcfsRank().assign(state, waiting) == [(0, 0), (1, 1), (2, 2)]  # loads 1900, 100, 900
    assert assignment_cost(state, waiting, pairs) == 3 * 1100 - 2900
    assert assignment_cost(state, waiting, FcfsRank().assign(state, waiting)) == 3 * 1900 - 2900


def test_bf_io_h0_exchange_pass_fixes_the_cardinality_trap_of_plain_lpt() -> None:
    # Rank 2 has one slot. Plain LPT: 380→r0, 359→r1, 208→r2, 206→r1 (565), 64→r0 (max 565).
    # Swapping 359 and 208 gives 444 / 414 / 463: the optimum.
    state = DPState.from_loads([0, 0, 104], running=[0, 0, 1], slots=2)
    waiting = Waiting(np.array([64, 206, 380, 208, 359]))
    plain = BfIoRank(BfIoParams(refine=False)).assign(state, waiting)
    refined = BfIoRank().assign(state, waiting)
    assert assignment_cost(state, waiting, plain) == 3 * 565 - 1321
    assert assignment_cost(state, waiting, refined) == 3 * 463 - 1321
    assert solve_round(state, waiting, admitted=range(5)).cost == 3 * 463 - 1321


def test_bf_io_lookahead_anticipates_a_completion() -> None:
    # Rank 0 holds 1000 tokens that finish next step; rank 1 holds 600 that stay.
    state = DPState.from_requests(2, 4, [0, 1], [1000, 600], remaining=[1, 50])
    waiting = Waiting(np.array([500]))
    assert BfIoRank().assign(state, waiting) == [(0, 1)]  # H = 0: least loaded now
    assert BfIoRank(BfIoParams(horizon=5)).assign(state, waiting) == [(0, 0)]
    with pytest.raises(ValueError, match="lookahead"):
        BfIoRank(BfIoParams(horizon=5)).assign(DPState.from_loads([1000, 600], [1, 1], 4), waiting)


def test_bf_io_pool_mode_chooses_which_requests_and_caps_the_wait() -> None:
    state = DPState.from_loads([1000, 600], running=[4, 3], slots=4)  # one free slot, on rank 1
    waiting = Waiting(np.array([50, 400, 390, 900]), waited=np.array([10, 0, 0, 0]))
    assert BfIoRank().assign(state, waiting) == [(0, 1)]  # FCFS admission: the oldest
    assert BfIoRank(BfIoParams(admit="pool")).assign(state, waiting) == [(1, 1)]  # fills 400 of room
    capped = BfIoRank(BfIoParams(admit="pool", max_wait_steps=5))
    assert capped.assign(state, waiting) == [(0, 1)]  # the overdue request goes first
    assert solve_round(state, waiting).pairs == [(1, 1)]


def test_params_are_validated_and_policies_built_by_name() -> None:
    with pytest.raises(ValidationError):
        BfIoParams(horizon=-1)
    with pytest.raises(ValidationError):
        BfIoParams(bogus=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        JsqParams(by="vibes")  # type: ignore[arg-type]
    assert registry.build(PolicyKind.RANK, "bf_io", {"horizon": 80}).params == BfIoParams(horizon=80)
    assert registry.build(PolicyKind.RANK, "bf_io", {"horizon": 3}).needs_requests
    assert not registry.build(PolicyKind.RANK, "bf_io").needs_requests
    with pytest.raises(PolicyError, match="available: bf_io, engine, fcfs, jsq"):
        registry.build(PolicyKind.RANK, "nope")

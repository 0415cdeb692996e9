"""A DP group's snapshot: projected loads over the lookahead, and inconsistent snapshots refused."""

from __future__ import annotations

import numpy as np
import pytest

from core.policies.rank.state import DPState, project_loads


def test_projection_drops_predicted_completions_and_grows_survivors() -> None:
    # rank 0: sizes 10 (1 step left) and 20 (3 left); rank 1: size 5 (5 left)
    state = DPState.from_requests(2, 4, [0, 0, 1], [10, 20, 5], remaining=[1, 3, 5])
    assert project_loads(state, 3).tolist() == [[30, 21, 22, 0], [5, 6, 7, 8]]
    blind = DPState.from_requests(2, 4, [0, 0, 1], [10, 20, 5])
    assert project_loads(blind, 3).tolist() == [[30, 32, 34, 36], [5, 6, 7, 8]]
    with pytest.raises(ValueError, match="lookahead"):
        project_loads(DPState.from_loads([30, 5], [2, 1], 4), 3)


def test_snapshots_reject_inconsistent_input() -> None:
    with pytest.raises(ValueError, match="slots"):
        DPState.from_loads([1, 2], [5, 0], slots=4)
    with pytest.raises(ValueError, match="add up"):
        DPState(np.array([10, 0]), np.array([1, 0]), np.array([4, 4]), np.array([0]), np.array([9]))
    with pytest.raises(ValueError, match=">= 1"):
        DPState.from_requests(1, 4, [0], [10], remaining=[0])

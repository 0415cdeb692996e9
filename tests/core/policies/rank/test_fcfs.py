"""Rank policy fcfs on hand-built states."""

from __future__ import annotations

import numpy as np

from core.policies.rank.fcfs import FcfsRank
from core.policies.rank.state import DPState, Waiting


def test_fcfs_fills_ranks_in_index_order_from_the_head_of_the_pool() -> None:
    state = DPState.from_loads([0, 0, 0], running=[2, 4, 3], slots=4)  # free 2, 0, 1
    assert FcfsRank().assign(state, Waiting(np.array([5, 6, 7, 8]))) == [(0, 0), (1, 0), (2, 2)]
    assert FcfsRank().assign(state, Waiting(np.array([5]))) == [(0, 0)]

"""Rank policy jsq on hand-built states."""

from __future__ import annotations

import numpy as np

from core.policies.rank.jsq import JsqParams, JsqRank
from core.policies.rank.state import DPState, Waiting


def test_jsq_sends_each_request_in_order_to_the_least_loaded_open_rank() -> None:
    state = DPState.from_loads([100, 50, 80], running=[3, 2, 3], slots=4)  # free 1, 2, 1
    waiting = Waiting(np.array([10, 30, 5, 7]))
    # by tokens: 10→r1 (60), 30→r1 (90, full), 5→r2 (85, full), 7→r0
    assert JsqRank().assign(state, waiting) == [(0, 1), (1, 1), (2, 2), (3, 0)]
    # by requests (running 3, 2, 3): r1 (→3), then all tie at 3: r0 (full), r1 (full), r2
    by_count = JsqRank(JsqParams(by="requests"))
    assert by_count.assign(state, waiting) == [(0, 1), (1, 0), (2, 1), (3, 2)]

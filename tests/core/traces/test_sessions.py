"""Sessions derived from hash ids, on hand-built rows."""

from __future__ import annotations

import numpy as np
import pytest

from core.traces import Trace
from core.traces.sessions import derive_sessions


def test_turns_join_the_conversation_they_extend_beyond_the_shared_system_prompt() -> None:
    rows = [
        [0, 1, 2],  # 0: conversation A, turn 1 (block 0 is the system prompt every row has)
        [0, 10, 11],  # 1: conversation B
        [0, 1, 2, 3, 4],  # 2: A, turn 2 (extends all of turn 1)
        [0, 20],  # 3: C: shares only the system prompt with everyone
        [0, 1, 5],  # 4: a branch of A after 2 blocks: still A
        [0, 10, 11, 12],  # 5: B, turn 2
        [0, 1, 2, 3, 4, 6, 7],  # 6: A, turn 3
        [],  # 7: no hash ids: a session of its own
        [9, 9],  # 8: D
    ]
    assert derive_sessions(rows).tolist() == [0, 1, 0, 3, 0, 1, 0, 7, 8]
    # a 1-block threshold merges everything that shares the system prompt
    assert derive_sessions(rows, 1).tolist() == [0, 0, 0, 0, 0, 0, 0, 7, 8]
    # 3 blocks: the 2-block branch (row 4) and the 2-block row 3 start their own
    assert derive_sessions(rows, 3).tolist() == [0, 1, 0, 3, 4, 1, 0, 7, 8]


def test_the_latest_row_with_the_longest_match_decides() -> None:
    rows = [[5, 6, 7], [8, 6, 7], [5, 6, 9], [5, 6, 7, 8]]
    # row 3 shares 3 blocks with row 0 and 2 with row 2: row 0's session
    assert derive_sessions(rows).tolist() == [0, 1, 0, 0]
    # a session outlives the row that started it: the chain goes through row 2's match
    rows = [[1, 2], [1, 2, 3], [4, 4], [1, 2, 3, 4]]
    assert derive_sessions(rows).tolist() == [0, 0, 2, 0]
    with pytest.raises(ValueError):
        derive_sessions(rows, 0)


def test_the_trace_carries_sessions_through_windows() -> None:
    t = Trace(
        "t",
        np.array([0.0, 1.0, 2.0, 3.0]),
        np.array([1000, 1000, 1500, 700]),
        np.full(4, 5),
        hash_ids=[[0, 1], [0, 2], [0, 1, 3], [0, 4]],
    )
    s = t.with_sessions()
    assert s.session is not None and s.session.tolist() == [0, 1, 0, 3]
    w = s.window(start=1.0)
    assert w.session is not None and w.session.tolist() == [1, 0, 3]
    assert Trace("u", np.zeros(1), np.full(1, 5), np.full(1, 5)).with_sessions().session is None
    with pytest.raises(Exception, match="session"):
        Trace("v", np.array([0.0, 1.0]), np.full(2, 5), np.full(2, 5), session=np.zeros(3))

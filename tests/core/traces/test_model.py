"""The Trace model on a hand-built trace: windows, time scaling and rates, requests and the summary, and the columns
it validates."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import TraceError
from core.traces import Trace
from core.types import Request


def _hand_trace() -> Trace:
    return Trace(
        name="hand",
        arrivals=np.array([0.0, 1.0, 2.0, 2.0, 5.0, 9.0]),
        prompt_tokens=np.array([10, 20, 30, 40, 50, 60]),
        output_tokens=np.array([1, 2, 3, 4, 5, 100]),
        slo_class=["a", "b", "a", "b", "a", "b"],
        priority=np.array([0, 1, 2, 3, 4, 5]),
        hash_ids=[[0], [1], [2], [3], [4], [5]],
        source="hand-made",
    )


def test_window_selects_rebases_and_limits() -> None:
    trace = _hand_trace()
    w = trace.window(1.0, 4.0)  # 1 <= t < 5
    assert w.arrivals.tolist() == [0.0, 1.0, 1.0]
    assert w.prompt_tokens.tolist() == [20, 30, 40]
    assert w.slo_class == ["b", "a", "b"]
    assert w.priority is not None and w.priority.tolist() == [1, 2, 3]
    assert w.hash_ids == [[1], [2], [3]]
    assert trace.window(1.0, 4.0, limit=2).prompt_tokens.tolist() == [20, 30]
    assert trace.window(4.5).arrivals.tolist() == [0.0, 4.0]  # no duration: to the end
    assert len(trace.window(9.5, 10.0)) == 0
    assert len(trace) == 6 and trace.arrivals[1] == 1.0  # the original is untouched


def test_scale_time_and_with_rate() -> None:
    trace = _hand_trace()
    assert trace.mean_rate() == pytest.approx(5 / 9)
    fast = trace.scale_time(0.5)
    assert fast.arrivals.tolist() == [0.0, 0.5, 1.0, 1.0, 2.5, 4.5]
    assert fast.mean_rate() == pytest.approx(10 / 9)
    assert np.array_equal(fast.output_tokens, trace.output_tokens)
    at2 = trace.with_rate(2.0)
    assert at2.mean_rate() == pytest.approx(2.0)
    assert at2.span_s == pytest.approx(2.5)
    assert np.allclose(at2.arrivals / at2.arrivals[-1], trace.arrivals / trace.arrivals[-1])
    with pytest.raises(TraceError):
        trace.scale_time(0.0)
    with pytest.raises(TraceError):
        trace.with_rate(-1.0)
    burst = Trace("burst", np.zeros(3), np.ones(3, dtype=np.int64), np.ones(3, dtype=np.int64))
    with pytest.raises(TraceError, match="same instant"):
        burst.with_rate(1.0)


def test_requests_and_summary() -> None:
    trace = _hand_trace()
    reqs = list(trace.requests("q"))
    assert len(reqs) == 6 and all(isinstance(r, Request) for r in reqs)
    assert reqs[5] == Request(id="q5", arrival=9.0, prompt_tokens=60, max_tokens=100, slo_class="b", priority=5)
    assert isinstance(reqs[0].prompt_tokens, int) and isinstance(reqs[0].arrival, float)
    plain = Trace("p", np.array([0.0, 1.0]), np.array([3, 4]), np.array([5, 6]))
    assert [(r.id, r.slo_class, r.priority) for r in plain.requests()] == [
        ("r0", "default", 0),
        ("r1", "default", 0),
    ]
    s = trace.summary()
    assert s["count"] == 6 and s["span_s"] == 9.0
    assert s["mean_rate"] == pytest.approx(5 / 9)
    assert s["prompt_mean"] == 35.0 and s["prompt_p50"] == 35.0 and s["prompt_max"] == 60
    assert s["output_max"] == 100 and s["output_p99"] == pytest.approx(5 + 0.95 * 95)
    empty = trace.window(100.0)
    assert empty.summary()["count"] == 0 and empty.summary()["output_max"] == 0


def test_trace_validates_its_columns() -> None:
    with pytest.raises(TraceError, match="prompt_tokens"):
        Trace("x", np.array([0.0, 1.0]), np.array([1]), np.array([1, 1]))
    with pytest.raises(TraceError, match="not sorted"):
        Trace("x", np.array([1.0, 0.0]), np.array([1, 1]), np.array([1, 1]))
    with pytest.raises(TraceError, match=">= 1"):
        Trace("x", np.array([0.0, 1.0]), np.array([1, 0]), np.array([1, 1]))

"""The advisor's window: a constructed live run in a real SQLite run store, read back as the simulator's input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adapters.store import RunStore
from console.advisor.window import RecentArrivals, WindowError, window_from_store


def row(rid: str, arrival: float, finish: float | None, **over: Any) -> dict[str, Any]:
    base = {
        "request_id": rid,
        "arrival": arrival,
        "prompt_tokens": 100,
        "output_tokens": 10,
        "max_tokens": 50,
        "status": "ok",
        "prefill_start": arrival + 0.01,
        "first_token": arrival + 0.2,
        "finish": finish,
        "ttft": 0.2,
        "tpot": 0.02,
        "slo_met": True,
        "cached_tokens": 0,
        "slo_class": "default",
        "tenant": "default",
        "priority": 0,
    }
    return {**base, **over}


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    return RunStore(tmp_path / "runs.db")


def live_run(store: RunStore) -> str:
    run = store.create_run(
        kind="live",
        backend="emulator",
        cluster="2P3D",
        policy="least_load",
        config={
            "policy": "least_load",
            "params": {},
            "queue": {"name": "fcfs", "params": {"max_queued": 64}},
            "slo": {"default": {"name": "default", "ttft_s": 1.0, "tpot_s": 0.1}, "batch": {"ttft_s": 10.0}},
        },
    )
    store.add_requests(
        run,
        [
            row("old", 10.0, 20.0),  # finished before the window: left out
            row("early", 95.0, 130.0, prompt_tokens=400),  # in flight at the window's start (100 s)
            row("a", 110.0, 112.0, ttft=0.1, tpot=0.01, cached_tokens=50, tenant="acme", slo_class="batch"),
            row("b", 150.0, 151.0, ttft=0.3, tpot=0.03, cached_tokens=25, priority=2),
            row("c", 160.0, 170.0, ttft=2.5, tpot=0.05, slo_met=False, cached_tokens=None),
            row(
                "shed", 180.0, 180.0, status="failed", reason="queue full", output_tokens=0, prefill_start=None,
                first_token=None, ttft=None, tpot=None, slo_met=False, cached_tokens=None,
            ),
        ],
    )
    store.add_policy_event(run, t=0.0, kind="routing", old=None, new="least_load", params={}, source="config")
    store.add_policy_event(run, t=0.0, kind="queue", old=None, new="fcfs", params={"max_queued": 64}, source="config")
    store.add_policy_event(run, t=50.0, kind="routing", old="least_load", new="sibyl", params={"unit": "tokens"},
                           source="api")
    return run


def test_the_window_holds_its_arrivals_and_the_requests_in_flight_at_its_start(store: RunStore) -> None:
    run = live_run(store)
    keys = RecentArrivals()
    keys.note("a", [1, 2, 3], "conv-1")
    keys.note("b", [1, 2, 9], "conv-1")
    keys.note("early", [7], "")
    w = window_from_store(store, run, 100.0, end=200.0, keys=keys)
    assert (w.start, w.end, w.cluster) == (100.0, 200.0, "2P3D")
    assert w.request_ids == ["early", "a", "b", "c", "shed"]
    assert w.measured.tolist() == [False, True, True, True, True] and w.in_flight == 1
    assert w.arrivals.tolist() == [0.0, 15.0, 55.0, 65.0, 85.0]  # from the first replayed arrival
    assert w.prompt_tokens.tolist() == [400, 100, 100, 100, 100]
    assert w.output_tokens.tolist() == [10, 10, 10, 10, 50]  # a refused request: its max_tokens
    assert w.slo_classes == ["default", "batch", "default", "default", "default"]
    assert w.tenants[1] == "acme" and w.priorities.tolist() == [0, 0, 2, 0, 0]
    assert w.slos["batch"].ttft_s == 10.0 and w.slos["default"].ttft_s == 1.0
    assert w.prefix_keys == [(7,), (1, 2, 3), (1, 2, 9), (), ()]
    assert w.sessions == ["early", "conv-1", "conv-1", "c", "shed"]  # no session noted: its own id
    assert w.notes == ["2 of 5 requests had no prefix keys noted (forgotten or never keyed)"]
    # the routing swap at 50 s is before the window: sibyl is what ran in it, the queue is the configured one
    assert w.active == {"routing": ("sibyl", {"unit": "tokens"}), "queue": ("fcfs", {"max_queued": 64})}
    assert not w.swapped


def test_observed_figures_are_the_stored_rows_of_the_window(store: RunStore) -> None:
    w = window_from_store(store, live_run(store), 100.0, end=200.0)
    o = w.observed
    assert o.requests == 4 and o.refusals == 1
    assert o.ttft_p50 == pytest.approx(0.3) and o.ttft_p99 == pytest.approx(np.percentile([0.1, 0.3, 2.5], 99))
    assert o.tpot_p50 == pytest.approx(0.03) and o.tpot_p99 == pytest.approx(np.percentile([0.01, 0.03, 0.05], 99))
    assert o.attainment == pytest.approx(0.5)  # a and b met; c missed; the refused one missed
    assert o.prefix_hit_rate == pytest.approx(75 / 200)  # over the rows that report cached tokens
    assert w.prefix_keys is None and w.sessions is None  # no keys noted: no prefix structure


def test_a_swap_inside_the_window_marks_its_observed_figures_mixed(store: RunStore) -> None:
    run = live_run(store)
    store.add_policy_event(run, t=155.0, kind="queue", old="fcfs", new="priority", params={}, source="api")
    w = window_from_store(store, run, 100.0, end=200.0)
    assert w.swapped and w.active["queue"] == ("priority", {})
    assert not window_from_store(store, run, 40.0, end=200.0).swapped  # [160, 200]: after it


def test_the_end_defaults_to_the_runs_last_record_and_bad_windows_are_errors(store: RunStore) -> None:
    run = live_run(store)
    assert window_from_store(store, run, 30.0).end == 180.0
    with pytest.raises(WindowError, match="no recorded arrivals"):
        window_from_store(store, run, 5.0, end=300.0)
    with pytest.raises(WindowError, match="window_s must be > 0"):
        window_from_store(store, run, 0.0)
    with pytest.raises(WindowError, match="unknown run"):
        window_from_store(store, "r-nope", 30.0)


def test_recent_arrivals_forget_the_oldest_past_their_capacity() -> None:
    keys = RecentArrivals(capacity=2)
    for i in range(3):
        keys.note(f"r{i}", [i], f"s{i}")
    assert len(keys) == 2 and keys.get("r0") is None
    got = keys.get("r2")
    assert got is not None and got.prefix_keys == (2,) and got.session == "s2"

"""The advisor's window: a constructed live run in a real SQLite run store, read back as the simulator's input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adapters.redact import redact_config
from adapters.store import RunStore
from console.advisor.simulate import Shape, predict, simulate
from console.advisor.window import (
    RecentArrivals,
    WindowError,
    estimated_outputs,
    window_from_rows,
    window_from_store,
)
from console.live.config import ConsoleConfig
from console.live.pools import cluster_label, plan_pools
from core.perf import get_profile
from core.slo import SLOClass


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
    assert got is not None and got.prefix_keys == (2,) and got.session == "s2" and got.max_tokens_set
    keys.note("r3", [3], "", max_tokens_set=False)
    noted = keys.subset(["r3"]).get("r3")
    assert noted is not None and not noted.max_tokens_set


def in_flight(rid: str, arrival: float, **over: Any) -> dict[str, Any]:
    """A request in the gateway at the window's end, as the live advisor reads it (nothing measured yet)."""
    base = {
        "request_id": rid,
        "arrival": arrival,
        "prompt_tokens": 200,
        "max_tokens": 16,
        "max_tokens_set": True,
        "output_tokens": 0,
        "slo_class": "default",
        "tenant": "default",
        "priority": 0,
    }
    return {**base, **over}


def finished_rows() -> list[dict[str, Any]]:
    return [
        row("early", 95.0, 130.0, prompt_tokens=400),
        row("a", 110.0, 112.0, output_tokens=10),
        row("b", 150.0, 151.0, output_tokens=20),
        row("c", 160.0, 170.0, output_tokens=33),
        row("shed", 180.0, 180.0, status="failed", output_tokens=0, prefill_start=None, ttft=None, tpot=None),
    ]


def test_requests_still_in_flight_at_the_windows_end_are_replayed_unmeasured_with_an_estimated_output() -> None:
    keys = RecentArrivals()
    keys.note("long", [4, 5], "conv-2")
    gateway = [
        in_flight("lingering", 90.0, max_tokens_set=False, output_tokens=25),  # in flight across the whole window
        in_flight("long", 190.0, max_tokens=300, output_tokens=40),  # its client set max_tokens: that bound
        in_flight("chat", 195.0, max_tokens_set=False, tenant="acme", slo_class="batch", priority=1),
        in_flight("c", 160.0),  # finished meanwhile: the stored row counts, not this one
        in_flight("after", 201.0),  # arrived after the window's end
    ]
    active = {"routing": ("least_load", {}), "queue": ("fcfs", {})}
    w = window_from_rows(
        finished_rows(), run_id="r", end=200.0, window_s=100.0, active=active, keys=keys, in_flight=gateway
    )
    assert w.request_ids == ["lingering", "early", "a", "b", "c", "shed", "long", "chat"]
    assert w.arrivals.tolist() == [0.0, 5.0, 20.0, 60.0, 70.0, 90.0, 100.0, 105.0]
    # the finished ok arrivals generated (10 + 20 + 33) / 3 = 21 tokens on average: what a request without
    # max_tokens is replayed with, unless it has generated more already (lingering: 25 so far)
    assert w.output_tokens.tolist() == [25, 10, 10, 20, 33, 50, 300, 21]
    assert w.prompt_tokens.tolist() == [200, 400, 100, 100, 100, 100, 200, 200]
    assert w.measured.tolist() == [False, False, True, True, True, True, False, False]
    assert w.unfinished is not None and w.unfinished.tolist() == [True, False, False, False, False, False, True, True]
    assert (w.in_flight, w.in_flight_at_end) == (2, 3)
    assert w.tenants[-1] == "acme" and w.slo_classes[-1] == "batch" and w.priorities.tolist()[-1] == 1
    assert w.prefix_keys is not None and w.prefix_keys[6] == (4, 5) and w.sessions is not None
    assert w.sessions[6] == "conv-2" and w.sessions[7] == "chat"
    assert w.observed.requests == 4  # the figures need finished requests
    assert w.summary()["in_flight_at_end"] == 3 and w.summary()["in_flight_at_start"] == 2
    assert w.notes[-1] == (
        "3 requests in flight at the window's end are replayed unmeasured, 1 with their max_tokens and 2 with "
        "the window's mean output (21 tokens: their clients set no max_tokens)"
    )
    without = window_from_rows(finished_rows(), run_id="r", end=200.0, window_s=100.0, active=active)
    assert without.request_ids == ["early", "a", "b", "c", "shed"] and without.in_flight_at_end == 0
    assert without.observed == w.observed


def test_the_output_estimate_falls_back_to_max_tokens_when_nothing_finished_ok() -> None:
    gateway = [in_flight("x", 1.0, max_tokens_set=False, max_tokens=16), in_flight("y", 2.0, max_tokens=64)]
    assert estimated_outputs(gateway, []) == ([16, 64], None)
    assert estimated_outputs(gateway, [row("a", 0.0, 1.0, output_tokens=7), row("f", 0.0, 1.0, status="failed")]) == (
        [7, 64],
        7,
    )
    active = {"routing": ("least_load", {}), "queue": ("fcfs", {})}
    with pytest.raises(WindowError, match=r"no recorded arrivals in \[100.0, 200.0\] s \(2 arrived in it and are"):
        window_from_rows(
            [row("old", 10.0, 20.0)], run_id="r", end=200.0, window_s=100.0, active=active,
            in_flight=[in_flight("x", 150.0), in_flight("y", 160.0)],
        )


OVERLOAD = {"routing": ("least_load", {}), "queue": ("fcfs", {})}
OVERLOAD_SLO = {"default": SLOClass(ttft_s=0.5, tpot_s=0.1)}


def overloaded_run(end: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A 1P1D H100 cluster past its prefill capacity (6 arrivals/s of 4 000-token prompts, 0.14 s of prefill
    each), every other request generating 2 000 tokens: what the live cluster did, taken from the simulator
    on every arrival up to `end` (its ground truth), cut at `end` into the finished requests' stored rows and
    the requests still in flight (their max_tokens set to their true length)."""
    rng = np.random.default_rng(2)
    times = np.cumsum(rng.exponential(1 / 6, 200))
    times = (times - times[0])[times - times[0] <= end]
    outputs = [2000 if k % 2 else 8 for k in range(len(times))]
    every = [
        row(f"r{k:03d}", float(t), float(t) + 1.0, prompt_tokens=4000, output_tokens=n, max_tokens=n)
        for k, (t, n) in enumerate(zip(times, outputs, strict=True))
    ]
    whole = window_from_rows(every, run_id="truth", end=1e9, window_s=2e9, active=OVERLOAD, slos=OVERLOAD_SLO)
    truth = simulate(whole, Shape(1, 1), get_profile("roofline-h100-qwen2.5-7b"), *OVERLOAD.values())
    finished, gateway = [], []
    for k, r in enumerate(every):
        first, finish = float(truth.first_token[k]), float(truth.finish[k])
        if finish <= end:
            ttft, tpot = first - r["arrival"], (finish - first) / (r["output_tokens"] - 1)
            met = ttft <= 0.5 and tpot <= 0.1
            finished.append({**r, "first_token": first, "finish": finish, "ttft": ttft, "tpot": tpot, "slo_met": met})
        else:
            gateway.append(in_flight(r["request_id"], r["arrival"], prompt_tokens=4000, max_tokens=r["max_tokens"]))
    return finished, gateway


def test_in_flight_requests_bring_the_predicted_p99_ttft_of_an_overloaded_window_to_the_observed_one() -> None:
    finished, gateway = overloaded_run(30.0)
    assert len(gateway) > 50 and len(finished) > 50  # half the long ones still decode, the queue still holds some
    profile = get_profile("roofline-h100-qwen2.5-7b")
    args: dict[str, Any] = {"run_id": "r", "end": 30.0, "window_s": 30.0, "active": OVERLOAD, "slos": OVERLOAD_SLO}
    with_them = window_from_rows(finished, **args, in_flight=gateway)
    without = window_from_rows(finished, **args)
    observed = with_them.observed.ttft_p99
    assert observed is not None and observed > 0.5 and with_them.observed == without.observed
    predicted = predict(with_them, Shape(1, 1), profile, *OVERLOAD.values()).ttft_p99
    blind = predict(without, Shape(1, 1), profile, *OVERLOAD.values()).ttft_p99
    assert predicted is not None and blind is not None
    # replayed with their true lengths, the window is the live run: the prediction is the observed P99
    assert predicted == pytest.approx(observed, rel=0.01)
    assert blind < 0.7 * observed  # without them half the prefill load is missing
    # clients that set no max_tokens: the window's mean output stands in, and the prefill load is all there
    guessed = [{**r, "max_tokens": 16, "max_tokens_set": False} for r in gateway]
    estimated = predict(window_from_rows(finished, **args, in_flight=guessed), Shape(1, 1), profile,
                        *OVERLOAD.values()).ttft_p99
    assert estimated is not None and abs(estimated - observed) < abs(blind - observed)


def test_with_several_pools_only_the_first_pools_swaps_are_its_active_policies() -> None:
    """The advisor simulates the first pool: a swap on another pool neither sets its policy nor counts as its swap."""
    from console.advisor.window import active_policies

    events = [
        {"t": 0.0, "kind": "routing", "new": "round_robin", "params": {}, "source": "config", "pool": "A"},
        {"t": 0.0, "kind": "routing", "new": "round_robin", "params": {}, "source": "config", "pool": "B"},
        {"t": 5.0, "kind": "routing", "new": "least_load", "params": {}, "source": "cli", "pool": "B"},
        {"t": 7.0, "kind": "queue", "new": "priority", "params": {}, "source": "cli", "pool": "A"},
    ]
    active, swaps = active_policies(events, {}, "round_robin", at=10.0)
    assert active["routing"] == ("round_robin", {}) and active["queue"] == ("priority", {}) and swaps == [7.0]
    legacy = [{**e, "pool": None} for e in events]  # stored before pools were recorded: every event counts
    active, swaps = active_policies(legacy, {}, "round_robin", at=10.0)
    assert active["routing"] == ("least_load", {}) and swaps == [5.0, 7.0]


def two_pool_run(store: RunStore) -> str:
    """A live run of pools A (model A, 1P2D) and b (model org/B, 2P3D), recorded as `up` records one: its
    configuration and cluster label, each request's base model, each pool's policy events."""
    config = ConsoleConfig.model_validate(
        {
            "policy": "round_robin",
            "pools": [
                {"model": "A", "prefill": 1, "decode": 2},
                {"model": "org/B", "name": "b", "prefill": 2, "decode": 3},
            ],
        }
    )
    run = store.create_run(
        kind="live",
        backend="emulator",
        cluster=cluster_label(plan_pools(config)),
        policy=config.policy,
        config=redact_config(config.model_dump(mode="json")),
    )
    store.add_requests(
        run,
        [
            row("a1", 110.0, 112.0, model="A"),
            row("b1", 120.0, 121.0, model="org/B", prompt_tokens=300),
            row("a2", 130.0, 190.0, model="A"),
            row("b2", 140.0, 150.0, model="org/B", prompt_tokens=300),
            row("unknown", 145.0, 146.0),  # no model recorded (a row from before schema 9): either pool's
        ],
    )
    for pool in ("A", "b"):
        store.add_policy_event(run, t=0.0, kind="routing", old=None, new="round_robin", params={}, source="config",
                               pool=pool)
    store.add_policy_event(run, t=50.0, kind="routing", old="round_robin", new="least_load", params={}, source="api",
                           pool="b")
    store.add_policy_event(run, t=135.0, kind="queue", old="fcfs", new="priority", params={}, source="api", pool="A")
    return run


def test_with_several_pools_the_window_is_one_pools_requests_shape_and_policies(store: RunStore) -> None:
    run = two_pool_run(store)
    first = window_from_store(store, run, 100.0, end=200.0)  # no pool named: the first, as the live advisor's
    assert first.request_ids == ["a1", "a2", "unknown"] and first.cluster == "1P2D"
    assert first.active == {"routing": ("round_robin", {}), "queue": ("priority", {})} and first.swapped
    b = window_from_store(store, run, 100.0, end=200.0, pool="b")
    assert b.request_ids == ["b1", "b2", "unknown"] and b.cluster == "2P3D"
    assert b.prompt_tokens.tolist() == [300, 300, 100]
    # b's swap at 50 s is before the window and A's at 135 s is not b's: one policy, b's own
    assert b.active == {"routing": ("least_load", {}), "queue": ("fcfs", {})} and not b.swapped
    assert window_from_store(store, run, 100.0, pool="b").end == 150.0  # the end: b's last record, not the run's
    with pytest.raises(WindowError, match=r"has no pool 'B'; pools: A, b$"):
        window_from_store(store, run, 100.0, end=200.0, pool="B")


def test_a_run_of_one_pool_or_none_is_one_window_and_another_pool_is_an_error(store: RunStore) -> None:
    config = ConsoleConfig(policy="least_load")  # one pool, named after its served model
    one = store.create_run(kind="live", backend="emulator", cluster="1P1D", policy="least_load",
                           config=redact_config(config.model_dump(mode="json")))
    store.add_requests(one, [row("x", 10.0, 11.0, model="sibyl-model"), row("y", 12.0, 13.0)])
    named = window_from_store(store, one, 100.0, pool="sibyl-model")
    assert named.request_ids == window_from_store(store, one, 100.0).request_ids == ["x", "y"]
    assert named.cluster == "1P1D"
    with pytest.raises(WindowError, match=r"has no pool 'b'; pools: sibyl-model$"):
        window_from_store(store, one, 100.0, pool="b")
    with pytest.raises(WindowError, match=r"has no pool 'b'; it recorded no pools$"):
        window_from_store(store, live_run(store), 100.0, pool="b")  # a run that recorded no pools

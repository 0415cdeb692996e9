"""The controller's wiring without a network: its state keeps the shape clients read, swaps, the request host."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from adapters.store import RunStore
from console.live.channel import ClientChannel
from console.live.config import ConsoleConfig
from console.live.controller import Controller
from console.live.record import Outcome, Step
from core.errors import PolicyError
from core.types import InstancePhase, Role
from tests.console.live.fakes import LEGACY_ROW_KEYS, FakeBackend, Sent, instances, live_request, never_disconnects

LEGACY_KEYS = [
    "run_id",
    "backend",
    "cluster",
    "model",
    "uptime_s",
    "started_at",
    "instances",
    "policies",
    "slo",
    "requests",
    "queue",
    "assignment_ratio",
    "draining",
    "replay",
    "capabilities",
]
"""The keys of `/control/state` before the state was typed, in their order."""


def controller(tmp_path: Path) -> Controller:
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run(kind="live", backend="fake", cluster="1P2D", workload="", policy="round_robin", config={})
    return Controller(
        ConsoleConfig(policy="round_robin"),
        instances(1, 2),
        store=store,
        run_id=run_id,
        run_dir=tmp_path / run_id,
        backend=FakeBackend(),
    )  # type: ignore[arg-type]


def test_the_state_has_the_keys_clients_read(tmp_path: Path) -> None:
    c = controller(tmp_path)
    c.dispatcher.add_instance("d2", Role.DECODE, phase=InstancePhase.STARTING)
    state = c.state()
    # added: prefix (the prefix-cache index), tenants (keys and per-tenant limits of /v1), pools (one per base model)
    assert list(state) == [*LEGACY_KEYS[:14], "prefix", LEGACY_KEYS[14], "tenants", "pools"]
    assert list(state["pools"]) == ["sibyl-model"] and state["pools"]["sibyl-model"]["instances"] == ["d0", "d1", "p0"]
    assert state["tenants"]["required"] is False and list(state["tenants"]["tenants"]) == ["default"]
    assert state["prefix"]["source"] == "approximate" and state["prefix"]["events"] == {}
    assert state["cluster"] == "1P2D" and state["capabilities"] == {"replay": False} and state["replay"] is None
    rows = {r["id"]: r for r in state["instances"]}
    assert list(rows) == ["p0", "d0", "d1", "d2"]
    added = ["prefix_hit_rate", "cached_share"]  # added after the typed state: the instance's prefix cache
    calibrated = ["backlog_s", "calibration"]  # added: the prefill backlog admission judges by, the online fit
    pooled = ["pool", "adapters"]  # added: its pool (one per base model), the LoRA adapters loaded on it
    assert list(rows["d0"]) == [*LEGACY_ROW_KEYS[:11], *added, *LEGACY_ROW_KEYS[11:], *calibrated, *pooled] and list(
        rows["d0"]["scraped"]
    ) == [
        "prompt_tokens_total",
        "generation_tokens_total",
        "success_total",
        "preemptions_total",
        "failed_transfers_total",
    ]
    assert "breaker" not in rows["d2"] and rows["d2"]["phase"] == "starting" and rows["d2"]["scraped"] == {}
    assert list(state["slo"]) == ["classes", "window_s", "window", "run"] and "goodput_req_s" not in state["slo"]["run"]
    assert state["slo"]["classes"]["default"] == {"name": "default", "ttft_s": 2.0, "tpot_s": 0.1}
    assert list(state["queue"]) == [
        "depth",
        "by_class",
        "max_queued",
        "max_in_flight_per_instance",
        "ttl_s",
        "admission",
        "refusals",
    ]  # admission, refusals: added (SLO admission, its refusals by cause)
    assert list(state["policies"]) == ["routing", "queue", "reschedule", "scaling", "rank"]
    c.recorder.close(status="completed")


def test_a_policy_swap_is_stored_published_and_refused_when_unknown(tmp_path: Path) -> None:
    c = controller(tmp_path)
    ev = c.set_policy("routing", "least_load", {"by": "tokens"}, source="cli")
    assert (ev.old, ev.new) == ("round_robin", "least_load")
    assert c.events.history[-1]["type"] == "policy" and c.events.history[-1]["source"] == "cli"
    assert c.snapshot().policies["routing"].params["by"] == "tokens"
    with pytest.raises(PolicyError, match="unknown policy kind"):
        c.set_policy("nonsense", "x", None, source="cli")
    with pytest.raises(PolicyError, match="cannot do"):  # a scaling policy the fake backend cannot carry out
        c.set_policy("scaling", "threshold", None, source="cli")
    c.recorder.close(status="completed")


def test_a_request_through_the_wired_parts_is_counted_then_recorded(tmp_path: Path) -> None:
    """A request the controller's services serve (no instance is reachable: every leg fails): counted in
    flight while it runs, then its end told to the dispatcher, the outcomes, the queue and its tenant."""

    async def body() -> None:
        c = controller(tmp_path)
        live = live_request("r1")
        seen: list[tuple[int, int, list[str]]] = []
        started = c.outcomes.started

        def counting(record: object) -> None:
            started(record)  # type: ignore[arg-type]
            seen.append((c.outcomes.in_flight, c.outcomes.total, list(c.outcomes.live)))

        c.services.outcomes.started = counting  # type: ignore[method-assign]
        for inst in c.instances.values():
            inst.open(connect_timeout_s=1.0)
        try:
            sent = Sent()
            await live.run(c.services, ClientChannel(sent, never_disconnects))
        finally:
            for inst in c.instances.values():
                await inst.close()
        assert seen == [(1, 1, ["r1"])]
        rec = live.record
        assert rec.step == Step.FAILED and rec.outcome is Outcome.UPSTREAM and sent.status == 502
        assert (c.outcomes.in_flight, c.outcomes.failed, dict(c.outcomes.live)) == (0, 1, {})
        assert c.dispatcher.in_flight("d0") == 0 and c.dispatcher.in_flight("p0") == 0  # the request told its end
        assert c.state()["requests"] == {"in_flight": 0, "total": 1, "failed": 1}
        assert c.state()["tenants"]["tenants"]["default"]["requests"]["failed"] == 1
        assert c.summary()["requests_total"] == 1 and "pools" not in c.summary()  # one pool: as before pools
        assert c.recent.rows[-1]["request_id"] == "r1" and c.recent.rows[-1]["status"] == "failed"
        c.recorder.close(status="completed")

    asyncio.run(body())


def test_instance_listeners_reach_the_parts_subscribed_at_wiring(tmp_path: Path) -> None:
    async def body() -> None:
        c = controller(tmp_path)
        lost = c.health.lost_signal("d1")
        c.listeners.removed("d1")  # the scaler retired it
        assert lost.done()
        c.recorder.close(status="completed")

    asyncio.run(body())

"""A canary's life in a controller without a network: arms fed with a known difference end it by the rule (a
promotion swaps the candidate in with source canary, in the canary's pool; the autopilot's gate can hold it; rows of
another pool never enter the arms), and the autopilot's decisions on constructed advice."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from console.advisor.autopilot import Autopilot
from tests.console.advisor.fakes import advice, controller, two_pool_controller


def feed(  # type: ignore[no-untyped-def]
    c, arm: str, ttft: np.ndarray, started_rel: float, model: str | None = None
) -> None:
    for k, t in enumerate(ttft.tolist()):
        c.finished.request(
            {"request_id": f"{model or ''}{arm}{k}", "arm": arm, "arrival": started_rel + 1.0,
             "finish": started_rel + 2.0, "status": "ok", "ttft": t, "tpot": 0.02, "slo_met": True, "model": model}
        )


def test_a_canary_whose_arm_is_faster_is_promoted_as_a_swap_with_source_canary(tmp_path: Path) -> None:
    c = controller(tmp_path)
    rng = np.random.default_rng(3)

    async def life() -> dict:  # type: ignore[type-arg]
        started = await c.canary.start("routing", "least_load", {}, "10%", 0.05, source="api")
        feed(c, "canary", rng.lognormal(np.log(0.1), 0.3, 400), started["started_t"])
        feed(c, "control", rng.lognormal(np.log(0.2), 0.3, 2000), started["started_t"])
        time.sleep(0.06)
        reading = await c.canary.read()
        assert reading is not None and reading.decision == "promote", reading
        return c.canary.snapshot()

    snap = asyncio.run(life())
    assert snap["running"] is None and snap["last"]["decision"] == "promote"
    assert snap["last"]["swapped"] == {"kind": "routing", "old": "round_robin", "new": "least_load"}
    assert c.dispatcher.routing.name == "least_load" and c.dispatcher.canary is None
    assert c.dispatcher.policy_events[-1].source == "canary"
    c.recorder.close()
    events = [e["event"] for e in c.store.advisor_events(c.run_id)]
    assert events == ["canary_start", "canary_reading", "canary_end"]


def test_a_canary_on_pool_b_reads_b_only_and_promotes_in_b(tmp_path: Path) -> None:
    c = two_pool_controller(tmp_path)
    a, b = c.runtimes
    rng = np.random.default_rng(5)

    async def life() -> dict:  # type: ignore[type-arg]
        started = await c.canary.start("routing", "least_load", {}, "10%", 0.05, source="api", pool="b")
        t = started["started_t"]
        # pool A's rows (model A) carrying an arm, as a row could only if it ran on a pool with a canary: left out,
        # else their slow canary arm would turn the verdict
        feed(c, "canary", rng.lognormal(np.log(2.0), 0.3, 2000), t, model="A")
        feed(c, "canary", rng.lognormal(np.log(0.1), 0.3, 400), t, model="org/B")
        feed(c, "control", rng.lognormal(np.log(0.2), 0.3, 2000), t, model="org/B")
        assert c.canary.current is not None and len(c.canary.current.arms["canary"]) == 400
        time.sleep(0.06)
        reading = await c.canary.read()
        assert reading is not None and reading.decision == "promote", reading
        return c.canary.snapshot()

    snap = asyncio.run(life())
    last = snap["last"]
    assert last["pool"] == "b" and last["decision"] == "promote"
    assert last["finished"] == {"canary": 400, "control": 2000}
    assert b.dispatcher.routing.name == "least_load" and a.dispatcher.routing.name == "round_robin"
    assert b.dispatcher.policy_events[-1].source == "canary" and b.dispatcher.canary is None
    c.recorder.close()
    swaps = [(e["pool"], e["new"], e["source"]) for e in c.store.policy_events(c.run_id) if e["source"] == "canary"]
    assert swaps == [("b", "least_load", "canary")]


def test_the_autopilots_gate_holds_a_promotion_past_its_swaps_per_hour(tmp_path: Path) -> None:
    c = controller(tmp_path)
    rng = np.random.default_rng(4)
    pilot = Autopilot("auto", share=0.1, duration_s=60, cooldown_s=0, max_swaps_per_hour=0)

    async def life() -> None:
        started = await c.canary.start(
            "routing", "least_load", {}, 0.1, 0.05, source="advisor", promote=lambda: pilot.may_promote(0.0)
        )
        feed(c, "canary", rng.lognormal(np.log(0.1), 0.3, 400), started["started_t"])
        feed(c, "control", rng.lognormal(np.log(0.2), 0.3, 2000), started["started_t"])
        time.sleep(0.06)
        await c.canary.read()

    asyncio.run(life())
    last = c.canary.last
    assert last is not None and last["decision"] == "promote" and last["swapped"] is None
    assert "not promoted: 0 automatic swaps in the last hour (max_swaps_per_hour = 0)" in last["reason"]
    assert c.dispatcher.routing.name == "round_robin"
    c.recorder.close()


def test_the_autopilot_starts_a_canary_after_two_advices_in_a_row_then_cools_down() -> None:
    pilot = Autopilot("canary", share=0.1, duration_s=300, cooldown_s=600, max_swaps_per_hour=2)
    action, why = pilot.consider(advice(0.3, 0.1, True), 0.0, canary_running=False)
    assert action is None and "1 of 2 advices in a row" in why and "+30.0% on P99 TTFT" in why and "10.0%" in why
    action, why = pilot.consider(advice(0.3, 0.1, True), 30.0, canary_running=False)
    assert action is not None and action.name == "prefix_aware" and action.share == 0.1 and why.startswith("canary:")
    pilot.quiet(40.0)
    pilot.consider(advice(0.3, 0.1, True), 60.0, canary_running=False)
    action, why = pilot.consider(advice(0.3, 0.1, True), 90.0, canary_running=False)
    assert action is None and "cooling down for 550 s more" in why
    action, why = pilot.consider(advice(0.05, 0.1, False), 700.0, canary_running=False)
    assert action is None and why.startswith("keep the active policies") and pilot.streak == 0
    assert pilot.may_promote(700.0) == "apply = canary: the swap is left to the operator"
    suggest = Autopilot("suggest", share=0.1, duration_s=300, cooldown_s=0, max_swaps_per_hour=2)
    for t in (0.0, 30.0, 60.0):
        action, why = suggest.consider(advice(0.3, 0.1, True), t, canary_running=False)
        assert action is None and why.startswith("suggest routing:prefix_aware")
    auto = Autopilot("auto", share=0.1, duration_s=300, cooldown_s=0, max_swaps_per_hour=1)
    assert auto.may_promote(0.0) is None and auto.may_promote(10.0) is not None and auto.may_promote(3601.0) is None

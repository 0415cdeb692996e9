"""A policy canary's /metrics series, read through the gateway's real /metrics route on a controller without a
network: absent before the first canary, each arm's figures while one runs (hand-computed from the rows fed to it),
the verdicts counted by outcome once canaries end, and the series labelled with the canary's own pool."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from console.gateway.app import build_app
from console.live.canary import VERDICTS
from console.live.controller import Controller
from tests.console.advisor.fakes import controller, two_pool_controller

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def call(c: Controller, method: str, path: str, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(c, manage_lifecycle=False))
        async with httpx.AsyncClient(transport=transport, base_url="http://console") as http:
            return await http.request(method, path, headers={"Authorization": f"Bearer {c.token}"}, **kw)

    return asyncio.run(go())


def scrape(c: Controller) -> Samples:
    """Every sibyl_canary_* sample of GET /metrics, by name and labels."""
    r = call(c, "GET", "/metrics")
    assert r.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
        if s.name.startswith("sibyl_canary_")
    }


def arm_row(arm: str | None, k: int, arrival: float, **over: Any) -> dict[str, Any]:
    row = {"request_id": f"{arm}{k}", "arm": arm, "arrival": arrival, "finish": arrival + 1.0, "status": "ok",
           "ttft": 0.1, "tpot": 0.02, "slo_met": True}
    return {**row, **over}


def test_the_running_canary_its_arms_and_its_verdicts_are_metrics(tmp_path: Path) -> None:
    c = controller(tmp_path)
    pool = c.runtimes[0].pool.name
    before = scrape(c)
    assert before == {("sibyl_canary_verdicts_total", (("outcome", v),)): 0.0 for v in VERDICTS}

    body = {"kind": "routing", "name": "least_load", "params": {}, "share": "25%", "duration_s": 600}
    started = call(c, "POST", "/control/canary", json=body).json()
    t = started["started_t"] + 1.0
    canary_ttft = [0.1, 0.2, 0.3, 0.4]
    for k, ttft in enumerate(canary_ttft):
        c.finished.request(arm_row("canary", k, t, ttft=ttft, tpot=0.01 * (k + 1), slo_met=ttft < 0.35))
    control_ttft = [0.5, 0.7]
    for k, ttft in enumerate(control_ttft):
        c.finished.request(arm_row("control", k, t, ttft=ttft, tpot=0.05))
    c.finished.request(arm_row("control", 9, t, status="failed", ttft=None, tpot=None, slo_met=False))
    c.finished.request(arm_row("control", 10, started["started_t"] - 5.0))  # arrived before the canary: not an arm's
    c.finished.request(arm_row(None, 11, t))  # routed by no arm

    got = scrape(c)
    on = (("candidate", "least_load"), ("kind", "routing"), ("pool", pool))

    def arm(name: str, value: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted((*on, ("arm", value))))

    assert got[("sibyl_canary_running", on)] == 1.0 and got[("sibyl_canary_share", on)] == 0.25
    assert got[arm("sibyl_canary_arm_requests", "canary")] == 4
    assert got[arm("sibyl_canary_arm_requests", "control")] == 3  # not the one before the start, nor the unarmed one
    assert got[arm("sibyl_canary_arm_attainment", "canary")] == 0.75  # 0.4 s missed
    assert got[arm("sibyl_canary_arm_attainment", "control")] == pytest.approx(2 / 3)  # the failed one missed
    # linear P99 of 0.1..0.4: 0.3 + 0.97 x 0.1; of 0.5, 0.7: 0.5 + 0.99 x 0.2 (the failed request has none)
    assert got[arm("sibyl_canary_arm_ttft_p99_seconds", "canary")] == pytest.approx(0.397)
    assert got[arm("sibyl_canary_arm_ttft_p99_seconds", "control")] == pytest.approx(0.698)
    assert got[arm("sibyl_canary_arm_tpot_p99_seconds", "canary")] == pytest.approx(0.0397)
    assert got[arm("sibyl_canary_arm_tpot_p99_seconds", "control")] == pytest.approx(0.05)
    assert all(v == 0 for (name, _), v in got.items() if name == "sibyl_canary_verdicts_total")

    assert call(c, "DELETE", "/control/canary").json()["decision"] == "interrupted"
    after = scrape(c)
    assert after[("sibyl_canary_running", on)] == 0.0  # the last one, ended
    assert not any(name.startswith("sibyl_canary_arm_") or name == "sibyl_canary_share" for name, _ in after)
    assert after[("sibyl_canary_verdicts_total", (("outcome", "interrupted"),))] == 1.0

    # a second canary whose arm is faster: promoted by the rule, counted as such
    rng = np.random.default_rng(3)

    async def faster() -> None:
        started = await c.canary.start("routing", "sibyl", {}, "10%", 0.05, source="api")
        t = started["started_t"] + 1.0
        for k, ttft in enumerate(rng.lognormal(np.log(0.1), 0.3, 400).tolist()):
            c.finished.request(arm_row("canary", k, t, ttft=ttft))
        for k, ttft in enumerate(rng.lognormal(np.log(0.2), 0.3, 2000).tolist()):
            c.finished.request(arm_row("control", k, t, ttft=ttft))
        time.sleep(0.06)
        reading = await c.canary.read()
        assert reading is not None and reading.decision == "promote", reading

    asyncio.run(faster())
    final = scrape(c)
    promoted = (("candidate", "sibyl"), ("kind", "routing"), ("pool", pool))
    assert final[("sibyl_canary_running", promoted)] == 0.0 and ("sibyl_canary_running", on) not in final
    counts = {dict(by)["outcome"]: v for (name, by), v in final.items() if name == "sibyl_canary_verdicts_total"}
    assert counts == {"promote": 1.0, "rollback": 0.0, "equal": 0.0, "inconclusive": 0.0, "interrupted": 1.0}
    c.recorder.close()


def test_the_series_carry_the_pool_the_canary_runs_on(tmp_path: Path) -> None:
    c = two_pool_controller(tmp_path)
    body = {"kind": "routing", "name": "least_load", "params": {}, "share": "25%", "duration_s": 600}
    started = call(c, "POST", "/control/canary", json={**body, "pool": "b"}).json()
    t = started["started_t"] + 1.0
    c.finished.request(arm_row("canary", 0, t, model="org/B"))
    c.finished.request(arm_row("control", 1, t, model="org/B"))
    c.finished.request(arm_row("control", 2, t, model="A"))  # pool A's: no arm's
    on_b = (("candidate", "least_load"), ("kind", "routing"), ("pool", "b"))
    got = scrape(c)
    assert got[("sibyl_canary_running", on_b)] == 1.0
    assert got[("sibyl_canary_arm_requests", tuple(sorted((*on_b, ("arm", "control")))))] == 1
    assert {dict(by)["pool"] for (name, by), _ in got.items() if name != "sibyl_canary_verdicts_total"} == {"b"}
    call(c, "DELETE", "/control/canary")
    call(c, "POST", "/control/canary", json=body)  # no pool: the first, A
    call(c, "DELETE", "/control/canary")
    after = scrape(c)
    on_a = (("candidate", "least_load"), ("kind", "routing"), ("pool", "A"))
    assert after[("sibyl_canary_running", on_a)] == 0.0 and ("sibyl_canary_running", on_b) not in after
    c.recorder.close()

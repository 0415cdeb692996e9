"""The advisor's and the canary's control routes on a controller without a network: answers, the canary's life
through the API (on the first pool, or on the pool named), and bad input as clear 4xx errors."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from console.gateway.app import build_app
from console.gateway.openapi import build_openapi
from console.live.controller import Controller
from core.types import Request
from tests.console.advisor.fakes import controller, two_pool_controller


def call(c: Controller, method: str, path: str, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(c, manage_lifecycle=False))
        async with httpx.AsyncClient(transport=transport, base_url="http://console") as http:
            return await http.request(method, path, headers={"Authorization": f"Bearer {c.token}"}, **kw)

    return asyncio.run(go())


def test_advice_answers_off_and_on_and_needs_the_token(tmp_path: Path) -> None:
    off = controller(tmp_path / "off")
    answer = call(off, "GET", "/control/advice").json()
    assert answer == {"enabled": False, "advice": None}
    assert "advisor" not in off.state() and "canary" not in off.state()
    on = controller(tmp_path / "on", advisor=True)
    answer = call(on, "GET", "/control/advice").json()
    assert answer["enabled"] is True and answer["advice"] is None and answer["period_s"] == 1.0
    assert answer["pool"] == "sibyl-model"  # the only pool's name
    assert on.state()["advisor"]["apply"] == "suggest"

    async def anonymous() -> int:
        transport = httpx.ASGITransport(app=build_app(on, manage_lifecycle=False))
        async with httpx.AsyncClient(transport=transport, base_url="http://console") as http:
            return (await http.get("/control/advice")).status_code

    assert asyncio.run(anonymous()) == 401
    on.recorder.close()
    off.recorder.close()


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"kind": "routing", "name": "nope", "share": "10%", "duration_s": 60}, 422, "unknown routing policy 'nope'"),
        ({"kind": "routing", "name": "least_load", "share": "60%", "duration_s": 60}, 422, "at most 50%"),
        ({"kind": "routing", "name": "least_load", "share": 0, "duration_s": 60}, 422, "above 0"),
        ({"kind": "queue", "name": "priority", "share": "10%", "duration_s": 60}, 422, "a queue policy cannot be"),
        ({"kind": "scaling", "name": "static", "share": "10%", "duration_s": 60}, 422, "cannot be canaried"),
        ({"kind": "routing", "name": "least_load", "share": "10%", "duration_s": 0}, 422, "duration must be > 0"),
        ({"kind": "routing", "name": "least_load", "share": "10%"}, 422, "duration_s is required"),
        ({"kind": "routing", "share": "10%"}, 400, "expected"),
    ],
)
def test_bad_canaries_are_clear_errors(tmp_path: Path, body: dict[str, Any], status: int, message: str) -> None:
    c = controller(tmp_path)
    r = call(c, "POST", "/control/canary", json=body)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert c.dispatcher.canary is None
    c.recorder.close()


def test_a_canary_through_the_api_splits_routing_records_arms_and_ends_interrupted(tmp_path: Path) -> None:
    c = controller(tmp_path)
    body = {"kind": "routing", "name": "least_load", "params": {}, "share": "50%", "duration_s": 600}
    started = call(c, "POST", "/control/canary", json=body).json()
    assert started["plan"]["share"] == 0.5 and started["plan"]["name"] == "least_load"
    assert call(c, "POST", "/control/canary", json=body).status_code == 409  # one at a time
    arms = []
    for k in range(40):
        c.dispatcher.route(Request(f"r{k}", 0.0, 10, 10, session=f"s{k % 10}"), 0.0)
        arms.append(c.dispatcher.arm_of(f"r{k}"))
    assert {"canary", "control"} == set(arms)
    by_session: dict[str, set[str | None]] = {}
    for k, arm in enumerate(arms):
        by_session.setdefault(f"s{k % 10}", set()).add(arm)
    assert all(len(a) == 1 for a in by_session.values())  # a conversation stays in one arm
    assert c.state()["canary"]["running"]["id"] == started["id"]
    swap = c.set_policy("routing", "sibyl", {}, source="api")  # a swap of its kind ends it
    assert swap.new == "sibyl" and c.canary.current is None and c.dispatcher.canary is None
    last = call(c, "GET", "/control/canary").json()["last"]
    assert last["decision"] == "interrupted" and "swapped during the canary" in last["reason"]
    assert started["pool"] == last["pool"] == "sibyl-model"
    assert call(c, "DELETE", "/control/canary").status_code == 409
    assert c.dispatcher.routing.name == "sibyl"
    c.recorder.close()
    events = c.store.advisor_events(c.run_id)
    assert [e["event"] for e in events] == ["canary_start", "canary_end"]
    assert events[1]["decision"] == "interrupted"


def test_a_canary_on_the_pool_named_splits_that_pools_requests_only(tmp_path: Path) -> None:
    c = two_pool_controller(tmp_path)
    a, b = c.runtimes
    body = {"kind": "routing", "name": "least_load", "params": {}, "share": "50%", "duration_s": 600}
    unknown = call(c, "POST", "/control/canary", json={**body, "pool": "C"})
    assert unknown.status_code == 422 and unknown.json()["error"]["message"] == "no pool 'C'; pools: A, b"
    assert call(c, "POST", "/control/canary", json={**body, "pool": 7}).status_code == 400
    assert a.dispatcher.canary is None and b.dispatcher.canary is None and c.canary.current is None
    started = call(c, "POST", "/control/canary", json={**body, "pool": "b"}).json()
    assert started["pool"] == "b" and b.dispatcher.canary is not None and a.dispatcher.canary is None
    busy = call(c, "POST", "/control/canary", json=body)  # one canary per console, whichever its pool
    assert busy.status_code == 409 and "on pool b) is running" in busy.json()["error"]["message"]
    for k in range(20):
        a.dispatcher.route(Request(f"a{k}", 0.0, 10, 10, session=f"s{k}"), 0.0)
        b.dispatcher.route(Request(f"b{k}", 0.0, 10, 10, session=f"s{k}"), 0.0)
    assert {a.dispatcher.arm_of(f"a{k}") for k in range(20)} == {None}
    assert {b.dispatcher.arm_of(f"b{k}") for k in range(20)} == {"canary", "control"}
    c.set_policy("routing", "sibyl", {}, source="api", pool="A")  # another pool's swap leaves it running
    assert c.canary.current is not None and call(c, "GET", "/control/canary").json()["running"]["pool"] == "b"
    ended = call(c, "DELETE", "/control/canary").json()  # --stop: whichever runs
    assert ended["pool"] == "b" and ended["decision"] == "interrupted" and b.dispatcher.canary is None
    first = call(c, "POST", "/control/canary", json=body).json()  # no pool: the first
    assert first["pool"] == "A" and a.dispatcher.canary is not None and b.dispatcher.canary is None
    c.set_policy("routing", "least_load", {}, source="api", pool="A")  # a swap of its kind in its pool ends it
    assert c.canary.current is None and c.canary.last is not None and c.canary.last["decision"] == "interrupted"
    c.recorder.close()
    events = c.store.advisor_events(c.run_id)
    assert [(e["event"], e["data"]["pool"]) for e in events] == [
        ("canary_start", "b"),
        ("canary_end", "b"),
        ("canary_start", "A"),
        ("canary_end", "A"),
    ]
    assert "of pool b's requests" in events[0]["detail"]


def test_the_openapi_document_describes_the_routes() -> None:
    doc = build_openapi(models=["m"], instances=["p0"], catalog=[])
    assert doc["paths"]["/control/advice"]["get"]["security"] == [{"bearerAuth": []}]
    canary = doc["paths"]["/control/canary"]
    assert set(canary) == {"get", "post", "delete"} and "422" in canary["post"]["responses"]
    schema = canary["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["properties"]["pool"]["type"] == "string" and "pool" not in schema["required"]
    assert "unknown pool" in canary["post"]["responses"]["422"]["description"]

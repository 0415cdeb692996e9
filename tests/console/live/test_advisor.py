"""The live advisor's window input: what the gateway notes at arrival, and the requests in flight it reads from the
gateway's records so that a window carries the load the cluster carries at its end; with several pools, the advisor on
the pool `[advisor] pool` names: that pool's requests, shape, policies, swaps and canaries, and its automatic canary
started there."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

from console.advisor.window import window_from_rows
from console.advisor.worker import WorkerAnswer
from console.live.channel import ClientChannel
from console.live.record import RequestRecord
from console.live.request import LiveRequest
from core.types import Request
from tests.console.advisor.fakes import advice, controller, two_pool_controller
from tests.console.live.fakes import FakeParts, Sent, dispatcher, instances, never_disconnects


def test_the_gateway_notes_whether_the_client_set_max_tokens(tmp_path: Path) -> None:
    c = controller(tmp_path, advisor=True)
    insts = instances(1, 1)
    host = FakeParts(insts, dispatcher(insts))
    for inst in insts:
        host.dispatcher.set_health(inst.id, False)  # answered 503 after admission: noted all the same
    services = dataclasses.replace(host.services, arrivals=c.advisor)
    bodies = {
        "completion": {"prompt": "hi", "max_tokens": 64},
        "chat": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 32},
        "bare": {"prompt": "hi"},
    }

    async def arrive() -> None:
        for rid, body in bodies.items():
            live = LiveRequest(Request(rid, 100.0, 10, 16, session=f"s-{rid}"), "/v1/completions", body, b"")
            await live.run(services, ClientChannel(Sent(), never_disconnects))

    asyncio.run(arrive())
    assert c.advisor.arrivals is not None
    noted = {rid: c.advisor.arrivals.get(rid) for rid in bodies}
    assert {rid: k.max_tokens_set for rid, k in noted.items() if k is not None} == {
        "completion": True,
        "chat": True,
        "bare": False,
    }
    c.recorder.close()


def finished_row(rid: str, arrival: float, output_tokens: int) -> dict[str, Any]:
    return {
        "request_id": rid, "arrival": arrival, "prompt_tokens": 100, "output_tokens": output_tokens,
        "max_tokens": 100, "status": "ok", "prefill_start": arrival, "first_token": arrival + 0.1,
        "finish": arrival + 0.5, "ttft": 0.1, "tpot": 0.01, "slo_met": True, "cached_tokens": None,
        "slo_class": "default", "tenant": "default", "priority": 0,
    }


def test_the_window_takes_the_requests_in_flight_from_the_gateways_records(tmp_path: Path) -> None:
    c = controller(tmp_path, advisor=True)  # window_s = 5
    adv = c.advisor
    now = time.monotonic()
    rel = now - c.t0
    for k, out in enumerate((10, 30)):
        adv.request(finished_row(f"done{k}", rel - 4.0 + k, out))
    bound = Request("bound", now - 1.0, 300, 500, "default", 2, prefix_keys=(7, 8), session="conv")
    bare = Request("bare", now - 0.5, 200, 16, prefix_keys=(9,))
    adv.note(bound, max_tokens_set=True)
    adv.note(bare, max_tokens_set=False)
    for req, generated in ((bound, 12), (bare, 0)):
        rec = RequestRecord(req, stream=True)
        rec.output_tokens = generated
        c.outcomes.started(rec)
    gateway = adv.in_flight_rows()
    assert [(r["request_id"], r["max_tokens_set"], r["output_tokens"]) for r in gateway] == [
        ("bound", True, 12),
        ("bare", False, 0),
    ]
    assert gateway[0]["arrival"] == now - 1.0 - c.t0 and gateway[0]["tenant"] == "default"
    rows = list(adv.rows)
    w = window_from_rows(rows, **adv.window_args(now, rows, gateway))
    assert w.request_ids == ["done0", "done1", "bound", "bare"]
    assert w.output_tokens.tolist() == [10, 30, 500, 20]  # bare: the mean of what finished
    assert w.measured.tolist() == [True, True, False, False] and w.in_flight_at_end == 2
    assert w.prefix_keys == [(), (), (7, 8), (9,)] and w.priorities.tolist() == [0, 0, 2, 0]
    assert w.observed.requests == 2
    c.recorder.close()


def test_the_advisor_on_a_named_pool_reads_that_pool_only_and_canaries_there(tmp_path: Path) -> None:
    c = two_pool_controller(tmp_path, advisor=True, advisor_pool="b")
    a, b = c.runtimes
    adv = c.advisor
    assert (adv.pool, adv.model, adv.dispatcher, adv.calibration) == ("b", "org/B", b.dispatcher, b.calibration)
    assert c.advisor.answer_json()["pool"] == "b" and c.state()["advisor"]["pool"] == "b"
    assert adv.shape() == "1P1D" and c.state()["cluster"] == "2P2D"  # b's shape, not the console's
    rel = time.monotonic() - c.t0
    for rid, model in (("on-a", "A"), ("on-b", "org/B"), ("unknown", None)):
        adv.request({**finished_row(rid, rel - 1.0, 10), "model": model})
    assert [r["request_id"] for r in adv.rows] == ["on-b", "unknown"]  # a row of no known model is kept
    for rid, model in (("live-a", "A"), ("live-b", "org/B")):
        c.outcomes.started(RequestRecord(Request(rid, time.monotonic(), 10, 16), stream=True, model=model))
    assert [r["request_id"] for r in adv.in_flight_rows()] == ["live-b"]

    c.set_policy("routing", "least_load", {}, source="api", pool="A")  # A's swap: b's window is still one policy

    async def canary_on_a() -> None:
        await c.canary.start("routing", "least_load", {}, "10%", 60, pool="A")
        c.canary.interrupt("done")

    asyncio.run(canary_on_a())
    args = adv.window_args(time.monotonic(), [])
    assert args["active"]["routing"] == ("round_robin", {}) and args["swapped"] is False and args["cluster"] == "1P1D"
    c.set_policy("routing", "sibyl", {}, source="api", pool="b")
    assert adv.window_args(time.monotonic(), [])["swapped"] is True

    # two advices in a row past the error: the autopilot starts a canary, on b (A's canary did not cool it down)
    adv.autopilot.apply = "canary"

    async def two_advices() -> None:
        for job in (1, 2):
            await adv._take(WorkerAnswer(job, advice(0.3, 0.1, True), None, 0.0, 0.0, 0.0, 1, 0.0))

    asyncio.run(two_advices())
    running = c.canary.current
    assert running is not None and running.pool.name == "b" and running.source == "advisor"
    assert b.dispatcher.canary is not None and a.dispatcher.canary is None
    c.canary.interrupt("done")  # b's canary ended: now the autopilot cools down
    assert adv.autopilot.quiet_until > time.monotonic() + 500
    c.recorder.close()

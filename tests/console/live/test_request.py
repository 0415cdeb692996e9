"""LiveRequest against fake parts (its RequestServices): shed, no capacity, a client leaving the queue,
a prefill retried elsewhere; the record it leaves and the parts it tells."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from console.live.channel import ClientChannel
from console.live.outcomes import decisions
from console.live.record import Outcome, Step
from tests.console.live.fakes import FakeParts, Sent, dispatcher, instances, live_request, never_disconnects


def error_of(sent: Sent) -> str:
    return str(orjson.loads(sent.body)["error"]["message"])


def test_a_full_queue_sheds_with_429_and_retry_after() -> None:
    async def body() -> None:
        insts = instances(1, 1)
        host = FakeParts(insts, dispatcher(insts, queue=("fcfs", {"max_in_flight_per_instance": 1, "max_queued": 0})))
        busy = live_request("busy")
        host.dispatcher.admit(busy.request, 0.0)
        host.dispatcher.route(busy.request, 0.0)
        sent = Sent()
        live = live_request("r1", stream=False)
        await live.run(host.services, ClientChannel(sent, never_disconnects))
        assert sent.status == 429 and sent.headers[b"retry-after"] == b"7" and "queue is full" in error_of(sent)
        rec = live.record
        assert host.done == [rec] and rec.step == Step.FAILED and not rec.ok and rec.reason is not None
        assert rec.outcome is Outcome.SHED and decisions(rec) == [("queue", "shed")]
        assert host.calls == [("started", "r1"), ("release", None), ("tenant_finished", "r1")]

    asyncio.run(body())


def test_no_healthy_instance_is_a_503() -> None:
    async def body() -> None:
        insts = instances(1, 1)
        host = FakeParts(insts, dispatcher(insts))
        for inst in insts:
            host.dispatcher.set_health(inst.id, False)
        sent = Sent()
        live = live_request("r1")
        await live.run(host.services, ClientChannel(sent, never_disconnects))
        assert sent.status == 503 and "no capacity" in error_of(sent) and host.done == [live.record]
        assert live.record.outcome is Outcome.NO_CAPACITY and decisions(live.record) == [("routing", "no_capacity")]

    asyncio.run(body())


def test_a_client_that_leaves_the_queue_is_cancelled_and_unheld() -> None:
    async def body() -> None:
        insts = instances(1, 1)
        host = FakeParts(insts, dispatcher(insts, queue=("fcfs", {"max_in_flight_per_instance": 1})))
        busy = live_request("busy")
        host.dispatcher.admit(busy.request, 0.0)
        host.dispatcher.route(busy.request, 0.0)

        async def leaves() -> dict[str, Any]:
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

        sent = Sent()
        live = live_request("r1")
        await live.run(host.services, ClientChannel(sent, leaves))
        assert sent.messages == []  # nobody to answer
        assert host.ends() == ["started", "hold", "unhold", "tenant_finished"]
        rec = live.record
        assert rec.reason == "client disconnected while queued" and rec.at(Step.QUEUED) is not None
        assert rec.outcome is Outcome.ABANDONED and decisions(rec) == [("queue", "held"), ("queue", "abandoned")]
        assert host.dispatcher.queue_depth() == 0

    asyncio.run(body())


def test_an_unreachable_prefill_instance_is_tried_once_more_elsewhere_then_a_502() -> None:
    async def body() -> None:
        insts = instances(2, 1)
        host = FakeParts(insts, dispatcher(insts))
        for inst in insts:
            inst.open(connect_timeout_s=1.0)
        try:
            sent = Sent()
            live = live_request("r1", stream=False)
            await live.run(host.services, ClientChannel(sent, never_disconnects))
        finally:
            for inst in insts:
                await inst.close()
        rec = live.record
        assert sent.status == 502 and host.done == [rec] and rec.outcome is Outcome.UPSTREAM
        assert sorted(rec.tried_prefill) == ["p0", "p1"]
        assert [c for c in host.calls if c[0] == "failed"] == [
            ("failed", rec.tried_prefill[0]),
            ("failed", rec.tried_prefill[1]),
        ]

    asyncio.run(body())

"""LiveRequest against a fake host (RequestHost): shed, no capacity, a client leaving the queue,
a prefill retried elsewhere."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from adapters.vllm.instances import Instance
from console.live.channel import ClientChannel
from console.live.config import ConsoleConfig
from console.live.metrics import GatewayMetrics
from console.live.request import LiveRequest, Step
from core.dispatch import Dispatcher
from tests.console.live.fakes import Sent, dispatcher, instances, live_request, never_disconnects


class FakeHost:
    """The members of RequestHost, each call recorded."""

    def __init__(self, insts: list[Instance], d: Dispatcher) -> None:
        self.dispatcher = d
        self.instances = {i.id: i for i in insts}
        self.config = ConsoleConfig()
        self.metrics = GatewayMetrics()
        self.engine_priorities = False
        self.calls: list[tuple[str, Any]] = []
        self.done: list[LiveRequest] = []

    def request_started(self, live: LiveRequest) -> None:
        self.calls.append(("started", live.id))

    def request_done(self, live: LiveRequest) -> None:
        self.done.append(live)

    def admit_tenant(self, live: LiveRequest) -> None:
        """No tenant limits here (tests/console/live/test_tenants.py has them)."""

    def hold(self, live: LiveRequest) -> None:
        self.calls.append(("hold", live.id))

    def unhold(self, live: LiveRequest) -> None:
        self.calls.append(("unhold", live.id))

    def release_queued(self) -> None:
        self.calls.append(("release", None))

    def retry_after_s(self) -> float:
        return 7.0

    def upstream_failed(self, instance_id: str) -> None:
        self.calls.append(("failed", instance_id))

    def upstream_ok(self, instance_id: str) -> None:
        self.calls.append(("ok", instance_id))

    def lost_signal(self, instance_id: str) -> asyncio.Future[None]:
        return asyncio.get_running_loop().create_future()

    def migration_done(
        self, live: LiveRequest, src: str, target: str, last_before: float, tokens_before: int, first_after: float
    ) -> None:
        self.calls.append(("migrated", live.id))


def error_of(sent: Sent) -> str:
    return str(orjson.loads(sent.body)["error"]["message"])


def test_a_full_queue_sheds_with_429_and_retry_after() -> None:
    async def body() -> None:
        insts = instances(1, 1)
        host = FakeHost(insts, dispatcher(insts, queue=("fcfs", {"max_in_flight_per_instance": 1, "max_queued": 0})))
        busy = live_request("busy")
        host.dispatcher.admit(busy.request, 0.0)
        host.dispatcher.route(busy.request, 0.0)
        sent = Sent()
        live = live_request("r1", stream=False)
        await live.run(host, ClientChannel(sent, never_disconnects))
        assert sent.status == 429 and sent.headers[b"retry-after"] == b"7" and "queue is full" in error_of(sent)
        assert host.done == [live] and live.step == Step.FAILED and not live.ok and live.reason is not None
        assert host.calls == [("started", "r1")]

    asyncio.run(body())


def test_no_healthy_instance_is_a_503() -> None:
    async def body() -> None:
        insts = instances(1, 1)
        host = FakeHost(insts, dispatcher(insts))
        for inst in insts:
            host.dispatcher.set_health(inst.id, False)
        sent = Sent()
        live = live_request("r1")
        await live.run(host, ClientChannel(sent, never_disconnects))
        assert sent.status == 503 and "no capacity" in error_of(sent) and host.done == [live]

    asyncio.run(body())


def test_a_client_that_leaves_the_queue_is_cancelled_and_unheld() -> None:
    async def body() -> None:
        insts = instances(1, 1)
        host = FakeHost(insts, dispatcher(insts, queue=("fcfs", {"max_in_flight_per_instance": 1})))
        busy = live_request("busy")
        host.dispatcher.admit(busy.request, 0.0)
        host.dispatcher.route(busy.request, 0.0)

        async def leaves() -> dict[str, Any]:
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

        sent = Sent()
        live = live_request("r1")
        await live.run(host, ClientChannel(sent, leaves))
        assert sent.messages == []  # nobody to answer
        assert host.calls == [("started", "r1"), ("hold", "r1"), ("unhold", "r1")]
        assert live.reason == "client disconnected while queued" and live.at(Step.QUEUED) is not None
        assert host.dispatcher.queue_depth() == 0

    asyncio.run(body())


def test_an_unreachable_prefill_instance_is_tried_once_more_elsewhere_then_a_502() -> None:
    async def body() -> None:
        insts = instances(2, 1)
        host = FakeHost(insts, dispatcher(insts))
        for inst in insts:
            inst.open(connect_timeout_s=1.0)
        try:
            sent = Sent()
            live = live_request("r1", stream=False)
            await live.run(host, ClientChannel(sent, never_disconnects))
        finally:
            for inst in insts:
                await inst.close()
        assert sent.status == 502 and host.done == [live]
        assert sorted(live.tried_prefill) == ["p0", "p1"]
        assert [c for c in host.calls if c[0] == "failed"] == [
            ("failed", live.tried_prefill[0]),
            ("failed", live.tried_prefill[1]),
        ]

    asyncio.run(body())

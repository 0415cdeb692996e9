"""HeldRequests: hold, release in the queue policy's order, expire with a 503, the retry-after hint."""

from __future__ import annotations

import asyncio

import pytest

from console.live.admission import HeldRequests
from console.live.channel import Rejected
from console.live.config import ConsoleConfig
from console.live.record import Outcome
from core.perf import get_profile
from core.types import Admission, Request
from tests.console.live.fakes import dispatcher, instances


def held_with(queue: tuple[str, dict[str, object]]) -> HeldRequests:
    return HeldRequests(
        dispatcher(instances(1, 1), queue=queue), get_profile(ConsoleConfig().profile), poll_interval_s=0.5
    )


def test_held_requests_go_when_the_cluster_has_room() -> None:
    async def body() -> None:
        held = held_with(("fcfs", {"max_in_flight_per_instance": 1}))
        d = held.dispatcher
        first, second = Request("a", 1.0, 10, 4), Request("b", 1.0, 10, 4)
        assert d.admit(first, 1.0) == Admission.ROUTE
        d.route(first, 1.0)
        assert d.admit(second, 1.0) == Admission.QUEUED
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        held.hold("b", released)
        held.release()  # still full
        assert len(held) == 1 and not released.done()
        d.on_fail(first.id, 2.0)
        held.release()
        assert len(held) == 0 and released.done() and released.exception() is None

    asyncio.run(body())


def test_a_request_held_past_the_ttl_is_rejected_with_retry_after() -> None:
    async def body() -> None:
        held = held_with(("fcfs", {"max_in_flight_per_instance": 1, "ttl_s": 0.001}))
        d = held.dispatcher
        first, second = Request("a", 0.0, 10, 4), Request("b", 0.0, 10, 4)
        d.admit(first, 0.0)
        d.route(first, 0.0)
        assert d.admit(second, 0.0) == Admission.QUEUED
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        held.hold("b", released)
        held.expire()
        with pytest.raises(Rejected) as e:
            released.result()
        assert e.value.status == 503 and "ttl_s=0.001" in str(e.value) and e.value.outcome is Outcome.EXPIRED
        assert e.value.retry_after_s == held.retry_after_s() >= 1.0

    asyncio.run(body())


def test_unhold_forgets_a_request_whose_client_left() -> None:
    async def body() -> None:
        held = held_with(("fcfs", {}))
        held.hold("a", asyncio.get_running_loop().create_future())
        held.unhold("a")
        held.unhold("a")  # twice is harmless
        assert len(held) == 0
        held.release()  # nothing held: the dispatcher is not asked

    asyncio.run(body())

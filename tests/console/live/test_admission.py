"""HeldRequests: hold, release in the queue policy's order, expire with a 503, the retry-after hint."""

from __future__ import annotations

import asyncio

import pytest

from console.live.admission import HeldRequests
from console.live.channel import Rejected
from console.live.config import ConsoleConfig
from core.perf import get_profile
from core.types import Admission
from tests.console.live.fakes import dispatcher, instances, live_request


def held_with(queue: tuple[str, dict[str, object]]) -> HeldRequests:
    return HeldRequests(
        dispatcher(instances(1, 1), queue=queue), get_profile(ConsoleConfig().profile), poll_interval_s=0.5
    )


def test_held_requests_go_when_the_cluster_has_room() -> None:
    async def body() -> None:
        held = held_with(("fcfs", {"max_in_flight_per_instance": 1}))
        d = held.dispatcher
        first, second = live_request("a", arrival=1.0), live_request("b", arrival=1.0)
        assert d.admit(first.request, 1.0) == Admission.ROUTE
        d.route(first.request, 1.0)
        assert d.admit(second.request, 1.0) == Admission.QUEUED
        second.released = asyncio.get_running_loop().create_future()
        held.hold(second)
        held.release()  # still full
        assert len(held) == 1 and not second.released.done()
        d.on_fail(first.request.id, 2.0)
        held.release()
        assert len(held) == 0 and second.released.done() and second.released.exception() is None

    asyncio.run(body())


def test_a_request_held_past_the_ttl_is_rejected_with_retry_after() -> None:
    async def body() -> None:
        held = held_with(("fcfs", {"max_in_flight_per_instance": 1, "ttl_s": 0.001}))
        d = held.dispatcher
        first, second = live_request("a", arrival=0.0), live_request("b", arrival=0.0)
        d.admit(first.request, 0.0)
        d.route(first.request, 0.0)
        assert d.admit(second.request, 0.0) == Admission.QUEUED
        second.released = asyncio.get_running_loop().create_future()
        held.hold(second)
        held.expire()
        with pytest.raises(Rejected) as e:
            second.released.result()
        assert e.value.status == 503 and "ttl_s=0.001" in str(e.value)
        assert e.value.retry_after_s == held.retry_after_s() >= 1.0

    asyncio.run(body())


def test_unhold_forgets_a_request_whose_client_left() -> None:
    held = held_with(("fcfs", {}))
    live = live_request("a")
    held.hold(live)
    held.unhold(live)
    held.unhold(live)  # twice is harmless
    assert len(held) == 0
    held.release()  # nothing held: the dispatcher is not asked

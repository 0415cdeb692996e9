"""Migrations: which decoding streams may move and where, the move through the backend, the stall reported."""

from __future__ import annotations

import asyncio

import pytest

from adapters.backends import Capability
from console.live.migrations import ScaleError
from console.live.relay import DecodeRelay
from console.live.tracing import NO_TRACE
from core.types import Request, Role
from tests.console.live.fakes import Cluster, FakeBackend, FakeParts, instances

ALL = frozenset({Capability.SCALE, Capability.ROLE_FLIP, Capability.MIGRATION})


def relay_on(host: Cluster, decode_id: str, *, stream: bool = True) -> DecodeRelay:
    """The decode side of request r1, decoding on `decode_id`."""
    parts = FakeParts(list(host.instances.values()), host.dispatcher)
    body = {"prompt": "hi", "stream": stream}
    return DecodeRelay(parts.services, Request("r1", 0.0, 10, 4), "/v1/completions", body, b"", NO_TRACE, decode_id)


def test_only_a_decoding_stream_can_be_migrated_to_another_active_decode_instance() -> None:
    async def body() -> None:
        host = Cluster(FakeBackend(ALL), instances(1, 2))
        migrations = host.migrations
        with pytest.raises(ScaleError, match="not decoding"):
            await migrations.migrate("r1", "d1")
        whole = relay_on(host, "d0", stream=False)
        migrations.decoding("r1", whole)
        with pytest.raises(ScaleError, match="not streaming"):
            await migrations.migrate("r1", "d1")
        relay = relay_on(host, "d0")
        migrations.decoding("r1", relay)
        with pytest.raises(ScaleError, match="decodes on d0 already"):
            await migrations.migrate("r1", "d0")
        with pytest.raises(ScaleError, match="not an active decode instance"):
            await migrations.migrate("r1", "p0")
        host.instances["d1"].open()
        try:
            report = await migrations.migrate("r1", "d1", source="tui", reason="balance")
            with pytest.raises(ScaleError, match="being migrated already"):
                await migrations.migrate("r1", "d1")
        finally:
            relay.drop_resume()
            await host.instances["d1"].close()
        assert report == {
            "request_id": "r1",
            "source": "d0",
            "target": "d1",
            "reason": "balance",
            "stage": "done",
            "by": "tui",
        }
        assert relay.migrating_to == "d1" and host.fake.calls == [("migrate", "r1", "d0", "d1")]
        migrations.left("r1")
        with pytest.raises(ScaleError, match="not decoding"):
            await migrations.migrate("r1", "d1")

    asyncio.run(body())


def test_a_migration_the_backend_gives_up_leaves_the_stream_where_it_was() -> None:
    class Failing(FakeBackend):
        async def migrate(self, request_id: str, source: object, target: object) -> dict[str, object]:
            raise RuntimeError("the source refused")

    async def body() -> None:
        host = Cluster(Failing(ALL), instances(1, 2))
        relay = relay_on(host, "d0")
        host.migrations.decoding("r1", relay)
        with pytest.raises(RuntimeError, match="refused"):
            await host.migrations.migrate("r1", "d1")
        assert not relay.migrating and relay.resume_leg is None

    asyncio.run(body())


def test_a_finished_migration_publishes_the_stall_in_decode_steps() -> None:
    host = Cluster(FakeBackend(ALL), instances(1, 2))
    host.migrations.landed("r1", "d0", "d1", 10.4, 5, 10.6, 10.0)
    detail = host.events_of("migrated")[0][3]
    assert "waited 200.0 ms" in detail and "(2.0 of its decode steps of 100.0 ms)" in detail
    assert host.instance_events[0][1] == Role.DECODE.value
    assert [e["type"] for e in host.events.history] == ["instance", "migration"]
    registry = host.metrics.registry
    stall = [s for m in registry.collect() for s in m.samples if s.name == "sibyl_migration_stall_seconds_sum"]
    assert stall and abs(stall[0].value - 0.2) < 1e-9

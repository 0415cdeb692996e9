"""Operations: operator scale and flip with their refusals, migration checks and its stall, periodic decisions."""

from __future__ import annotations

import asyncio

import pytest

from adapters.backends import Capability
from console.live.operations import Operations, ScaleError
from console.live.request import Step
from core.types import Migration, PeriodicDecisions, Role
from tests.console.live.fakes import FakeBackend, Host, instances, live_request

ALL = frozenset({Capability.SCALE, Capability.ROLE_FLIP, Capability.MIGRATION})


def test_an_operator_scale_is_checked_then_carried_out() -> None:
    async def body() -> None:
        ops = Operations(Host(FakeBackend(ALL), instances(1, 2)))
        with pytest.raises(ScaleError, match="non-zero integer"):
            await ops.scale("decode", 0)
        with pytest.raises(ScaleError, match="at least one decode instance must remain"):
            await ops.scale("decode", -2)
        assert await ops.scale("decode", -1) == {"role": "decode", "delta": -1, "instances": ["d1"]}
        assert await ops.scale("prefill", 1, source="tui") == {"role": "prefill", "delta": 1, "instances": ["p1"]}
        await ops.stop()
        assert not ops.scaler.busy
        with pytest.raises(ScaleError, match="cannot add or remove"):
            await Operations(Host(FakeBackend(frozenset()), instances())).scale("decode", 1)

    asyncio.run(body())


def test_a_flip_is_refused_for_the_last_instance_of_a_role() -> None:
    async def body() -> None:
        ops = Operations(Host(FakeBackend(ALL), instances(1, 2)))
        with pytest.raises(ScaleError, match="last active prefill"):
            await ops.flip("p0", "decode")
        with pytest.raises(ScaleError, match="already serves"):
            await ops.flip("d0", "decode")
        with pytest.raises(ScaleError, match="unknown role"):
            await ops.flip("d0", "both-ways")
        assert await ops.flip("d0", "prefill") == {"instance": "d0", "role": "prefill"}
        await ops.stop()

    asyncio.run(body())


def test_only_a_decoding_stream_can_be_migrated_to_another_active_decode_instance() -> None:
    async def body() -> None:
        host = Host(FakeBackend(ALL), instances(1, 2))
        ops = Operations(host)
        with pytest.raises(ScaleError, match="not decoding"):
            await ops.migrate("r1", "d1")
        live = live_request("r1")
        live.decode_instance = "d0"
        live.enter(Step.DECODING)
        host.live["r1"] = live
        with pytest.raises(ScaleError, match="decodes on d0 already"):
            await ops.migrate("r1", "d0")
        with pytest.raises(ScaleError, match="not an active decode instance"):
            await ops.migrate("r1", "p0")
        host.instances["d1"].open()
        try:
            report = await ops.migrate("r1", "d1", source="tui", reason="balance")
        finally:
            live.drop_resume()
            await host.instances["d1"].close()
        assert report == {
            "request_id": "r1",
            "source": "d0",
            "target": "d1",
            "reason": "balance",
            "stage": "done",
            "by": "tui",
        }
        assert live.migrating_to == "d1" and host.fake.calls == [("migrate", "r1", "d0", "d1")]

    asyncio.run(body())


def test_a_migration_refused_by_the_backend_becomes_an_event() -> None:
    async def body() -> None:
        host = Host(FakeBackend(frozenset()), instances(1, 2))
        ops = Operations(host)
        decisions = PeriodicDecisions(migrations=[Migration("r9", "d0", "d1", reason="imbalance")])
        ops.carry_out(decisions, "static", "ares")
        assert host.events_of("refused")[0][3] == "migration of r9 to d1: the fake backend cannot migrate"
        host.fake.capabilities = ALL
        ops.carry_out(decisions, "static", "ares")  # allowed, but r9 is not in the gateway: refused with why
        await asyncio.sleep(0.05)
        refused = host.events_of("migration_refused")[0]
        assert refused[0] == "d1" and "r9 → d1" in refused[3] and refused[4] == "policy:ares"

    asyncio.run(body())


def test_a_finished_migration_publishes_the_stall_in_decode_steps() -> None:
    host = Host(FakeBackend(ALL), instances(1, 2))
    live = live_request("r1")
    live.first_token_at = 10.0
    Operations(host).migration_done(live, "d0", "d1", last_before=10.4, tokens_before=5, first_after=10.6)
    detail = host.events_of("migrated")[0][3]
    assert "waited 200.0 ms" in detail and "(2.0 of its decode steps of 100.0 ms)" in detail
    assert host.instance_events[0][1] == Role.DECODE.value
    assert [e["type"] for e in host.events.history] == ["migration"]

"""Operations: operator scale and flip with their refusals, the periodic policies' decisions carried out."""

from __future__ import annotations

import asyncio

import pytest

from adapters.backends import Capability
from console.live.migrations import ScaleError
from core.types import Migration, PeriodicDecisions
from tests.console.live.fakes import Cluster, FakeBackend, instances

ALL = frozenset({Capability.SCALE, Capability.ROLE_FLIP, Capability.MIGRATION})


def test_an_operator_scale_is_checked_then_carried_out() -> None:
    async def body() -> None:
        ops = Cluster(FakeBackend(ALL), instances(1, 2)).operations()
        with pytest.raises(ScaleError, match="non-zero integer"):
            await ops.scale("decode", 0)
        with pytest.raises(ScaleError, match="at least one decode instance must remain"):
            await ops.scale("decode", -2)
        assert await ops.scale("decode", -1) == {"role": "decode", "delta": -1, "instances": ["d1"]}
        assert await ops.scale("prefill", 1, source="tui") == {"role": "prefill", "delta": 1, "instances": ["p1"]}
        await ops.stop()
        assert not ops.scaler.busy
        with pytest.raises(ScaleError, match="cannot add or remove"):
            await Cluster(FakeBackend(frozenset()), instances()).operations().scale("decode", 1)

    asyncio.run(body())


def test_a_flip_is_refused_for_the_last_instance_of_a_role() -> None:
    async def body() -> None:
        ops = Cluster(FakeBackend(ALL), instances(1, 2)).operations()
        with pytest.raises(ScaleError, match="last active prefill"):
            await ops.flip("p0", "decode")
        with pytest.raises(ScaleError, match="already serves"):
            await ops.flip("d0", "decode")
        with pytest.raises(ScaleError, match="unknown role"):
            await ops.flip("d0", "both-ways")
        assert await ops.flip("d0", "prefill") == {"instance": "d0", "role": "prefill"}
        await ops.stop()

    asyncio.run(body())


def test_a_migration_refused_by_the_backend_becomes_an_event() -> None:
    async def body() -> None:
        host = Cluster(FakeBackend(frozenset()), instances(1, 2))
        ops = host.operations()
        decisions = PeriodicDecisions(migrations=[Migration("r9", "d0", "d1", reason="imbalance")])
        ops.carry_out(decisions, "static", "ares")
        assert host.events_of("refused")[0][3] == "migration of r9 to d1: the fake backend cannot migrate"
        host.fake.capabilities = ALL
        ops.carry_out(decisions, "static", "ares")  # allowed, but r9 is not in the gateway: refused with why
        await asyncio.sleep(0.05)
        refused = host.events_of("migration_refused")[0]
        assert refused[0] == "d1" and "r9 → d1" in refused[3] and refused[4] == "policy:ares"

    asyncio.run(body())

"""Scaler: add (starting → active), remove (draining → stopped), flip, refusals; against a fake host and backend."""

from __future__ import annotations

import asyncio

import pytest

from adapters.backends import Capability
from adapters.errors import BackendError
from console.live.config import ConsoleConfig
from core.types import InstancePhase, Role, ScaleAction
from tests.console.live.fakes import Cluster, FakeBackend, instances

ALL = frozenset({Capability.SCALE, Capability.ROLE_FLIP})


def test_an_added_instance_starts_then_becomes_active_and_lets_held_requests_go() -> None:
    async def body() -> None:
        host = Cluster(FakeBackend(ALL), instances(1, 1))
        scaler = host.scaler()
        iid = scaler.execute(ScaleAction("add", Role.DECODE, reason="load"), "policy:threshold")
        assert iid == "d1" and scaler.busy and host.dispatcher.phase_of("d1") == InstancePhase.STARTING
        while scaler.busy:
            await asyncio.sleep(0.01)
        assert host.dispatcher.phase_of("d1") == InstancePhase.ACTIVE and "d1" in host.instances and host.released == 1
        assert host.ready == ["d1"]  # the instance listeners heard it joined
        assert [e[2] for e in host.instance_events] == ["starting", "added"]
        assert host.instance_events[1][4] == "policy:threshold"
        await host.instances["d1"].close()

    asyncio.run(body())


def test_an_instance_that_does_not_start_is_taken_out_and_said_so() -> None:
    async def body() -> None:
        host = Cluster(FakeBackend(ALL, fail_add=True), instances(1, 1))
        scaler = host.scaler()
        scaler.execute(ScaleAction("add", Role.DECODE, reason="load"), "api")
        while scaler.busy:
            await asyncio.sleep(0.01)
        assert host.dispatcher.phase_of("d1") == InstancePhase.STOPPED and "d1" not in host.instances
        assert host.events_of("failed")[0][3] == "could not start: no room on the node"

    asyncio.run(body())


def test_a_removed_instance_drains_then_stops() -> None:
    async def body() -> None:
        host = Cluster(FakeBackend(ALL), instances(1, 2), ConsoleConfig(instance_drain_timeout_s=0.2))
        scaler = host.scaler()
        assert scaler.execute(ScaleAction("remove", Role.DECODE, "d1", reason="idle"), "api") == "d1"
        assert host.dispatcher.phase_of("d1") == InstancePhase.DRAINING
        while scaler.busy:
            await asyncio.sleep(0.01)
        assert "d1" not in host.instances and host.removed == ["d1"] and ("remove", "d1") in host.fake.calls
        assert host.events_of("removed")[0][3] == "drained"

    asyncio.run(body())


def test_a_flip_changes_the_role_everywhere() -> None:
    async def body() -> None:
        host = Cluster(FakeBackend(ALL), instances(1, 2))
        scaler = host.scaler()
        scaler.execute(ScaleAction("flip", Role.PREFILL, "d1", reason="prefill backlog"), "api")
        while scaler.busy:
            await asyncio.sleep(0.01)
        assert host.instances["d1"].role == Role.PREFILL and host.dispatcher.role_of("d1") == Role.PREFILL
        assert host.events_of("flipped")[0][3] == "decode -> prefill: prefill backlog"

    asyncio.run(body())


def test_what_the_backend_cannot_do_is_refused_and_recorded() -> None:
    host = Cluster(FakeBackend(frozenset()), instances(1, 1))
    scaler = host.scaler()
    with pytest.raises(BackendError):
        scaler.execute(ScaleAction("add", Role.DECODE, reason="load"), "api")
    assert host.events_of("refused") and not scaler.busy

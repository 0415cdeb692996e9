"""RequestServices: the controller bundles its real parts once, each implementing the Protocol beside it."""

from __future__ import annotations

from pathlib import Path

from adapters.store import RunStore
from console.live.admission import HeldQueue, HeldRequests
from console.live.config import ConsoleConfig
from console.live.controller import Controller
from console.live.health import InstanceHealth, LegHealth
from console.live.migrations import Migrations, MigrationWatch
from console.live.outcomes import Outcomes, OutcomeSink
from console.live.tenants import TenantGate, Tenants
from tests.console.live.fakes import FakeBackend, instances


def members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_each_protocol_is_implemented_by_the_part_beside_it() -> None:
    for protocol, part in (
        (TenantGate, Tenants),
        (HeldQueue, HeldRequests),
        (LegHealth, InstanceHealth),
        (OutcomeSink, Outcomes),
        (MigrationWatch, Migrations),
    ):
        assert members(protocol) and members(protocol) <= set(dir(part)), protocol.__name__


def test_the_controller_bundles_its_own_parts_once(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run(kind="live", backend="fake", cluster="1P2D", workload="", policy="round_robin", config={})
    c = Controller(
        ConsoleConfig(policy="round_robin", failure_migration_attempts=2),
        instances(1, 2),
        store=store,
        run_id=run_id,
        run_dir=tmp_path / run_id,
        backend=FakeBackend(),  # type: ignore[arg-type]
    )
    s = c.services
    assert (s.tenants, s.held, s.health, s.outcomes, s.migrations) == (
        c.tenants,
        c.held,
        c.health,
        c.outcomes,
        c.migrations,
    )
    assert s.dispatcher is c.dispatcher and s.instances is c.instances and s.metrics is c.metrics
    assert s.failure_migration_attempts == 2 and s.engine_priorities is False
    c.recorder.close(status="completed")

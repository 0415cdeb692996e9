"""A controller without a network for the advisor's tests: one prefill and two decode fake instances, a real run
store, the advisor on or off."""

from __future__ import annotations

from pathlib import Path

from adapters.store import RunStore
from console.live.config import AdvisorSettings, ConsoleConfig
from console.live.controller import Controller
from tests.console.live.fakes import FakeBackend, instances


def controller(tmp_path: Path, advisor: bool = False) -> Controller:
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run(kind="live", backend="fake", cluster="1P2D", workload="", policy="round_robin", config={})
    config = ConsoleConfig(policy="round_robin", advisor=AdvisorSettings(enabled=advisor, period_s=1, window_s=5))
    return Controller(
        config, instances(1, 2), store=store, run_id=run_id, run_dir=tmp_path / run_id, backend=FakeBackend()
    )  # type: ignore[arg-type]

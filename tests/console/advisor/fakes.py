"""Controllers without a network for the advisor's tests: one prefill and two decode fake instances, a real run
store, the advisor on or off; or two pools (A: A.p0 A.d0, b of model org/B: b.p0 b.d0), the advisor on one."""

from __future__ import annotations

from pathlib import Path

from adapters.store import RunStore
from adapters.vllm.instances import Instance
from console.advisor.figures import Figures
from console.advisor.simulate import Advice, Errors, Ranked
from console.live.config import AdvisorSettings, ConsoleConfig
from console.live.controller import Controller
from console.live.pools import plan_pools
from core.types import Role
from tests.console.live.fakes import FakeBackend, instances


def controller(tmp_path: Path, advisor: bool = False) -> Controller:
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run(kind="live", backend="fake", cluster="1P2D", workload="", policy="round_robin", config={})
    config = ConsoleConfig(policy="round_robin", advisor=AdvisorSettings(enabled=advisor, period_s=1, window_s=5))
    return Controller(
        config, instances(1, 2), store=store, run_id=run_id, run_dir=tmp_path / run_id, backend=FakeBackend()
    )  # type: ignore[arg-type]


def two_pool_controller(tmp_path: Path, advisor: bool = False, advisor_pool: str | None = None) -> Controller:
    """Pools A (model A) and b (model org/B), one prefill and one decode instance each, under round_robin; the
    advisor (on or off) on `advisor_pool` (None: the default, the first pool)."""
    config = ConsoleConfig.model_validate(
        {
            "policy": "round_robin",
            "advisor": {"enabled": advisor, "period_s": 1, "window_s": 5, "pool": advisor_pool},
            "pools": [
                {"model": "A", "prefill": 1, "decode": 1},
                {"model": "org/B", "name": "b", "prefill": 1, "decode": 1},
            ],
        }
    )
    plans = plan_pools(config)
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run(kind="live", backend="fake", cluster="x", workload="", policy="round_robin", config={})
    roles = (Role.PREFILL, Role.DECODE)
    started = [
        [Instance(f"{p.settings.instance_prefix}{r.value[0]}0", r, "http://127.0.0.1:1") for r in roles] for p in plans
    ]
    backends = [FakeBackend(), FakeBackend()]
    return Controller(
        config,
        [],
        store=store,
        run_id=run_id,
        run_dir=tmp_path / run_id,
        backend=backends[0],  # type: ignore[arg-type]
        pools=list(zip(plans, backends, started, strict=True)),  # type: ignore[arg-type]
    )


def figures(ttft_p99: float, attainment: float) -> Figures:
    """A window's figures with P99 TTFT `ttft_p99` and SLO attainment `attainment` (100 requests)."""
    return Figures(100, ttft_p99 / 2, ttft_p99, 0.02, 0.03, attainment, 0, None)


def advice(gain: float, error: float, shown: bool) -> Advice:
    """An advice whose best candidate, prefix_aware, gains `gain` on P99 TTFT over the active round robin, with the
    advisor's error `error` (`shown`: whether the gain is shown)."""
    active = Ranked("active", ("round_robin", {}), ("fcfs", {}), figures(1.0, 0.9), Errors(0.0, 0.0), False, True)
    best = Ranked(
        "routing:prefix_aware", ("prefix_aware", {}), ("fcfs", {}), figures(1.0 - gain, 0.9), Errors(gain, 0.0), shown
    )
    bound = Errors(error, 0.01)
    return Advice({}, "2P2D", "p", figures(1.0, 0.9), figures(1.0, 0.9), bound, bound, [best, active], {}, 0.1, 0)

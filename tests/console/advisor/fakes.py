"""Controllers without a network for the advisor's tests: one prefill and two decode fake instances, a real run
store, the advisor on or off; or two pools (A: A.p0 A.d0, b of model org/B: b.p0 b.d0), the advisor on one.
`advise_once` gives one's advisor a real advice, `served` serves its control API on 127.0.0.1 for the clients (the
CLI, the dashboard) to read."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from adapters.store import RunStore
from adapters.vllm.instances import Instance
from console.advisor.figures import Figures
from console.advisor.simulate import Advice, Errors, Ranked, parse_candidate
from console.advisor.simulate import advise as simulate_advice
from console.advisor.window import window_from_rows
from console.advisor.worker import WorkerAnswer
from console.gateway.app import build_app
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


@contextlib.contextmanager
def served(c: Controller) -> Iterator[str]:
    """`c`'s gateway (its control API) served by uvicorn on a free 127.0.0.1 port, in a thread of its own so that a
    blocking client (the CLI) can call it, until the block ends; yields its URL once it listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    config = uvicorn.Config(
        build_app(c, manage_lifecycle=False), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"control-api-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10.0
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the control API did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10.0)
        assert not thread.is_alive(), "the control API did not stop"


def advise_once(c: Controller, per_pool: int = 20) -> None:
    """One advice for `c`'s advisor, as its worker would give it: `per_pool` requests of each pool's model finished
    over the last 4 s (arrivals 0.15 s apart, 200-token prompts, 32 tokens out, 0.5 s each), the advisor's own
    window of them (its pool's only) re-simulated here on its pool's shape and profile under the active policies
    and least_load, the answer taken as the worker's."""
    adv = c.advisor
    now = time.monotonic()
    rel = now - c.t0
    for pool in c.runtimes:
        for k in range(per_pool):
            arrival = rel - 4.0 + 0.15 * k
            adv.request(
                {
                    "request_id": f"{pool.pool.name}-{k}", "arrival": arrival, "prompt_tokens": 200,
                    "output_tokens": 32, "max_tokens": 32, "status": "ok", "prefill_start": arrival,
                    "first_token": arrival + 0.1, "finish": arrival + 0.5, "ttft": 0.1, "tpot": 0.01,
                    "slo_met": True, "cached_tokens": None, "slo_class": "default", "tenant": "default",
                    "priority": 0, "model": pool.pool.model,
                }
            )
    rows = list(adv.rows)
    window = window_from_rows(rows, **adv.window_args(now, rows, []))
    advice = simulate_advice(window, adv._shape(), adv.profile(), candidates=[parse_candidate("least_load")])
    asyncio.run(adv._take(WorkerAnswer(1, advice, None, 0.5, 0.5, 0.5, 1, time.time())))

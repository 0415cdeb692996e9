"""Runs a live console: start each pool's backend, the controller and the gateway; shut all down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import signal
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from adapters import orphans
from adapters.backends import registry as backends
from adapters.ports import cannot_listen
from adapters.redact import redact_config
from adapters.serving import SHUTDOWN_SIGNALS, ManagedServer
from adapters.store import RunStore
from adapters.vllm.instances import Instance
from console.gateway.app import build_app
from console.live import discovery
from console.live.config import ConsoleConfig
from console.live.controller import Controller
from console.live.policies import check_policies
from console.live.pools import cluster_label, plan_pools, start_backends
from console.live.shutdown import Shutdown
from core.errors import ConfigError

Announce = Callable[["LiveConsole"], None]


GC_YOUNG_THRESHOLD = 5_000
"""Net container allocations between the serving process's young collections (Python's default is 700). Measured
with `gc.callbacks` over 25,600 streamed requests at 64 clients (benchmarks/README.md, "The collector's
thresholds"): at 700 the collector ran every ~23 requests and pushed the requests' short-lived objects into the
older generations, whose collections walk everything the console keeps since start-up: 19 µs of collection a
request (young pauses 0.2 ms, middle ones 0.75 ms every ~250 requests, full ones 19 ms every ~2,800). At 5,000:
7.7 µs a request; young pauses ~1.3 ms every ~360 requests (under one decode step), middle ones ~9 ms every
~4,000, one full collection in the run."""

CLIENT_KEEP_ALIVE_S = 75
"""How long the gateway keeps a client's idle keep-alive connection open (uvicorn's default is 5 s, nginx's 75 s). A
client that reuses a connection the server is closing at that moment loses the request it wrote (aiohttp: "Connection
reset by peer" or "Server disconnected"), and clients pool idle connections for at least as long as uvicorn's
default: httpx and the OpenAI client 5 s, aiohttp (`vllm bench serve`) 15 s. One such loss failed a real-vLLM
replay in CI on 2026-11-30; a client that reused connections idle ~1 s against a 1 s server limit lost 13 in 200."""


@dataclass
class LiveConsole:
    """A started console: what to print and what to stop."""

    url: str
    run_id: str
    token_file: Path
    db: Path
    controller: Controller
    server: ManagedServer
    reaped: list[orphans.Leftover]
    """Instances an earlier, crashed console had left running, stopped before this one started."""


def describe(live: LiveConsole) -> dict[str, Any]:
    """What `up` prints about a started console, as JSON-able data (also the server process's ready line)."""
    return {
        "url": live.url,
        "run_id": live.run_id,
        "token_file": str(live.token_file),
        "db": str(live.db),
        "pid": os.getpid(),
        "cluster": live.controller.state()["cluster"],
        "backend": live.controller.backend.label,
        "log": None,
        "reaped": [
            {"run_id": r.run_id, "instance": r.instance, "pid": r.pid, "stopped": r.stopped} for r in live.reaped
        ],
    }


async def _starting(start: Coroutine[object, object, list[list[Instance]]]) -> list[list[Instance]]:
    """Await a backend's start-up; SIGINT/SIGTERM meanwhile cancel it (the backend then stops what
    it launched) instead of killing the console with its instances left running."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(start)
    received: list[signal.Signals] = []

    def interrupt(sig: signal.Signals) -> None:
        received.append(sig)
        task.cancel()

    for sig in SHUTDOWN_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, interrupt, sig)
    try:
        return await task
    except asyncio.CancelledError:
        if received:
            raise KeyboardInterrupt(f"{received[0].name} during start-up") from None
        raise
    finally:
        for sig in SHUTDOWN_SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


async def run_console(config: ConsoleConfig, on_ready: Announce, *, owner_fd: int | None = None) -> str:
    """Serve until a stop is requested (a signal, the owner pipe `owner_fd` closing without `detach`,
    `POST /control/shutdown`). Returns the run's final status. This process never renders: a
    dashboard is another process, a client of the control API (`console.server_process`)."""
    if config.port and (problem := cannot_listen(config.host, config.port)):  # before anything starts
        raise ConfigError(problem)
    plans = plan_pools(config)  # one pool, or one per [[pools]] entry (refused with why before anything starts)
    reaped = orphans.reap(discovery.runs_dir())  # instances a crashed console left running
    store = RunStore(config.db)
    store.mark_interrupted_runs()
    run_id = store.create_run(
        kind="live",
        backend=config.backend,
        cluster=cluster_label(plans),
        workload=str(config.replay or ""),
        policy=config.policy,
        config=redact_config(config.model_dump(mode="json")),
    )
    run_dir = discovery.runs_dir() / run_id
    pool_backends = [backends.create(config.backend, plan.settings, run_dir) for plan in plans]
    backend = pool_backends[0]
    status = "failed"
    shutdown: Shutdown | None = None
    controller_started = False
    try:
        check_policies(config, backend)
        started = await _starting(start_backends(pool_backends))
        controller = Controller(
            config,
            started[0],
            store=store,
            run_id=run_id,
            run_dir=run_dir,
            backend=backend,
            pools=list(zip(plans, pool_backends, started, strict=True)),
        )
        token_file = controller.write_token()

        def request_shutdown(reason: str) -> None:
            assert shutdown is not None
            shutdown.request(reason)

        app = build_app(controller, manage_lifecycle=False, request_shutdown=request_shutdown)
        server = ManagedServer(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                http="httptools",
                log_level="warning",
                proxy_headers=False,
                access_log=False,
                lifespan="on",
                timeout_keep_alive=CLIENT_KEEP_ALIVE_S,
                timeout_graceful_shutdown=max(1, math.ceil(config.drain_timeout_s)),
            )
        )
        replay_task: asyncio.Task[None] | None = None

        def stop_replay() -> None:
            if controller.replay is not None:
                controller.replay.stop()

        def stopping() -> None:
            assert shutdown is not None
            stop_replay()
            controller.events.close("stopping", reason=shutdown.reason, drain_timeout_s=config.drain_timeout_s)

        shutdown = Shutdown(
            server, drain_timeout_s=config.drain_timeout_s, on_first=stopping, db=store.path, run_id=run_id
        )
        shutdown.install_signal_handlers()
        if owner_fd is not None:
            shutdown.watch_owner(owner_fd)
        await controller.start()
        controller_started = True
        serving = asyncio.create_task(server.serve(), name="gateway")
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if serving.done():
            with contextlib.suppress(SystemExit):  # uvicorn exits when it cannot bind: say why in one line
                serving.result()
            problem = cannot_listen(config.host, config.port) if config.port else None
            raise ConfigError(problem or f"the gateway could not listen on {config.host}:{config.port}")
        port = server.servers[0].sockets[0].getsockname()[1] if config.port == 0 else config.port
        live = LiveConsole(f"http://{config.host}:{port}", run_id, token_file, store.path, controller, server, reaped)
        discovery.announce(live.url, token_file, run_id, db=store.path)
        if config.replay is not None:
            replay_task = start_replay(config, controller, store, live.url)
        # What start-up built (modules, config, policies, tables) lives as long as the console: out of
        # the collector's way, so the full collections that requests' garbage sets off skip it.
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        on_ready(live)
        await serving
        if replay_task is not None:
            stop_replay()
            await replay_task
        status = "interrupted" if shutdown.forced else "completed"
        controller_started = False
        await controller.stop(status=status, drain=not shutdown.forced)
    except (KeyboardInterrupt, asyncio.CancelledError):
        status = "interrupted"
        raise
    finally:
        if controller_started:  # start-up failed after the controller started, or the stop was cancelled
            with contextlib.suppress(Exception):
                await controller.stop(status=status, drain=False)
        discovery.withdraw(run_id)
        for b in pool_backends:
            with contextlib.suppress(Exception):
                await b.stop()
        run = store.get_run(run_id)
        if run.status == "running" or (status == "interrupted" and run.status == "completed"):
            store.finish_run(run_id, status=status)  # the controller closes the run when it got that far
        store.close()
        if shutdown is not None:
            shutdown.disarm()
    return status


def start_replay(config: ConsoleConfig, controller: Controller, store: RunStore, url: str) -> asyncio.Task[None]:
    """Replay `config.replay` into this console's own gateway, recorded as a child run."""
    from adapters.store import RunRecorder
    from console.offline.replay import Replayer
    from core.traces import read_trace

    assert config.replay is not None
    trace = read_trace(config.replay)
    run_id = store.create_run(
        kind="replay",
        backend="client",
        workload=trace.source or trace.name,
        parent_run_id=controller.run_id,
        config={
            "trace": str(config.replay),
            "speed": config.replay_speed,
            "loop": config.replay_loop,
            "hash_block_tokens": config.replay_hash_block_tokens,
        },
    )
    recorder = RunRecorder(store, run_id)
    rep = Replayer.from_trace(
        trace,
        url,  # keeps a Mooncake trace's prefix structure and sessions
        hash_block_tokens=config.replay_hash_block_tokens,
        speed=config.replay_speed,
        loop=config.replay_loop,
        max_context=controller.max_model_len,
        on_result=recorder.request,
    )
    controller.replay = rep
    controller.replay_label = (
        f"{Path(config.replay).name} x{config.replay_speed:g}{' (loop)' if config.replay_loop else ''}"
    )

    async def run() -> None:
        status = "completed"
        try:
            await rep.run(drain_timeout_s=config.drain_timeout_s)
            if rep.status == "stopped":
                status = "interrupted"
        finally:
            recorder.close(status=status, summary=rep.stats.snapshot())

    return asyncio.create_task(run(), name="replay")

"""Runs a live console: start the backend, the controller and the gateway; shut all down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from adapters import orphans
from adapters.backends import registry as backends
from adapters.redact import redact_config
from adapters.serving import SHUTDOWN_SIGNALS, ManagedServer, on_shutdown_signals
from adapters.store import RunStore
from adapters.vllm.instances import Instance
from console import discovery
from console.config import ConsoleConfig
from console.controller import Controller, check_policies
from console.gateway.app import build_app

Announce = Callable[["LiveConsole"], None]


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


async def _starting(start: Coroutine[object, object, list[Instance]]) -> list[Instance]:
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


async def run_console(config: ConsoleConfig, on_ready: Announce, attach_ui: Callable[[LiveConsole], Coroutine[object, object, None]] | None = None) -> str:
    """Serve until Ctrl-C/SIGTERM (or until `attach_ui` returns). Returns the run's final status."""
    reaped = orphans.reap(discovery.runs_dir())  # instances a crashed console left running
    store = RunStore(config.db)
    store.mark_interrupted_runs()
    run_id = store.create_run(
        kind="live", backend=config.backend, cluster=f"{config.prefill}P{config.decode}D",
        workload=str(config.replay or ""), policy=config.policy, config=redact_config(config.model_dump(mode="json")),
    )
    run_dir = discovery.runs_dir() / run_id
    backend = backends.create(config.backend, config.backend_settings(), run_dir)
    status = "failed"
    try:
        check_policies(config, backend)
        instances = await _starting(backend.start())
        controller = Controller(config, instances, store=store, run_id=run_id, run_dir=run_dir, backend=backend)
        token_file = controller.write_token()
        app = build_app(controller)
        server = ManagedServer(
            uvicorn.Config(
                app, host=config.host, port=config.port, http="httptools", log_level="warning", proxy_headers=False,
                access_log=False, lifespan="on", timeout_graceful_shutdown=max(1, math.ceil(config.drain_timeout_s)),
            )
        )
        replay_task: asyncio.Task[None] | None = None

        def stop_replay() -> None:
            if controller.replay is not None:
                controller.replay.stop()

        on_shutdown_signals([server], stop_replay)
        serving = asyncio.create_task(server.serve(), name="gateway")
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if serving.done():
            serving.result()
            raise OSError(f"the gateway could not listen on {config.host}:{config.port}")
        port = server.servers[0].sockets[0].getsockname()[1] if config.port == 0 else config.port
        live = LiveConsole(f"http://{config.host}:{port}", run_id, token_file, store.path, controller, server, reaped)
        discovery.announce(live.url, token_file, run_id)
        if config.replay is not None:
            replay_task = start_replay(config, controller, store, live.url)
        on_ready(live)
        if attach_ui is not None:
            ui: asyncio.Future[None] = asyncio.ensure_future(attach_ui(live))
            done, _ = await asyncio.wait({serving, ui}, return_when=asyncio.FIRST_COMPLETED)
            if ui in done:
                server.should_exit = True
            await serving
        else:
            await serving
        if replay_task is not None:
            stop_replay()
            await replay_task
        status = "completed"
    except (KeyboardInterrupt, asyncio.CancelledError):
        status = "interrupted"
        raise
    finally:
        discovery.withdraw()
        with contextlib.suppress(Exception):
            await backend.stop()
        run = store.get_run(run_id)
        if run.status == "running":  # the controller closes the run when it got that far
            store.finish_run(run_id, status=status)
        store.close()
    return status


def start_replay(config: ConsoleConfig, controller: Controller, store: RunStore, url: str) -> asyncio.Task[None]:
    """Replay `config.replay` into this console's own gateway, recorded as a child run."""
    from adapters.store import RunRecorder
    from console.replay import Replayer
    from core.traces import read_trace

    assert config.replay is not None
    trace = read_trace(config.replay)
    run_id = store.create_run(kind="replay", backend="client", workload=trace.source or trace.name, parent_run_id=controller.run_id,
                              config={"trace": str(config.replay), "speed": config.replay_speed, "loop": config.replay_loop})
    recorder = RunRecorder(store, run_id)
    rep = Replayer(trace.arrivals.tolist(), trace.prompt_tokens.tolist(), trace.output_tokens.tolist(), url,
                   speed=config.replay_speed, loop=config.replay_loop, max_context=controller.max_model_len, on_result=recorder.request)
    controller.replay = rep
    controller.replay_label = f"{Path(config.replay).name} x{config.replay_speed:g}{' (loop)' if config.replay_loop else ''}"

    async def run() -> None:
        status = "completed"
        try:
            await rep.run(drain_timeout_s=config.drain_timeout_s)
            if rep.status == "stopped":
                status = "interrupted"
        finally:
            recorder.close(status=status, summary=rep.stats.snapshot())

    return asyncio.create_task(run(), name="replay")


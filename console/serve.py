"""Runs a live console: start the backend, the controller and the gateway; shut all down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from adapters.serving import ManagedServer, on_shutdown_signals
from adapters.store import RunStore
from console import discovery
from console.backends import make_backend
from console.config import ConsoleConfig
from console.controller import Controller
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


async def run_console(config: ConsoleConfig, on_ready: Announce, attach_ui: Callable[[LiveConsole], Coroutine[object, object, None]] | None = None) -> str:
    """Serve until Ctrl-C/SIGTERM (or until `attach_ui` returns). Returns the run's final status."""
    store = RunStore(config.db)
    store.mark_interrupted_runs()
    run_id = store.create_run(
        kind="live", backend=config.backend, cluster=f"{config.prefill}P{config.decode}D",
        workload=str(config.replay or ""), policy=config.policy, config=config.model_dump(mode="json"),
    )
    run_dir = discovery.runs_dir() / run_id
    backend = make_backend(config, run_dir)
    status = "failed"
    try:
        instances = await backend.start()
        controller = Controller(config, instances, store=store, run_id=run_id, run_dir=run_dir, backend_label=backend.label)
        token_file = controller.write_token()
        app = build_app(controller)
        server = ManagedServer(
            uvicorn.Config(
                app, host=config.host, port=config.port, http="httptools", log_level="warning",
                access_log=False, lifespan="on", timeout_graceful_shutdown=max(1, math.ceil(config.drain_timeout_s)),
            )
        )
        on_shutdown_signals([server])
        serving = asyncio.create_task(server.serve(), name="gateway")
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if serving.done():
            serving.result()
            raise OSError(f"the gateway could not listen on {config.host}:{config.port}")
        port = server.servers[0].sockets[0].getsockname()[1] if config.port == 0 else config.port
        live = LiveConsole(f"http://{config.host}:{port}", run_id, token_file, store.path, controller, server)
        discovery.announce(live.url, token_file, run_id)
        on_ready(live)
        if attach_ui is not None:
            ui: asyncio.Future[None] = asyncio.ensure_future(attach_ui(live))
            done, _ = await asyncio.wait({serving, ui}, return_when=asyncio.FIRST_COMPLETED)
            if ui in done:
                server.should_exit = True
            await serving
        else:
            await serving
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

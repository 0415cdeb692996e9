"""Serve one or more emulated instances (consecutive ports) in one process until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import uvicorn

from adapters.emulator.app import EmulatedInstance
from adapters.emulator.settings import InstanceSettings
from adapters.serving import ManagedServer, on_shutdown_signals


async def serve(settings: list[InstanceSettings]) -> None:
    servers = []
    for s in settings:
        config = uvicorn.Config(
            EmulatedInstance(s), host=s.host, port=s.port, http="httptools", lifespan="on",
            log_level="warning", access_log=False, timeout_keep_alive=30, backlog=4096,
        )
        servers.append(ManagedServer(config))
    on_shutdown_signals(servers)
    await asyncio.gather(*(srv.serve() for srv in servers))


def run(base: InstanceSettings, instances: int = 1) -> None:
    """`instances` independent copies of `base` on ports port, port+1, …"""
    settings = [replace(base, port=base.port + i, seed=base.seed + i, faults=base.faults.model_copy()) for i in range(instances)]
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.Runner()
    with runner:
        runner.run(serve(settings))

"""Serve one or more emulated instances (consecutive ports) in one process until SIGINT/SIGTERM.

Each instance has its own engine, metrics registry, KV table, faults and uvicorn server; they
share the process's event loop (uvloop when installed) and its graceful shutdown.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import uvicorn

from adapters.emulator.app import EmulatedInstance
from adapters.emulator.settings import InstanceSettings
from adapters.serving import ManagedServer, on_shutdown_signals

GRACE_S = 3
"""On SIGTERM, streams still running after this long are cut (vLLM does not drain either)."""


def instance_settings(base: InstanceSettings, instances: int = 1) -> list[InstanceSettings]:
    """`instances` independent copies of `base` on ports port, port+1, … with seeds seed, seed+1, …
    and host-board slots slot, slot+1, … (and KV-event endpoints offset by i, as vLLM offsets them
    per data-parallel rank)."""
    return [
        replace(
            base,
            port=base.port + i,
            seed=base.seed + i,
            kv_events=base.kv_events.for_rank(i),
            host_slot=base.host_slot + i,
        )
        for i in range(instances)
    ]


async def serve(settings: list[InstanceSettings]) -> None:
    servers = []
    for s in settings:
        config = uvicorn.Config(
            EmulatedInstance(s),
            host=s.host,
            port=s.port,
            http="httptools",
            lifespan="on",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=30,
            backlog=4096,
            proxy_headers=False,
            server_header=False,
            timeout_graceful_shutdown=GRACE_S,
        )
        servers.append(ManagedServer(config))
    on_shutdown_signals(servers)
    await asyncio.gather(*(srv.serve() for srv in servers))


def run(base: InstanceSettings, instances: int = 1) -> None:
    """Run until a signal (or an injected exit) ends the process."""
    settings = instance_settings(base, instances)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.Runner()
    with runner:
        runner.run(serve(settings))

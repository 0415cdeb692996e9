"""The `sim` backend: simulated instances served in-process, in the gateway's own event loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import uvicorn

from adapters.emulator.app import EmulatedInstance
from adapters.emulator.settings import InstanceSettings
from adapters.ports import free_port
from adapters.serving import ManagedServer
from adapters.sim_cluster import sim_scheduler
from console.backends import BackendError, instance_ids
from console.config import ConsoleConfig
from console.instances import Instance
from core.perf import get_profile
from core.types import Role


class SimBackend:
    label = "sim"

    def __init__(self, config: ConsoleConfig, run_dir: Path) -> None:
        self.config = config
        self.servers: list[ManagedServer] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.by_id: dict[str, tuple[ManagedServer, asyncio.Task[None]]] = {}

    async def start(self) -> list[Instance]:
        c = self.config
        roles = [Role.PREFILL] * c.prefill + [Role.DECODE] * c.decode
        urls = [self._serve(role, c.instance_base_port + k if c.instance_base_port else free_port(), k) for k, role in enumerate(roles)]
        for _ in range(500):
            if all(s.started for s in self.servers):
                break
            failed = [t for t in self.tasks if t.done()]
            if failed:
                await self.stop()
                raise BackendError(f"a simulated instance could not start: {failed[0].exception()}")
            await asyncio.sleep(0.01)
        else:
            await self.stop()
            raise BackendError("simulated instances did not start within 5 s")
        ids = instance_ids(roles)
        self.by_id = {i: (s, t) for i, s, t in zip(ids, self.servers, self.tasks, strict=True)}
        return [Instance(i, r, u) for i, r, u in zip(ids, roles, urls, strict=True)]

    def _serve(self, role: Role, port: int, seed: int) -> str:
        c = self.config
        profile = get_profile(c.profile)
        settings = InstanceSettings(
            role=role.value, port=port, profile=profile, model=c.served_model_name,
            output_len_dist=c.emulator.output_len_dist or "uniform:1:256", seed=seed,
        )
        app = EmulatedInstance(settings, sim_scheduler)
        server = ManagedServer(uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools", lifespan="on", log_level="warning", access_log=False))
        self.servers.append(server)
        self.tasks.append(asyncio.create_task(server.serve(), name=f"sim-{role.value}-{port}"))
        return f"http://127.0.0.1:{port}"

    async def add(self, role: Role, instance_id: str) -> Instance:
        url = self._serve(role, free_port(), len(self.servers))
        server, task = self.servers[-1], self.tasks[-1]
        self.by_id[instance_id] = (server, task)
        for _ in range(500):
            if server.started:
                return Instance(instance_id, role, url)
            if task.done():
                raise BackendError(f"simulated instance {instance_id} could not start: {task.exception()}")
            await asyncio.sleep(0.01)
        raise BackendError(f"simulated instance {instance_id} did not start within 5 s")

    async def remove(self, instance_id: str) -> None:
        entry = self.by_id.pop(instance_id, None)
        if entry is not None:
            entry[0].should_exit = True
            await asyncio.gather(entry[1], return_exceptions=True)

    async def stop(self) -> None:
        for s in self.servers:
            s.should_exit = True
        await asyncio.gather(*self.tasks, return_exceptions=True)

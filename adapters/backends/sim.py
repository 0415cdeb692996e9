"""The `sim` backend: the simulator's instance model served in-process, in the gateway's own event loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import ClassVar

import uvicorn

from adapters.backends.base import BackendBase, Capability, instance_ids
from adapters.backends.settings import BackendSettings
from adapters.emulator.app import EmulatedInstance
from adapters.emulator.settings import InstanceSettings
from adapters.errors import BackendError
from adapters.ports import free_port
from adapters.serving import ManagedServer
from adapters.sim_cluster import sim_scheduler
from adapters.vllm.instances import Instance
from core.perf import get_profile
from core.types import Role

START_TIMEOUT_S = 5.0


class SimBackend(BackendBase):
    """Simulated instances (FIFO prefill, processor-sharing decode) paced to wall-clock, each
    behind the same vLLM HTTP API as the emulator, all in this process."""

    name: ClassVar[str] = "sim"
    summary: ClassVar[str] = "the simulator's instance model paced to wall-clock, in-process"
    capabilities = frozenset({Capability.SCALE, Capability.ROLE_FLIP})

    def __init__(self, settings: BackendSettings, run_dir: Path) -> None:
        super().__init__(settings, run_dir)
        self.servers: dict[str, tuple[ManagedServer, asyncio.Task[None]]] = {}
        self._seeds = 0

    def _serve(self, instance_id: str, role: Role, port: int) -> str:
        s = self.settings
        settings = InstanceSettings(
            role=role.value,
            port=port,
            profile=get_profile(s.profile),
            model=s.served_model_name,
            output_len_dist=s.emulator.output_len_dist or "uniform:1:256",
            seed=self._seeds,
        )
        self._seeds += 1
        app = EmulatedInstance(settings, sim_scheduler)
        server = ManagedServer(
            uvicorn.Config(
                app, host="127.0.0.1", port=port, http="httptools", lifespan="on", log_level="warning", access_log=False
            )
        )
        self.servers[instance_id] = (server, asyncio.create_task(server.serve(), name=f"sim-{instance_id}-{port}"))
        return f"http://127.0.0.1:{port}"

    async def _started(self, instance_id: str) -> None:
        server, task = self.servers[instance_id]
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not server.started:
            if task.done():
                raise BackendError(f"simulated instance {instance_id} could not start: {task.exception()}")
            if asyncio.get_running_loop().time() > deadline:
                raise BackendError(f"simulated instance {instance_id} did not start within {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.01)

    async def start(self) -> list[Instance]:
        roles = self.settings.initial_roles()
        base = self.settings.instance_base_port
        ids = instance_ids(roles, self.settings.instance_prefix)
        urls = [
            self._serve(iid, role, base + k if base else free_port())
            for k, (iid, role) in enumerate(zip(ids, roles, strict=True))
        ]
        try:
            for iid in ids:
                await self._started(iid)
        except BaseException:
            await self.stop()
            raise
        return [Instance(i, r, u) for i, r, u in zip(ids, roles, urls, strict=True)]

    async def add(self, role: Role, instance_id: str) -> Instance:
        url = self._serve(instance_id, role, free_port())
        try:
            await self._started(instance_id)
        except BaseException:
            await self.remove(instance_id)
            raise
        return Instance(instance_id, role, url)

    async def remove(self, instance_id: str) -> None:
        entry = self.servers.pop(instance_id, None)
        if entry is not None:
            entry[0].should_exit = True
            await asyncio.gather(entry[1], return_exceptions=True)

    async def flip(self, instance_id: str, role: Role) -> None:
        """Simulated instances serve both legs: the flip is the console's routing change."""

    async def stop(self) -> None:
        entries, self.servers = list(self.servers.values()), {}
        for server, _ in entries:
            server.should_exit = True
        await asyncio.gather(*(t for _, t in entries), return_exceptions=True)

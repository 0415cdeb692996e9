"""The embedded default backend: one emulator process per instance, so one can fail alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

from adapters.emulator.process import EmulatorProcess
from adapters.ports import free_port
from console.backends import instance_ids
from console.config import ConsoleConfig
from console.instances import Instance
from core.types import Role


class EmulatorBackend:
    label = "emulator"

    def __init__(self, config: ConsoleConfig, run_dir: Path) -> None:
        self.config = config
        self.log_dir = run_dir / "logs"
        self.procs: list[EmulatorProcess] = []
        self.by_id: dict[str, EmulatorProcess] = {}

    def _args(self) -> list[str]:
        c, e = self.config, self.config.emulator
        args = ["--profile", c.profile, "--model", c.served_model_name]
        if e.max_num_seqs:
            args += ["--max-num-seqs", str(e.max_num_seqs)]
        if e.kv_capacity_tokens:
            args += ["--kv-capacity-tokens", str(e.kv_capacity_tokens)]
        if e.output_len_dist:
            args += ["--output-len-dist", e.output_len_dist]
        return args + list(e.extra_args)

    async def start(self) -> list[Instance]:
        roles = [Role.PREFILL] * self.config.prefill + [Role.DECODE] * self.config.decode
        base = self.config.instance_base_port
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for k, role in enumerate(roles):
            port = base + k if base else free_port()
            self.procs.append(EmulatorProcess(role.value, port, [*self._args(), "--seed", str(k)], log_path=self.log_dir / f"{role.value}-{port}.log").start())
        try:
            await asyncio.gather(*(asyncio.to_thread(p.wait_ready, 60.0) for p in self.procs))
        except BaseException:
            await self.stop()
            raise
        ids = instance_ids(roles)
        self.by_id = dict(zip(ids, self.procs, strict=True))
        return [Instance(i, r, p.url, pid=p.pid) for i, r, p in zip(ids, roles, self.procs, strict=True)]

    async def add(self, role: Role, instance_id: str) -> Instance:
        """Start one more emulator process (scale out)."""
        port = free_port()
        p = EmulatorProcess(role.value, port, [*self._args(), "--seed", str(len(self.procs))], log_path=self.log_dir / f"{role.value}-{port}.log").start()
        self.procs.append(p)
        self.by_id[instance_id] = p
        try:
            await asyncio.to_thread(p.wait_ready, 60.0)
        except BaseException:
            await asyncio.to_thread(p.stop)
            raise
        return Instance(instance_id, role, p.url, pid=p.pid)

    async def remove(self, instance_id: str) -> None:
        """Stop the process behind an instance (scale in)."""
        p = self.by_id.pop(instance_id, None)
        if p is not None:
            await asyncio.to_thread(p.stop)

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in self.procs))

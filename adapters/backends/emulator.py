"""The embedded default backend: one emulator process per instance, so one can fail alone."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, ClassVar

import httpx

from adapters import orphans
from adapters.backends.base import BackendBase, Capability, instance_ids
from adapters.backends.settings import BackendSettings
from adapters.emulator.process import EmulatorProcess
from adapters.emulator.settings import RUNTIME_ENV
from adapters.errors import BackendError
from adapters.ports import free_port
from adapters.vllm.instances import Instance
from core.types import Role

READY_TIMEOUT_S = 60.0
MIGRATE_TIMEOUT_S = 60.0
"""How long a migration (all its stages) may take before the console gives it up."""


def emulator_args(settings: BackendSettings) -> list[str]:
    """The `emulate` flags every emulated instance of these settings gets (port, host, role and seed aside)."""
    s, e = settings, settings.emulator
    args = ["--profile", s.profile, "--model", s.served_model_name, "--scheduling-policy", e.scheduling_policy]
    if e.max_num_seqs:
        args += ["--max-num-seqs", str(e.max_num_seqs)]
    if e.kv_capacity_tokens:
        args += ["--kv-capacity-tokens", str(e.kv_capacity_tokens)]
    if e.output_len_dist:
        args += ["--output-len-dist", e.output_len_dist]
    if e.otlp_traces_endpoint:
        args += ["--otlp-traces-endpoint", e.otlp_traces_endpoint, "--otlp-traces-protocol", e.otlp_traces_protocol]
    if e.enable_lora:
        args += ["--enable-lora", "--max-loras", str(e.max_loras), "--max-lora-rank", str(e.max_lora_rank)]
        if e.max_cpu_loras:
            args += ["--max-cpu-loras", str(e.max_cpu_loras)]
    return args + list(e.extra_args)


def emulator_env(settings: BackendSettings) -> dict[str, str]:
    """The environment every emulated instance of these settings gets beyond the console's: with LoRA on,
    vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, so the console can load adapters through the instances' endpoints."""
    return {RUNTIME_ENV: "true"} if settings.emulator.enable_lora else {}


async def migrate_emulated(request_id: str, source: Instance, target: Instance) -> dict[str, Any]:
    """Ask the emulated `source` to move a running request to `target` (its /admin/migrate); returns
    what the source reported; raises BackendError when the move was given up. Any backend whose
    instances are emulated (this one, the Ray backend's emulator engine) migrates through it."""
    body = {"request_id": request_id, "target": target.url}
    try:
        async with httpx.AsyncClient(timeout=MIGRATE_TIMEOUT_S) as http:
            r = await http.post(source.url + "/admin/migrate", json=body)
    except httpx.HTTPError as e:
        raise BackendError(f"migration of {request_id} from {source.id}: {type(e).__name__}: {e}") from None
    try:
        answer = r.json()
    except ValueError:
        answer = {}
    if r.status_code != 200 or not isinstance(answer, dict):
        why = answer.get("error") if isinstance(answer, dict) and answer.get("error") else r.text[:200]
        raise BackendError(f"{source.id} gave up migrating {request_id} to {target.id}: {why}")
    return answer


class EmulatorBackend(BackendBase):
    """GPU-free emulated vLLM instances (`sibyl-console emulate`), one process each.

    Every emulated instance serves both P/D legs (like vLLM's kv_both), so a role flip is a
    routing change; scale-out starts a process, scale-in stops a drained one."""

    name: ClassVar[str] = "emulator"
    summary: ClassVar[str] = "emulated vLLM processes on this machine (no GPU); the default"
    capabilities = frozenset({Capability.SCALE, Capability.ROLE_FLIP, Capability.PRIORITY, Capability.MIGRATION})

    def __init__(self, settings: BackendSettings, run_dir: Path) -> None:
        super().__init__(settings, run_dir)
        caps = {Capability.SCALE, Capability.ROLE_FLIP, Capability.MIGRATION}
        if settings.emulator.scheduling_policy == "priority":
            caps.add(Capability.PRIORITY)
        if settings.emulator.data_parallel_size > 1:
            caps.add(Capability.DATA_PARALLEL)
        self.capabilities = frozenset(caps)
        self.procs: dict[str, EmulatorProcess] = {}
        self.events: dict[int, tuple[str, str]] = {}
        """Instance port → (KV-event endpoint, replay endpoint), when instances publish KV events."""
        self._seeds = 0
        self.board_path = run_dir / "host-board"
        """The instances' host board (adapters/emulator/host_board.py): they share what they stream.
        An instance zeroes its slot when it stops; one that crashed drops out as its last rate lapses."""
        self._slots: dict[int, int] = {}
        """Instance port → its slot on the board."""

    def _args(self) -> list[str]:
        return emulator_args(self.settings)

    def _spawn(self, role: Role, port: int) -> EmulatorProcess:
        seed = self._seeds
        self._seeds += 1
        log = self.log_dir / f"{role.value}-{port}.log"
        dp = self._dp_size(role)
        ranks = ["--data-parallel-size", str(dp)] if dp > 1 else []
        events: list[str] = []
        if self.settings.emulator.kv_events:
            pub, replay = free_port(), free_port()
            self.events[port] = (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
            events = [
                "--kv-events-config",
                json.dumps(
                    {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": f"tcp://*:{pub}",
                        "replay_endpoint": f"tcp://*:{replay}",
                    }
                ),
            ]
        slot = min(set(range(len(self._slots) + 1)) - set(self._slots.values()))
        self._slots[port] = slot
        board = ["--host-board", str(self.board_path), "--host-slot", str(slot)]
        return EmulatorProcess(
            role.value,
            port,
            [*self._args(), *ranks, *events, *board, "--seed", str(seed)],
            log_path=log,
            env=emulator_env(self.settings),
        ).start()

    def _instance(self, iid: str, role: Role, p: EmulatorProcess) -> Instance:
        pub, replay = self.events.get(p.port, (None, None))
        return Instance(
            iid, role, p.url, pid=p.pid, dp_size=self._dp_size(role), kv_events_endpoint=pub, kv_events_replay=replay
        )

    def _dp_size(self, role: Role) -> int:
        """Decode instances are data-parallel groups when the settings ask for ranks."""
        return self.settings.emulator.data_parallel_size if role == Role.DECODE else 1

    async def start(self) -> list[Instance]:
        roles = self.settings.initial_roles()
        base = self.settings.instance_base_port
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ids = instance_ids(roles, self.settings.instance_prefix)
        for k, (iid, role) in enumerate(zip(ids, roles, strict=True)):
            self.procs[iid] = self._spawn(role, base + k if base else free_port())
            orphans.record(self.run_dir, iid, self.procs[iid].pid or 0)
        try:
            await asyncio.gather(*(asyncio.to_thread(p.wait_ready, READY_TIMEOUT_S) for p in self.procs.values()))
        except BaseException:
            await self.stop()
            raise
        return [self._instance(iid, role, self.procs[iid]) for iid, role in zip(ids, roles, strict=True)]

    async def add(self, role: Role, instance_id: str) -> Instance:
        """Start one more emulator process and wait until it answers /health."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        p = self.procs[instance_id] = self._spawn(role, free_port())
        orphans.record(self.run_dir, instance_id, p.pid or 0)
        try:
            await asyncio.to_thread(p.wait_ready, READY_TIMEOUT_S)
        except BaseException:
            self.procs.pop(instance_id, None)
            await asyncio.to_thread(p.stop)
            orphans.forget(self.run_dir, instance_id)
            raise
        return self._instance(instance_id, role, p)

    async def remove(self, instance_id: str) -> None:
        """Stop the (drained) process behind an instance."""
        p = self.procs.pop(instance_id, None)
        if p is not None:
            await asyncio.to_thread(p.stop)
            orphans.forget(self.run_dir, instance_id)
            self._slots.pop(p.port, None)

    async def migrate(self, request_id: str, source: Instance, target: Instance) -> dict[str, Any]:
        """Llumnix-style staged KV copy between two emulated instances (adapters/emulator/migration.py)."""
        self.require(Capability.MIGRATION)
        return await migrate_emulated(request_id, source, target)

    async def flip(self, instance_id: str, role: Role) -> None:
        """Emulated instances serve both legs: the flip is the console's routing change (not for a
        data-parallel group, which serves decode legs only)."""
        self.require(Capability.ROLE_FLIP)
        if role == Role.PREFILL and self.settings.emulator.data_parallel_size > 1:
            raise BackendError(
                f"{instance_id} is a data-parallel decode group: it serves decode legs only and cannot flip to prefill"
            )

    async def stop(self) -> None:
        procs, self.procs = dict(self.procs), {}
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in procs.values()))
        for iid, p in procs.items():
            orphans.forget(self.run_dir, iid)
            self._slots.pop(p.port, None)

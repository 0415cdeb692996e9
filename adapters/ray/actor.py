"""The Ray actor behind one instance: starts its engine on the node Ray placed it on, says where, stops it.

The engine runs as a child of the actor's worker process through adapters.parent_watch, so it
stops by itself when the actor goes in any way (`ray.kill`, its node dying, the console's job
ending). The actor's methods run on its worker's main thread (a synchronous actor with one slot),
which is the thread the parent-death signal is tied to.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from adapters.backends.emulator import emulator_args
from adapters.backends.settings import BackendSettings
from adapters.backends.vllm import instance_specs
from adapters.emulator.process import EmulatorProcess
from adapters.errors import BackendError
from adapters.ports import free_port
from adapters.vllm.launcher import LaunchedInstance, VllmCluster
from adapters.vllm.platform import SETUP_HINT, find_vllm_executable
from core.types import Role


@dataclass(frozen=True)
class Launch:
    """What one actor is asked to start."""

    instance_id: str
    role: Role
    engine: Literal["emulator", "vllm"]
    settings: BackendSettings
    log_dir: str
    """Where the engine's log goes, on the node it runs on."""
    seed: int
    timeout_s: float
    """How long the engine may take to answer /health."""
    loopback: bool = False
    """Bind the engine to 127.0.0.1 (a local Ray: every node is this host) instead of the node's address."""


@dataclass(frozen=True)
class Placement:
    """Where an instance ended up."""

    url: str
    node_id: str
    node_ip: str
    pid: int
    """The engine's process id on its node."""
    log_path: str

    @property
    def node(self) -> str:
        """How the dashboard names the node: its IP and the start of its Ray node id."""
        return f"{self.node_ip} {self.node_id[:8]}"


def here() -> tuple[str, str]:
    """This worker's Ray node id and the address its node is reachable at."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return node_id, str(node["NodeManagerAddress"])
    return node_id, str(ray.util.get_node_ip_address())


class InstanceActor:
    """One instance's engine process (wrapped with `ray.remote` by the backend)."""

    def __init__(self) -> None:
        self.engine: EmulatorProcess | LaunchedInstance | None = None
        self.placement: Placement | None = None

    def start(self, launch: Launch) -> Placement:
        """Start the engine on a free port of this node and wait until it answers /health."""
        node_id, ip = here()
        host = "127.0.0.1" if launch.loopback else ip
        port = free_port(host)
        log_dir = Path(launch.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        if launch.engine == "emulator":
            log = log_dir / f"{launch.instance_id}-{port}.log"
            proc = EmulatorProcess(
                launch.role.value,
                port,
                [*emulator_args(launch.settings), "--seed", str(launch.seed)],
                host=host,
                log_path=log,
            )
            self.engine = proc.start()
            try:
                proc.wait_ready(launch.timeout_s)
            except BaseException:
                self.stop()
                raise
            url, pid = proc.url, proc.pid or 0
        else:
            launched = self._start_vllm(launch, host, port)
            self.engine = launched
            url, pid, log = launched.url, launched.pid, launched.log_path
        self.placement = Placement(url, node_id, ip, pid, str(log))
        return self.placement

    def _start_vllm(self, launch: Launch, host: str, port: int) -> LaunchedInstance:
        s = launch.settings
        vllm_bin = find_vllm_executable(s.vllm.venv)
        if vllm_bin is None:
            raise BackendError(f"no `vllm` executable on Ray node {host}: {SETUP_HINT}")
        (spec,) = instance_specs(s, [launch.role], [port])  # the `vllm serve` line the vllm backend builds
        update: dict[str, object] = {"host": host}
        tp = s.ray.tensor_parallel_size
        if tp > 1 and "--tensor-parallel-size" not in spec.extra_args:
            update["extra_args"] = [*spec.extra_args, "--tensor-parallel-size", str(tp)]
        cluster = VllmCluster(
            [spec.model_copy(update=update)], launch.log_dir, vllm_bin, health_timeout_s=launch.timeout_s, cores=[]
        )
        (launched,) = cluster.start()  # stops what it started if it fails
        return launched

    def ping(self) -> str | None:
        """None while the engine runs; why not otherwise."""
        if self.engine is None:
            return "its engine was stopped"
        if self.engine.alive():
            return None
        code = self.engine.proc.poll() if self.engine.proc is not None else None
        where = f" on Ray node {self.placement.node_ip}" if self.placement else ""
        return f"its engine process exited with code {code}{where}"

    def where(self) -> Placement | None:
        return self.placement

    def stop(self) -> None:
        """Stop the engine (SIGTERM, then SIGKILL after a grace period)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.stop()

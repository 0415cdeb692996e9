"""Ray cluster plumbing for the ray backend: join or start Ray, what each instance requests, where it may go,
why it died.

Everything here blocks (Ray's client calls do): the backend runs it in a worker thread.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from types import ModuleType
from typing import Any, TypeVar

from adapters.backends.settings import BackendSettings
from adapters.errors import BackendError
from core.errors import ConfigError
from core.types import Role

T = TypeVar("T")
INSTALL_HINT = "the ray backend needs Ray, an optional extra: pip install 'sibyl-console[ray]'"
LOCAL_CAPACITY = 1024.0
"""How much of each custom resource a local Ray offers (every instance fits on the one node)."""
REACH_TIMEOUT_S = 5.0
"""How long the TCP check of a cluster address may take."""
PLACEMENT_TIMEOUT_S = 60.0
"""How long a placement group (instances with several GPUs) may wait for its GPUs."""


def import_ray() -> ModuleType:
    """The `ray` module, or a BackendError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise BackendError(INSTALL_HINT) from None
    return ray


class OwnerThread:
    """One daemon thread that runs `ray.init` and, at the end, `ray.shutdown`, and lives as long as
    the connection: a local Ray's processes get a parent-death signal tied to the thread that
    started them, so they must not be started from a pooled or short-lived thread. Being a
    daemon, a call that hangs (`ray.init` on an address that is not Ray's) never keeps the
    console from exiting."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ray-owner", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._calls.put((fn, fut))
        return fut

    def close(self) -> None:
        """End the thread after the calls already submitted."""
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Fail fast when nothing listens at a HOST:PORT (or ray://HOST:PORT) address: `ray.init`
    would retry for many minutes. Other forms ("auto") are left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise BackendError(
            f"no Ray cluster answers at {address} ({e.strerror or type(e).__name__}); "
            "start one there with `ray start --head` or leave --ray-address out for a local Ray"
        ) from None


def connect(settings: BackendSettings) -> bool:
    """Join the cluster at `settings.ray.address`, or start a local Ray (no dashboard; Ray 2.60
    refuses a loopback node address, so it listens on this host's) offering the custom resources
    the settings request. True when this call connected (the backend then disconnects on stop,
    which also ends a local Ray); False when this process was connected already."""
    ray = import_ray()
    r = settings.ray
    if ray.is_initialized():
        return False
    common: dict[str, Any] = {"namespace": r.namespace, "log_to_driver": False, "logging_level": "WARNING"}
    try:
        if r.address:
            check_reachable(r.address)
            ray.init(address=r.address, **common)
        else:  # address="local": a new Ray for this console, even with RAY_ADDRESS set
            wanted = {name for role in r.resources.values() for name in role}
            ray.init(
                address="local",
                include_dashboard=False,
                resources={name: LOCAL_CAPACITY for name in sorted(wanted)},
                **common,
            )
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
        where = f"join the Ray cluster at {r.address}" if r.address else "start a local Ray"
        raise BackendError(f"cannot {where}: {e}") from None
    return True


def disconnect() -> None:
    """Leave the cluster (a local Ray this process started stops with it; a remote one keeps running)."""
    ray = import_ray()
    if ray.is_initialized():
        ray.shutdown()


def needs_gpus(settings: BackendSettings) -> int:
    """GPUs one instance reserves: the tensor-parallel size for vLLM off CPU, none for the emulator."""
    if settings.ray.engine == "vllm" and settings.vllm.device != "cpu":
        return settings.ray.tensor_parallel_size
    return 0


def request(settings: BackendSettings, role: Role) -> dict[str, float]:
    """Everything one instance of `role` asks Ray for, Ray's own resources included (zeros left out)."""
    want = {"CPU": settings.ray.num_cpus, "GPU": float(needs_gpus(settings)), **settings.ray.resources_for(role)}
    return {k: v for k, v in want.items() if v > 0}


def check_placeable(settings: BackendSettings, roles: list[Role]) -> None:
    """Refuse at once (instead of waiting forever) a role that no live node could ever hold."""
    ray = import_ray()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    for role in dict.fromkeys(roles):
        want = request(settings, role)
        if any(all(node.get(k, 0.0) >= v for k, v in want.items()) for node in nodes):
            continue
        have = ", ".join(sorted({k for node in nodes for k in node if not k.startswith("node:")})) or "nothing"
        hint = " (vLLM's CPU backend: set vllm.device = 'cpu')" if "GPU" in want else ""
        raise ConfigError(
            f"no Ray node offers what a {role.value} instance requests, {want}{hint}; the nodes offer: {have}"
        )


def actor_options(settings: BackendSettings, role: Role, name: str, placement_group: Any = None) -> dict[str, Any]:
    """`ActorClass.options(...)` for one instance: its name, resources and (with several GPUs) its placement group."""
    r = settings.ray
    opts: dict[str, Any] = {
        "name": name,
        "namespace": r.namespace,
        "num_cpus": r.num_cpus,
        "num_gpus": needs_gpus(settings),
        "resources": r.resources_for(role),
        "max_restarts": 0,
        "max_concurrency": 1,
    }
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=0)
    return opts


def reserve(settings: BackendSettings, role: Role, name: str) -> Any:
    """For an instance with several GPUs: a placement group that will hold them together on one
    node (`vllm serve` runs its tensor-parallel workers on its own node); None otherwise. It is
    created at once; `wait_reserved` waits until Ray has reserved it."""
    if needs_gpus(settings) <= 1:
        return None
    import_ray()
    from ray.util.placement_group import placement_group

    return placement_group([request(settings, role)], strategy="STRICT_PACK", name=name)


def wait_reserved(settings: BackendSettings, placement_group: Any, name: str) -> None:
    ray = import_ray()
    ready, _ = ray.wait([placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        raise BackendError(
            f"{name}: no Ray node had {needs_gpus(settings)} GPUs free within {PLACEMENT_TIMEOUT_S:.0f} s"
        )


def release(placement_group: Any) -> None:
    if placement_group is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(placement_group)


def alive_nodes() -> dict[str, bool]:
    """Ray node id → alive, for every node the cluster knows."""
    return {str(n["NodeID"]): bool(n.get("Alive")) for n in import_ray().nodes()}


def death_reason(error: BaseException) -> str:
    """The line of a Ray actor error that says why (e.g. "...killed by `ray.kill`.")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    why = next((line for line in reversed(lines) if "because" in line or "died" in line), lines[-1] if lines else "")
    return why or type(error).__name__


def task_error(error: BaseException) -> str:
    """What went wrong inside an actor's method, without Ray's traceback wrapping."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    return death_reason(error)

"""The Backend protocol every instance runner implements, and the capabilities it declares.

A backend starts and stops the instances of one cluster, adds an instance of a role, stops one
(after the console has drained it), and optionally flips an instance's role. What it can do
beyond start/stop it declares in `capabilities`; the console asks before it offers an action and
refuses clearly what a backend cannot do, rather than probing for methods.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import httpx

from adapters.backends.settings import BackendSettings
from adapters.errors import CapabilityError
from adapters.vllm.instances import Instance
from core.types import Role


class Capability(StrEnum):
    """Operations beyond start/stop that a backend may support."""

    SCALE = "scale"
    """Add instances and stop drained ones."""
    ROLE_FLIP = "role_flip"
    """Switch an instance between prefill and decode without losing it."""
    MIGRATION = "migration"
    """Move a running request's KV and decoding to another decode instance."""
    PRIORITY = "priority"
    """The engines order waiting requests by the request's `priority` field."""
    DATA_PARALLEL = "data_parallel"
    """Decode instances are data-parallel groups whose rank can be chosen per request."""


CAPABILITY_HELP: dict[Capability, str] = {
    Capability.SCALE: "adding and removing instances",
    Capability.ROLE_FLIP: "flipping an instance between prefill and decode",
    Capability.MIGRATION: "moving a running request to another decode instance",
    Capability.PRIORITY: "ordering waiting requests by priority inside the engine",
    Capability.DATA_PARALLEL: "choosing a data-parallel rank per request",
}


@runtime_checkable
class Backend(Protocol):
    """Runs the instances of one live cluster."""

    name: ClassVar[str]
    summary: ClassVar[str]
    label: str
    """How runs and the dashboard name this backend (e.g. "vllm-attached")."""
    capabilities: frozenset[Capability]
    """On the class: every capability it can have; on an instance: what it has with its settings
    (e.g. vLLM flips roles only with kv_both)."""

    async def start(self) -> list[Instance]:
        """Start (or reach) the initial instances; stop whatever was started if this fails."""
        ...

    async def stop(self) -> None:
        """Stop every instance this backend started (attached ones are left running)."""
        ...

    async def add(self, role: Role, instance_id: str) -> Instance:
        """Start one more instance of `role` and return it once it answers /health (SCALE)."""
        ...

    async def remove(self, instance_id: str) -> None:
        """Stop one instance; the console has drained it already (SCALE)."""
        ...

    async def flip(self, instance_id: str, role: Role) -> None:
        """Make an idle instance serve `role` from now on (ROLE_FLIP)."""
        ...

    async def migrate(self, request_id: str, source: Instance, target: Instance) -> dict[str, Any]:
        """Move a running request's KV and decoding from `source` to `target` (MIGRATION); returns
        what the source reported; raises BackendError when the move was given up."""
        ...

    def on_lost(self, callback: Callable[[str, str], None]) -> None:
        """Call `callback(instance_id, reason)` when the backend itself sees an instance die (its
        process, actor or node); backends that cannot see that leave it to the /health probes."""
        ...


class BackendBase:
    """Shared plumbing: settings, log folder, and clear refusals for undeclared capabilities."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    capabilities: frozenset[Capability] = frozenset()

    def __init__(self, settings: BackendSettings, run_dir: Path) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.label = self.name

    def require(self, capability: Capability) -> None:
        require(self, capability)

    async def add(self, role: Role, instance_id: str) -> Instance:
        self.require(Capability.SCALE)
        raise AssertionError("a backend declaring SCALE must implement add()")

    async def remove(self, instance_id: str) -> None:
        self.require(Capability.SCALE)
        raise AssertionError("a backend declaring SCALE must implement remove()")

    async def flip(self, instance_id: str, role: Role) -> None:
        self.require(Capability.ROLE_FLIP)
        raise AssertionError("a backend declaring ROLE_FLIP must implement flip()")

    async def migrate(self, request_id: str, source: Instance, target: Instance) -> dict[str, Any]:
        self.require(Capability.MIGRATION)
        raise AssertionError("a backend declaring MIGRATION must implement migrate()")

    def on_lost(self, callback: Callable[[str, str], None]) -> None:
        """No loss signal of its own: the console's /health probes find dead instances."""


class Declares(Protocol):
    """Anything that names itself and declares capabilities (a backend)."""

    label: str
    capabilities: frozenset[Capability]


def require(backend: Declares, capability: Capability) -> None:
    """Raise CapabilityError, naming what the backend can do instead, unless it declares `capability`."""
    if capability not in backend.capabilities:
        have = ", ".join(sorted(c.value for c in backend.capabilities)) or "none beyond start/stop"
        raise CapabilityError(
            f"the {backend.label} backend does not support {CAPABILITY_HELP[capability]} (its capabilities: {have})"
        )


def instance_ids(roles: list[Role], prefix: str = "") -> list[str]:
    """p0, p1, …, d0, d1, …, b0, … in the order given, each after `prefix` (a pool's, e.g. `A.`)."""
    counters: dict[Role, int] = {}
    out = []
    for r in roles:
        k = counters.get(r, 0)
        counters[r] = k + 1
        out.append(f"{prefix}{r.value[0]}{k}")
    return out


async def unhealthy(urls: list[str], timeout_s: float = 5.0) -> list[str]:
    """The URLs whose /health did not answer 200 within the timeout, with the reason."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:

        async def bad(url: str) -> str | None:
            try:
                r = await client.get(url.rstrip("/") + "/health")
                return None if r.status_code == 200 else f"{url} (/health {r.status_code})"
            except httpx.HTTPError as e:
                return f"{url} ({type(e).__name__})"

        return [b for b in await asyncio.gather(*(bad(u) for u in urls)) if b]

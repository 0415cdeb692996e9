"""Backends of a live console: the instances `up` starts (emulator, real vLLM) or attaches to."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

import httpx

from console.config import ConsoleConfig
from console.instances import Instance
from core.errors import ConfigError, SibylError
from core.types import Role


class BackendError(SibylError):
    """Instances could not be started or reached."""


class Backend(Protocol):
    label: str

    async def start(self) -> list[Instance]: ...

    async def stop(self) -> None: ...


def instance_ids(roles: list[Role]) -> list[str]:
    """p0, p1, …, d0, d1, …, b0, … in the order given."""
    counters: dict[Role, int] = {}
    out = []
    for r in roles:
        k = counters.get(r, 0)
        counters[r] = k + 1
        out.append(f"{r.value[0]}{k}")
    return out


async def check_health(urls: list[str], timeout_s: float = 5.0) -> list[str]:
    """URLs whose /health did not answer 200 within the timeout."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:

        async def bad(url: str) -> str | None:
            try:
                r = await client.get(url.rstrip("/") + "/health")
                return None if r.status_code == 200 else f"{url} (/health {r.status_code})"
            except httpx.HTTPError as e:
                return f"{url} ({type(e).__name__})"

        return [b for b in await asyncio.gather(*(bad(u) for u in urls)) if b]


class AttachBackend:
    """Instances started elsewhere (other nodes): the console only routes to and watches them."""

    label = "attached"

    def __init__(self, urls: dict[str, list[str]], label: str = "attached") -> None:
        if not urls.get("prefill") and not urls.get("both"):
            raise ConfigError("--attach needs at least one prefill (or both) URL")
        if not urls.get("decode") and not urls.get("both"):
            raise ConfigError("--attach needs at least one decode (or both) URL")
        self.urls = urls
        self.label = label

    async def start(self) -> list[Instance]:
        pairs = [(Role(role), url.rstrip("/")) for role, urls in self.urls.items() for url in urls]
        down = await check_health([u for _, u in pairs])
        if down:
            raise BackendError(f"attached instances are not healthy: {', '.join(down)}")
        ids = instance_ids([r for r, _ in pairs])
        return [Instance(i, r, u) for i, (r, u) in zip(ids, pairs, strict=True)]

    async def stop(self) -> None:
        """Attached instances belong to someone else: leave them running."""


def make_backend(config: ConsoleConfig, run_dir: Path) -> Backend:
    if config.attach:
        return AttachBackend(config.attach, label=f"{config.backend}-attached")
    if config.backend == "emulator":
        from console.emulator_backend import EmulatorBackend

        return EmulatorBackend(config, run_dir)
    if config.backend == "sim":
        from console.sim_backend import SimBackend

        return SimBackend(config, run_dir)
    if config.backend == "vllm":
        from console.vllm_backend import VllmBackend

        return VllmBackend(config, run_dir)
    raise ConfigError(f"unknown backend {config.backend!r}: emulator, sim or vllm")

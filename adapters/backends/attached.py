"""Instances started elsewhere (other nodes, another team's vLLM): the console only routes to them."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from adapters.backends.base import BackendBase, Capability, instance_ids, unhealthy
from adapters.backends.settings import BackendSettings
from adapters.errors import BackendError
from adapters.vllm.instances import Instance
from core.errors import ConfigError
from core.types import Role


class AttachedBackend(BackendBase):
    """Routes to and watches running instances; never starts or stops them.

    Role flips are a routing change only (no process is touched), so they are offered when the
    operator says the instances serve both legs (`--attach both=URL`, vLLM's `kv_both`)."""

    name: ClassVar[str] = "attached"
    summary: ClassVar[str] = "instances started elsewhere; routed to and watched, never stopped"

    def __init__(self, settings: BackendSettings, run_dir: Path, label: str = "attached") -> None:
        super().__init__(settings, run_dir)
        urls = settings.attach or {}
        if not urls.get("prefill") and not urls.get("both"):
            raise ConfigError("--attach needs at least one prefill (or both) URL")
        if not urls.get("decode") and not urls.get("both"):
            raise ConfigError("--attach needs at least one decode (or both) URL")
        self.urls = urls
        self.label = label
        caps = {Capability.ROLE_FLIP} if urls.get("both") else set()
        if settings.vllm.data_parallel_size > 1:
            caps.add(Capability.DATA_PARALLEL)
        self.capabilities = frozenset(caps)

    async def start(self) -> list[Instance]:
        pairs = [(Role(role), url.rstrip("/")) for role, urls in self.urls.items() for url in urls]
        down = await unhealthy([u for _, u in pairs])
        if down:
            raise BackendError(f"attached instances are not healthy: {', '.join(down)}")
        ids = instance_ids([r for r, _ in pairs], self.settings.instance_prefix)
        dp = self.settings.vllm.data_parallel_size
        return [
            Instance(i, r, u, managed=False, dp_size=dp if r == Role.DECODE else 1)
            for i, (r, u) in zip(ids, pairs, strict=True)
        ]

    async def stop(self) -> None:
        """Attached instances belong to someone else: leave them running."""

    async def flip(self, instance_id: str, role: Role) -> None:
        """Nothing to do on the instance: it serves both legs already; routing changes."""
        self.require(Capability.ROLE_FLIP)

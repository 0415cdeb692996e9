"""Fakes of what the running console's parts talk to: the run log, a backend, a host, a client."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from adapters.backends import Backend, Capability
from adapters.vllm.instances import Instance
from console.live.config import ConsoleConfig
from console.live.events import EventBus
from console.live.metrics import GatewayMetrics
from console.live.request import LiveRequest
from core.dispatch import Dispatcher
from core.perf import get_profile
from core.types import Request, Role


@dataclass
class ListLog:
    """A RunLog that keeps every row."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    instance_events: list[dict[str, Any]] = field(default_factory=list)
    policy_events: list[dict[str, Any]] = field(default_factory=list)

    def request(self, row: dict[str, Any]) -> None:
        self.requests.append(row)

    def sample(self, row: dict[str, Any]) -> None:
        self.samples.append(row)

    def instance_event(self, *, t: float, instance_id: str, event: str, detail: str) -> None:
        self.instance_events.append({"t": t, "instance_id": instance_id, "event": event, "detail": detail})

    def policy_event(
        self, *, t: float, kind: str, old: str | None, new: str, params: dict[str, Any], source: str
    ) -> None:
        self.policy_events.append({"t": t, "kind": kind, "old": old, "new": new, "params": params, "source": source})


class FakeBackend:
    """A backend whose instances are never reached; add, remove and flip are recorded."""

    name = "fake"
    summary = "in-memory"

    def __init__(self, capabilities: frozenset[Capability] = frozenset(), *, fail_add: bool = False) -> None:
        self.label = "fake"
        self.capabilities = capabilities
        self.fail_add = fail_add
        self.calls: list[tuple[str, ...]] = []
        self.lost: Callable[[str, str], None] | None = None
        self.migrated: dict[str, Any] = {"stage": "done"}

    async def start(self) -> list[Instance]:
        return []

    async def stop(self) -> None:
        self.calls.append(("stop",))

    async def add(self, role: Role, instance_id: str) -> Instance:
        self.calls.append(("add", role.value, instance_id))
        if self.fail_add:
            raise RuntimeError("no room on the node")
        return Instance(instance_id, role, "http://127.0.0.1:1")

    async def remove(self, instance_id: str) -> None:
        self.calls.append(("remove", instance_id))

    async def flip(self, instance_id: str, role: Role) -> None:
        self.calls.append(("flip", instance_id, role.value))

    async def migrate(self, request_id: str, source: Instance, target: Instance) -> dict[str, Any]:
        self.calls.append(("migrate", request_id, source.id, target.id))
        return dict(self.migrated)

    def on_lost(self, callback: Callable[[str, str], None]) -> None:
        self.lost = callback


def instances(prefill: int = 1, decode: int = 2) -> list[Instance]:
    """Instances p0.., d0.. at unreachable URLs (nothing here opens a connection)."""
    out = [Instance(f"p{i}", Role.PREFILL, "http://127.0.0.1:1") for i in range(prefill)]
    return out + [Instance(f"d{i}", Role.DECODE, "http://127.0.0.1:1") for i in range(decode)]


def dispatcher(insts: list[Instance], routing: str = "round_robin", **kw: Any) -> Dispatcher:
    """The real (pure) dispatcher over `insts`."""
    d = Dispatcher(get_profile(ConsoleConfig().profile), routing, **kw)
    for inst in insts:
        d.add_instance(inst.id, inst.role)
    return d


def live_request(
    rid: str = "r1", *, arrival: float = 100.0, prompt: int = 10, max_tokens: int = 4, stream: bool = True
) -> LiveRequest:
    return LiveRequest(
        Request(rid, arrival, prompt, max_tokens), "/v1/completions", {"prompt": "hi", "stream": stream}, b""
    )


class Host:
    """A scaler/operations host made of real small parts and a fake backend (the controller's role)."""

    def __init__(self, backend: FakeBackend, insts: list[Instance], config: ConsoleConfig | None = None) -> None:
        self.fake = backend
        self.backend = cast(Backend, backend)
        self.instances = {i.id: i for i in insts}
        self.dispatcher = dispatcher(insts)
        self.config = config or ConsoleConfig(instance_drain_timeout_s=0.5)
        self.metrics = GatewayMetrics()
        self.events = EventBus()
        self.live: dict[str, LiveRequest] = {}
        self.instance_events: list[tuple[str, str | None, str, str, str]] = []
        self.released = 0
        self.removed: list[str] = []
        self.ready: list[str] = []

    def instance_event(self, instance_id: str, role: Role | None, event: str, detail: str, source: str = "") -> None:
        self.instance_events.append((instance_id, role.value if role else None, event, detail, source))

    def track_data_parallel(self, inst: Instance) -> None:
        self.dispatcher.set_data_parallel(inst.id, inst.dp_size, 0)

    def instance_ready(self, inst: Instance) -> None:
        self.ready.append(inst.id)

    def release_queued(self) -> None:
        self.released += 1

    def instance_removed(self, instance_id: str) -> None:
        self.removed.append(instance_id)

    def events_of(self, event: str) -> list[tuple[str, str | None, str, str, str]]:
        return [e for e in self.instance_events if e[2] == event]


class Sent:
    """The ASGI `send` of a client: every message kept."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return int(next(m["status"] for m in self.messages if m["type"] == "http.response.start"))

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(next(m["headers"] for m in self.messages if m["type"] == "http.response.start"))

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


async def never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}

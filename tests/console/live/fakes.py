"""Fakes of what the running console's parts talk to: the run log, a backend, a request's parts, a cluster, a
client; and the keys of the state before it was typed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from adapters.backends import Backend, Capability
from adapters.vllm.instances import Instance
from console.live.config import ConsoleConfig
from console.live.events import EventBus, InstanceListeners
from console.live.metrics import GatewayMetrics
from console.live.migrations import Migratable, Migrations
from console.live.operations import Operations
from console.live.outcomes import Outcomes
from console.live.record import RequestRecord, RequestRow
from console.live.request import LiveRequest
from console.live.scaler import Scaler
from console.live.services import RequestServices
from core.dispatch import Dispatcher
from core.perf import get_profile
from core.slo import SLOClass
from core.types import Request, Role

LEGACY_ROW_KEYS = [
    "id",
    "role",
    "phase",
    "breaker",
    "url",
    "healthy",
    "managed",
    "running",
    "waiting",
    "kv_usage",
    "tokens_per_s",
    "projected_load",
    "routed_running",
    "routed_pending",
    "failures",
    "pid",
    "node",
    "dp_ranks",
    "scraped",
]
"""The keys of an instance in `/control/state` before the state was typed, in their order."""


@dataclass
class ListLog:
    """A RunLog that keeps every row (requests as their typed rows)."""

    requests: list[RequestRow] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    instance_events: list[dict[str, Any]] = field(default_factory=list)
    policy_events: list[dict[str, Any]] = field(default_factory=list)

    def request(self, row: RequestRow) -> None:
        self.requests.append(row)

    def sample(self, row: dict[str, Any]) -> None:
        self.samples.append(row)

    def instance_event(self, *, t: float, instance_id: str, event: str, detail: str) -> None:
        self.instance_events.append({"t": t, "instance_id": instance_id, "event": event, "detail": detail})

    def policy_event(
        self,
        *,
        t: float,
        kind: str,
        old: str | None,
        new: str,
        params: dict[str, Any],
        source: str,
        pool: str | None = None,
    ) -> None:
        row = {"t": t, "kind": kind, "old": old, "new": new, "params": params, "source": source, "pool": pool}
        self.policy_events.append(row)


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


def record(
    rid: str = "r1", *, arrival: float = 100.0, prompt: int = 10, max_tokens: int = 4, stream: bool = True
) -> RequestRecord:
    """The record of a request that just arrived."""
    return RequestRecord(Request(rid, arrival, prompt, max_tokens), stream)


class FakeParts:
    """What a LiveRequest calls (tenants, held queue, health, outcomes, migrations), each call recorded;
    `services` bundles them with a real dispatcher over `insts`."""

    def __init__(self, insts: list[Instance], d: Dispatcher, config: ConsoleConfig | None = None) -> None:
        self.dispatcher = d
        self.instances = {i.id: i for i in insts}
        self.calls: list[tuple[str, Any]] = []
        self.done: list[RequestRecord] = []
        self.streams: dict[str, Migratable] = {}
        config = config or ConsoleConfig()
        self.services = RequestServices(
            dispatcher=d,
            instances=self.instances,
            tenants=self,
            held=self,
            health=self,
            outcomes=self,
            migrations=self,
            metrics=GatewayMetrics(),
            engine_priorities=False,
            failure_migration_attempts=config.failure_migration_attempts,
        )

    # tenants
    def admit(self, record: RequestRecord) -> None:
        """No tenant limits here (tests/console/live/test_tenants.py has them)."""

    def finished(self, record: RequestRecord, met: bool) -> None:
        self.calls.append(("tenant_finished", record.id))

    # held queue
    def hold(self, request_id: str, released: asyncio.Future[None]) -> None:
        self.calls.append(("hold", request_id))

    def unhold(self, request_id: str) -> None:
        self.calls.append(("unhold", request_id))

    def release(self) -> None:
        self.calls.append(("release", None))

    def retry_after_s(self) -> float:
        return 7.0

    # health
    def upstream_failed(self, instance_id: str) -> None:
        self.calls.append(("failed", instance_id))

    def upstream_ok(self, instance_id: str) -> None:
        self.calls.append(("ok", instance_id))

    def lost_signal(self, instance_id: str) -> asyncio.Future[None]:
        return asyncio.get_running_loop().create_future()

    # outcomes
    def started(self, record: RequestRecord) -> None:
        self.calls.append(("started", record.id))

    def left(self, record: RequestRecord) -> None:
        self.done.append(record)

    def record(self, record: RequestRecord) -> bool:
        return record.ok

    # migrations
    def decoding(self, request_id: str, stream: Migratable) -> None:
        self.streams[request_id] = stream

    def landed(self, request_id: str, *_: Any) -> None:
        self.calls.append(("migrated", request_id))

    def ends(self) -> list[str]:
        """What the request told its parts after the start, in order (health and release calls left out)."""
        return [c[0] for c in self.calls if c[0] not in ("ok", "failed", "release")]


class Cluster:
    """A scaler's and operations' world: a fake backend, instances, a real dispatcher, real outcomes over a
    ListLog, and instance listeners that record what they hear."""

    def __init__(self, backend: FakeBackend, insts: list[Instance], config: ConsoleConfig | None = None) -> None:
        self.fake = backend
        self.backend = cast(Backend, backend)
        self.instances = {i.id: i for i in insts}
        self.dispatcher = dispatcher(insts)
        self.config = config or ConsoleConfig(instance_drain_timeout_s=0.5)
        self.log = ListLog()
        self.outcomes = Outcomes(self.log, {"default": SLOClass(ttft_s=1.0, tpot_s=0.1)}, t0=0.0)
        self.metrics: GatewayMetrics = self.outcomes.metrics
        self.events: EventBus = self.outcomes.events
        self.listeners = InstanceListeners()
        self.ready: list[str] = []
        self.removed: list[str] = []
        self.released = 0
        self.listeners.subscribe(added=lambda inst: self.ready.append(inst.id), removed=self.removed.append)
        self.listeners.subscribe(added=lambda _: self.release())
        self.migrations = Migrations(self.backend, self.dispatcher, self.instances, self.outcomes)

    def release(self) -> None:
        self.released += 1

    def scaler(self) -> Scaler:
        return Scaler(
            self.backend, self.dispatcher, self.instances, self.config, self.metrics, self.outcomes, self.listeners
        )

    def operations(self) -> Operations:
        return Operations(self.backend, self.dispatcher, self.instances, self.scaler(), self.migrations)

    @property
    def instance_events(self) -> list[tuple[str, str | None, str, str, str]]:
        """(instance, role, event, detail, source) of every instance event on the bus."""
        return [
            (e["instance"], e["role"], e["event"], e["detail"], e["source"])
            for e in self.events.history
            if e["type"] == "instance"
        ]

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

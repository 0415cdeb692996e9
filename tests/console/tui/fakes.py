"""The dashboard tests' fakes: a control API shaped like `Controller.state()`, served in memory or on 127.0.0.1,
and the Pilot helpers (the screen size, waiting on a condition, a dashboard on a fake)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from textual.css.query import NoMatches
from textual.pilot import Pilot

from console.live.state import ConsoleState
from console.tui.app import SibylDashboard
from console.tui.client import DashboardClient
from core.errors import PolicyError
from core.policies import registry
from core.policies.registry import catalog

TOKEN = "test-token"


class FakeConsole:
    """In-memory console: deterministic instances, real policy registry, recorded writes, SSE."""

    def __init__(self, prefill: int = 2, decode: int = 4, *, clock: Callable[[], float] | None = None) -> None:
        self.t0 = time.monotonic()
        self.clock = clock or (lambda: time.monotonic() - self.t0)
        self.tick = 0
        self.instances = [{"id": f"p{i}", "role": "prefill", "healthy": True} for i in range(prefill)]
        self.instances += [{"id": f"d{i}", "role": "decode", "healthy": True} for i in range(decode)]
        self.policies: dict[str, dict[str, Any]] = {
            kind: {"name": name, "params": registry.spec(kind, name).defaults()}
            for kind, name in (("routing", "sibyl"), ("queue", "fcfs"), ("reschedule", "none"), ("scaling", "static"))
        }
        self.puts: list[tuple[str, dict[str, Any]]] = []
        """Every PUT /control/policies/{kind}: (kind, body)."""
        self.posts: list[tuple[str, dict[str, Any]]] = []
        """Every POST (scale, replay): (path, body)."""
        self.down = False
        """While True every request fails to connect."""
        self.capabilities: dict[str, bool] = {}
        self.replay: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        self.sse_enabled = True
        """False: /control/events answers 404, as a console without the stream would."""
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()

    # --- state ---------------------------------------------------------------------------------
    def instance_values(self, n: int, tick: int) -> dict[str, Any]:
        running = round(11 + 8 * math.sin(tick / 9 + 0.8 * n)) + 3 * (n % 3)
        waiting = round(1.5 + 1.5 * math.sin(tick / 5 + n))
        return {
            "running": running,
            "waiting": waiting,
            "kv_usage": round(((13 * n + tick) % 90) / 100 + 0.05, 2),
            "tokens_per_s": float(running * 31 + n),
            "projected_load": float(running + 0.5 * waiting),
        }

    def state(self) -> dict[str, Any]:
        self.tick += 1
        instances = []
        for n, inst in enumerate(self.instances):
            v = self.instance_values(n, self.tick)
            if not inst["healthy"]:
                v = {**v, "running": 0, "waiting": 0, "tokens_per_s": 0.0, "projected_load": 0.0}
            instances.append(
                {
                    "id": inst["id"],
                    "role": inst["role"],
                    "url": f"http://127.0.0.1:{9000 + n}",
                    "healthy": inst["healthy"],
                    **v,
                    "routed_running": v["running"],
                    "routed_pending": 0,
                    "failures": 0,
                    "pid": 4000 + n,
                }
            )
        att = 0.97 - 0.01 * (self.tick % 5)
        stats = {
            "requests": 120 + self.tick,
            "failed": 1,
            "attainment": att,
            "ttft_attainment": 0.99,
            "tpot_attainment": att,
            "ttft_p50": 0.21,
            "ttft_p99": 0.84,
            "tpot_p50": 0.041,
            "tpot_p99": 0.062 + 0.002 * (self.tick % 7),
        }
        n_p = sum(1 for i in self.instances if i["role"] == "prefill")
        out: dict[str, Any] = {
            "run_id": "20250101-120000-ab12",
            "backend": "emulator",
            "cluster": f"{n_p}P{len(self.instances) - n_p}D",
            "model": ["qwen3-32b"],
            "uptime_s": self.clock(),
            "started_at": 1735732800.0,
            "instances": instances,
            "policies": json.loads(json.dumps(self.policies)),
            "slo": {
                "classes": {"default": {"name": "default", "ttft_s": 2.0, "tpot_s": 0.1}},
                "window_s": 60.0,
                "window": {**stats, "goodput_req_s": 2.4},
                "run": {**stats, "requests": 900 + self.tick, "failed": 3},
            },
            "requests": {"in_flight": 12, "total": 900 + self.tick, "failed": 3},
            "assignment_ratio": 0.93,
            "draining": False,
        }
        if self.capabilities:
            out["capabilities"] = dict(self.capabilities)
        if self.replay is not None:
            out["replay"] = dict(self.replay)
        return out

    def snapshot(self) -> ConsoleState:
        """The next `state()`, validated as the dashboard's client validates what it reads."""
        return ConsoleState.model_validate(self.state())

    def catalog(self) -> dict[str, Any]:
        return {"active": self.policies, "available": catalog(live=True)}

    # --- events --------------------------------------------------------------------------------
    def publish(self, event_type: str, **fields: Any) -> None:
        event = {"type": event_type, "time": 1735732800.0 + len(self.history), **fields}
        self.history.append(event)
        for q in list(self._subscribers):
            q.put_nowait(event)

    def set_health(self, instance_id: str, healthy: bool) -> None:
        for inst in self.instances:
            if inst["id"] == instance_id:
                inst["healthy"] = healthy
                self.publish(
                    "instance",
                    instance=instance_id,
                    role=inst["role"],
                    event="up" if healthy else "down",
                    detail="" if healthy else "connection refused",
                )

    async def sse(self) -> AsyncIterator[bytes]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._subscribers.add(q)
        try:
            for past in list(self.history):
                yield b"data: " + json.dumps(past).encode() + b"\n\n"
            yield b"data: " + json.dumps({"type": "state", "state": self.state()}).encode() + b"\n\n"
            while True:
                yield b"data: " + json.dumps(await q.get()).encode() + b"\n\n"
        finally:
            self._subscribers.discard(q)

    # --- the API -------------------------------------------------------------------------------
    def answer(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        if method == "GET" and path == "/control/state":
            return 200, self.state()
        if method == "GET" and path == "/control/policies":
            return 200, self.catalog()
        if method == "PUT" and path.startswith("/control/policies/"):
            kind = path.rsplit("/", 1)[-1]
            body = body or {}
            self.puts.append((kind, body))
            try:
                registry.build(kind, body["name"], body.get("params"))
            except PolicyError as e:
                return 422, {"error": {"message": str(e), "type": "invalid_request_error", "code": 422}}
            old = self.policies.get(kind, {}).get("name")
            self.policies[kind] = {"name": body["name"], "params": body.get("params") or {}}
            source = str(body.get("source") or "api")
            self.publish(
                "policy",
                kind=kind,
                old=old,
                new=body["name"],
                params=body.get("params") or {},
                source=source,
                t=self.clock(),
            )
            return 200, {
                "kind": kind,
                "old": old,
                "new": body["name"],
                "params": body.get("params") or {},
                "source": source,
            }
        if method == "POST" and path in ("/control/scale", "/control/replay/pause", "/control/replay/resume"):
            self.posts.append((path, body or {}))
            if path.endswith("pause") and self.replay is not None:
                self.replay["status"] = "paused"
            return 200, {"ok": True}
        return 404, {"error": {"message": f"no route {method} {path}"}}

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """httpx.MockTransport handler."""
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return httpx.Response(401, json={"error": {"message": "missing or wrong bearer token"}})
        if request.method == "GET" and request.url.path == "/control/events":
            if not self.sse_enabled:
                return httpx.Response(404, json={"error": {"message": "no route GET /control/events"}})
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self.sse())
        body = json.loads(request.content) if request.content else None
        status, data = self.answer(request.method, request.url.path, body)
        return httpx.Response(status, json=data)

    def client(self, token: str = TOKEN) -> DashboardClient:
        return DashboardClient("http://fake-console", token, transport=httpx.MockTransport(self.handle))

    def asgi(self) -> Starlette:
        """The same API over real HTTP (for uvicorn: tmux checks and the SSE test)."""

        async def any_route(request: Request) -> Response:
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse({"error": {"message": "missing or wrong bearer token"}}, 401)
            if request.url.path == "/control/events":
                return StreamingResponse(self.sse(), media_type="text/event-stream")
            raw = await request.body()
            status, data = self.answer(request.method, request.url.path, json.loads(raw) if raw else None)
            return JSONResponse(data, status)

        return Starlette(routes=[Route("/control/{rest:path}", any_route, methods=["GET", "PUT", "POST"])])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def served(fake: FakeConsole) -> AsyncIterator[str]:
    """Serve the fake on 127.0.0.1 in the current loop; yields its URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(fake.asgi(), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        server.force_exit = True
        await task


SIZE = (160, 48)


async def until(pilot: Pilot[None], cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for `cond` (a widget it queries may not be mounted yet) while the app runs."""

    def holds() -> bool:
        try:
            return cond()
        except NoMatches:
            return False

    deadline = time.monotonic() + timeout
    while not holds():
        assert time.monotonic() < deadline, "condition not met in time"
        await pilot.pause(0.05)


def app_for(fake: FakeConsole, **kw: object) -> SibylDashboard:
    return SibylDashboard(fake.client(), poll_interval_s=0.1, **kw)  # type: ignore[arg-type]

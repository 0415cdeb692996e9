"""An async client of the control API for the dashboard: state, policies, swaps, canaries, scale, replay, SSE."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from console.control_client import ControlError, canary_body
from console.live.state import ConsoleState

log = logging.getLogger(__name__)

STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError)
"""What httpx raises when the server closed a pooled connection as a request was sent on it."""


class ConnectionLost(ControlError):
    """The console could not be reached (refused, reset, timed out); the dashboard retries."""


class ApiError(ControlError):
    """The console answered with an error status; `message` is its `error.message`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        """HTTP status code of the answer."""
        self.message = message
        """The server's explanation, meant to be shown to the operator as is."""


def _error_message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:300] or r.reason_phrase


class DashboardClient:
    """One `httpx.AsyncClient` to one console; every call raises ConnectionLost or ApiError."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        """Base URL of the console (the gateway), shown in the connection banner."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s, transport=transport)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            try:
                r = await self._http.request(method, path, json=body)
            except STALE_CONNECTION as e:
                if method != "GET":
                    raise
                # A kept-alive connection the server had closed (its keep-alive timeout) just as the
                # request went out: a GET changes nothing, so it goes again, on a new connection.
                log.debug("%s %s: %s on a pooled connection; retrying once", method, path, type(e).__name__)
                r = await self._http.request(method, path, json=body)
        except httpx.TransportError as e:
            raise ConnectionLost(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
        if r.status_code >= 400:
            raise ApiError(r.status_code, _error_message(r))
        try:
            return r.json()
        except ValueError:
            raise ApiError(r.status_code, f"{method} {path}: the answer is not JSON") from None

    async def state(self) -> ConsoleState:
        """`GET /control/state`: the console's snapshot, validated into the typed model."""
        data = await self._call("GET", "/control/state")
        try:
            return ConsoleState.model_validate(data)
        except ValidationError as e:
            raise ApiError(
                200, f"GET /control/state: not a console state: {e.error_count()} errors, first: {e.errors()[0]['msg']}"
            ) from None

    async def policies(self) -> dict[str, Any]:
        """`GET /control/policies`: {"active": {kind: {name, params}}, "available": [...]}."""
        result: dict[str, Any] = await self._call("GET", "/control/policies")
        return result

    async def set_policy(
        self, kind: str, name: str, params: dict[str, Any], source: str = "tui", pool: str | None = None
    ) -> dict[str, Any]:
        """`PUT /control/policies/{kind}` of pool `pool` (None: the only one): hot-swap; returns {kind, old, new,
        params, source, pool}."""
        body: dict[str, Any] = {"name": name, "params": params, "source": source}
        if pool is not None:
            body["pool"] = pool
        result: dict[str, Any] = await self._call("PUT", f"/control/policies/{kind}", body)
        return result

    async def scale(self, role: str, delta: int, pool: str | None = None) -> dict[str, Any]:
        """`POST /control/scale`: add (delta > 0) or remove instances of one role of pool `pool` (None: the only)."""
        body: dict[str, Any] = {"role": role, "delta": delta}
        if pool is not None:
            body["pool"] = pool
        result: dict[str, Any] = await self._call("POST", "/control/scale", body)
        return result

    async def flip(self, instance: str, role: str) -> dict[str, Any]:
        """`POST /control/flip`: make an instance serve the other role."""
        result: dict[str, Any] = await self._call(
            "POST", "/control/flip", {"instance": instance, "role": role, "source": "tui"}
        )
        return result

    async def replay(self, action: str) -> dict[str, Any]:
        """`POST /control/replay/{pause|resume}` for a replay started by `up --replay`."""
        if action not in ("pause", "resume"):
            raise ValueError(f"replay action must be pause or resume, not {action!r}")
        result: dict[str, Any] = await self._call("POST", f"/control/replay/{action}")
        return result

    async def canary(self) -> dict[str, Any]:
        """`GET /control/canary`: {"running": the running canary or null, "last": the last one that ended or null}."""
        result: dict[str, Any] = await self._call("GET", "/control/canary")
        return result

    async def start_canary(
        self,
        kind: str,
        name: str,
        params: dict[str, Any],
        share: str | float,
        duration_s: float,
        source: str = "tui",
        pool: str | None = None,
    ) -> dict[str, Any]:
        """`POST /control/canary` with the body `sibyl-console policy canary` sends: route `share` of pool `pool`'s new
        requests (None: the first pool's) under the candidate for `duration_s`; returns the canary {id, plan, ...}."""
        body = canary_body(kind, name, params, share, duration_s, source, pool)
        result: dict[str, Any] = await self._call("POST", "/control/canary", body)
        return result

    async def stop_canary(self, source: str = "tui") -> dict[str, Any]:
        """`DELETE /control/canary`: end the running canary as interrupted (the active policy stays in force)."""
        result: dict[str, Any] = await self._call("DELETE", f"/control/canary?source={quote(source, safe='')}")
        return result

    async def instance_requests(self, instance: str, limit: int = 100) -> dict[str, Any]:
        """`GET /control/instances/{instance}/requests`: its requests in flight and recently finished."""
        path = f"/control/instances/{quote(instance, safe='')}/requests?limit={limit}"
        result: dict[str, Any] = await self._call("GET", path)
        return result

    async def request_decisions(self, request_id: str) -> dict[str, Any]:
        """`GET /control/requests/{id}/decisions`: its decision records still in the console's memory."""
        result: dict[str, Any] = await self._call("GET", f"/control/requests/{quote(request_id, safe='')}/decisions")
        return result

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        """`GET /control/events`: yield each server-sent event's JSON until the stream ends."""
        timeout = httpx.Timeout(5.0, read=None)
        try:
            async with self._http.stream("GET", "/control/events", timeout=timeout) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise ApiError(r.status_code, _error_message(r))
                data: list[str] = []
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        data.append(line[5:].strip())
                    elif not line and data:
                        payload, data = "\n".join(data), []
                        try:
                            event = json.loads(payload)
                        except ValueError:
                            continue
                        if isinstance(event, dict):
                            yield event
        except httpx.TransportError as e:
            raise ConnectionLost(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None

    async def aclose(self) -> None:
        await self._http.aclose()

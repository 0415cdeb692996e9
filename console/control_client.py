"""A small synchronous client of the control API, for the CLI (the TUI has its own async one)."""

from __future__ import annotations

from typing import Any

import httpx

from console.errors import ConsoleError
from console.live.discovery import ConsoleAddress, locate


class ControlError(ConsoleError):
    """The control API refused or could not be reached."""


def canary_body(
    kind: str, name: str, params: dict[str, Any], share: str | float, duration_s: float, source: str, pool: str | None
) -> dict[str, Any]:
    """The body of `POST /control/canary` (the CLI's and the dashboard's): route `share` of pool `pool`'s new requests
    (None: the first pool's) under the candidate for `duration_s`."""
    body: dict[str, Any] = {"kind": kind, "name": name, "params": params, "share": share, "duration_s": duration_s}
    body["source"] = source
    if pool is not None:
        body["pool"] = pool
    return body


class ControlClient:
    def __init__(self, url: str | None = None, token: str | None = None, timeout_s: float = 10.0) -> None:
        self.address: ConsoleAddress = locate(url, token)
        headers = {"Authorization": f"Bearer {self.address.token}"} if self.address.token else {}
        self._http = httpx.Client(base_url=self.address.url, headers=headers, timeout=timeout_s)

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise ControlError(f"cannot reach the console at {self.address.url}: {type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:200]
            raise ControlError(f"{method} {path}: {r.status_code}: {message}")
        return r.json()

    def state(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/control/state")
        return result

    def policies(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/control/policies")
        return result

    def set_policy(
        self, kind: str, name: str, params: dict[str, Any], source: str = "cli", pool: str | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"name": name, "params": params, "source": source}
        if pool is not None:
            body["pool"] = pool
        result: dict[str, Any] = self._call("PUT", f"/control/policies/{kind}", json=body)
        return result

    def lora(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/control/lora")
        return result

    def add_lora(self, name: str, path: str, pool: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/control/lora", json={"name": name, "path": path, "pool": pool})
        return result

    def remove_lora(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("DELETE", f"/control/lora/{name}")
        return result

    def scale(self, role: str, delta: int, source: str = "cli", pool: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"role": role, "delta": delta, "source": source}
        if pool is not None:
            body["pool"] = pool
        result: dict[str, Any] = self._call("POST", "/control/scale", json=body)
        return result

    def flip(self, instance: str, role: str, source: str = "cli", pool: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"instance": instance, "role": role, "source": source}
        if pool is not None:
            body["pool"] = pool
        result: dict[str, Any] = self._call("POST", "/control/flip", json=body)
        return result

    def migrate(self, request_id: str, target: str, source: str = "cli") -> dict[str, Any]:
        result: dict[str, Any] = self._call(
            "POST", "/control/migrate", json={"request_id": request_id, "target": target, "source": source}
        )
        return result

    def advice(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/control/advice")
        return result

    def canary(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/control/canary")
        return result

    def start_canary(
        self,
        kind: str,
        name: str,
        params: dict[str, Any],
        share: str | float,
        duration_s: float,
        source: str = "cli",
        pool: str | None = None,
    ) -> dict[str, Any]:
        body = canary_body(kind, name, params, share, duration_s, source, pool)
        result: dict[str, Any] = self._call("POST", "/control/canary", json=body)
        return result

    def stop_canary(self, source: str = "cli") -> dict[str, Any]:
        result: dict[str, Any] = self._call("DELETE", "/control/canary", params={"source": source})
        return result

    def reload_tenants(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/control/tenants/reload")
        return result

    def close(self) -> None:
        self._http.close()

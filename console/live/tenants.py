"""The gateway's tenants: the keys file (read, watched, reloaded), per-request charges, /metrics series."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from console.live.channel import Rejected
from console.live.config import read_mapping_file
from console.live.record import Outcome, Step
from core.admission_signals import RefusalCause
from core.errors import ConfigError
from core.tenants import DEFAULT_TENANT, FairShare, TenantSpec, TenantTable, hash_key, tenant_specs
from core.types import Request

if TYPE_CHECKING:
    from console.live.record import RequestRecord
    from core.dispatch import Dispatcher

log = logging.getLogger(__name__)
POLL_EVERY_S = 1.0
"""How often the keys file's modification is checked (from the controller's tick)."""


def read_keys_file(path: Path) -> dict[str, TenantSpec]:
    """The tenants of a keys file (.toml, .yaml or .yml); ConfigError naming the file, line and field."""
    data, text = read_mapping_file(path, "the tenants' keys file")
    return tenant_specs(data, text, str(path))


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def bearer_key(authorization: str | None) -> bytes | None:
    """The key of an `Authorization: Bearer KEY` header as the client sent its bytes (the header value
    arrives latin-1 decoded); None when there is none."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip().encode("latin-1", "replace") or None


class TenantGate(Protocol):
    """What a live request asks of its tenant's limits (Tenants)."""

    def admit(self, record: RequestRecord) -> None:
        """Charge the request to its tenant; raises console.live.channel.Rejected (429) when over its limits."""

    def finished(self, record: RequestRecord, met: bool) -> None:
        """The request left (met: whether it met its SLO)."""


class Tenants:
    """The tenants in force for /v1: who a key belongs to, what each may start, what each has done.

    Without a keys file /v1 is open and every request is the one `default` tenant's, unlimited (the
    queue's fair share then goes by the client's X-Sibyl-Tenant or `user`, as before). With one,
    every request needs `Authorization: Bearer KEY` of a listed tenant; the file is re-read when it
    changes (checked every POLL_EVERY_S) or on `reload`; a file that does not load keeps the table in
    force and its error is reported (`last_error`, the log, a `tenants` event)."""

    def __init__(
        self, path: Path | None, dispatcher: Dispatcher, now: float | None = None, others: Sequence[Dispatcher] = ()
    ) -> None:
        now = time.monotonic() if now is None else now
        self.path = path
        self.table = TenantTable(read_keys_file(path) if path is not None else None, now)
        self.dispatcher = dispatcher
        """The (first) pool's dispatcher: its queue releases fairly between tenants, its gate counts their refusals."""
        self.others = list(others)
        """The other pools' dispatchers: their queues release fairly too (one share table for the gateway)."""
        self.fair: FairShare | None = None
        self._signature = _signature(path) if path is not None else None
        self._next_poll = now + POLL_EVERY_S
        self.loaded_at = time.time()
        self.last_error: str | None = None
        self.reloads = {"ok": 0, "error": 0}
        self.on_reload: Callable[[dict[str, Any]], object] = lambda _: None
        """Told the outcome of every reload (the controller publishes it as a `tenants` event)."""
        self._apply()

    @property
    def keyed(self) -> bool:
        """Whether /v1 takes keys (else every request is the default tenant's)."""
        return self.table.keyed

    def _apply(self) -> None:
        """Fair release between tenants while keys are in force (the queue policy's order otherwise)."""
        if self.keyed:
            self.fair = self.fair or FairShare()
            self.fair.weights = self.table.weights()
        else:
            self.fair = None
        for d in (self.dispatcher, *self.others):
            d.admission.fair = self.fair

    # --- per request -------------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant of a request's Authorization header; None: missing or unknown key (answer 401)."""
        if not self.keyed:
            return DEFAULT_TENANT
        return self.table.authenticate(bearer_key(authorization))

    def label(self, request: Request) -> str:
        """The tenant `request` is charged to (its key's, or `default` when /v1 takes no keys)."""
        return request.tenant if self.keyed else DEFAULT_TENANT

    def priority(self, tenant: str, asked: int) -> int:
        """The priority band of a request of `tenant` that asked for `asked`: no earlier than its tenant's."""
        spec = self.table.spec(tenant) if self.keyed else None
        return asked if spec is None else max(asked, spec.priority)

    def admit(self, record: RequestRecord) -> None:
        """Charge the request to its tenant, or raise Rejected(429) when over the tenant's limits."""
        r = record.request
        refusal = self.table.admit(self.label(r), r.id, r.prompt_tokens, r.max_tokens, time.monotonic())
        if refusal is not None:
            gate = self.dispatcher.gate
            if gate is not None:  # counted with admission's refusals: the wait its limit asks, no bound
                gate.count_refusal(RefusalCause.TENANT_LIMIT, refusal.retry_after_s or 0.0, 0.0)
            raise Rejected(429, refusal.message, refusal.retry_after_s, outcome=Outcome.TENANT_LIMIT)

    def finished(self, record: RequestRecord, met: bool) -> None:
        """The request left: count it, free its slot, refund what it did not use."""
        outcome = ("met" if met else "missed") if record.ok else "failed"
        prefilled = Step.PREFILL in record.times or Step.DECODING in record.times  # the prompt was computed
        self.table.finish(record.request.id, outcome, record.output_tokens, prefilled, time.monotonic())

    # --- the keys file -----------------------------------------------------------------------------
    def poll(self, now: float) -> None:
        """Reload the keys file if it changed (called from the controller's tick)."""
        if self.path is None or now < self._next_poll:
            return
        self._next_poll = now + POLL_EVERY_S
        sig = _signature(self.path)
        if sig != self._signature:
            self._signature = sig
            self.reload("file changed")

    def reload(self, source: str = "api") -> dict[str, Any]:
        """Read the keys file again; a bad file keeps the table in force. Returns what happened."""
        if self.path is None:
            raise ConfigError("this console has no tenants' keys file ([tenants] file or `up --tenants FILE`)")
        try:
            specs = read_keys_file(self.path)
        except ConfigError as e:
            self.last_error = str(e)
            self.reloads["error"] += 1
            log.error("tenants: reload (%s) failed, the previous table stays in force: %s", source, e)
            result: dict[str, Any] = {"ok": False, "error": str(e), "source": source, "tenants": self.table.names()}
        else:
            self.table.replace(specs, time.monotonic())
            self._apply()
            self.last_error = None
            self.loaded_at = time.time()
            self.reloads["ok"] += 1
            log.info("tenants: %s reloaded (%s): %s", self.path, source, ", ".join(specs))
            result = {"ok": True, "error": None, "source": source, "tenants": self.table.names()}
        self.on_reload(result)
        return result

    # --- views -------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What `status` and ConsoleState show."""
        return {
            "keys_file": None if self.path is None else str(self.path),
            "required": self.keyed,
            "loaded_at": self.loaded_at,
            "last_error": self.last_error,
            "unauthorized": self.table.unauthorized,
            "tenants": self.table.describe(time.monotonic()),
        }

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(_TenantCollector(self))


class _TenantCollector(Collector):
    """Per-tenant series, read from the table at scrape time (nothing on the hot path)."""

    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants

    def describe(self) -> list[CounterMetricFamily]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        t = self.tenants
        rows: Mapping[str, dict[str, Any]] = t.table.describe(time.monotonic())
        requests = CounterMetricFamily(
            "sibyl_tenant_requests",
            "requests of each tenant by outcome: met or missed their SLO, failed, "
            "limited (refused by the tenant's own limits)",
            labels=["tenant", "outcome"],
        )
        tokens = CounterMetricFamily(
            "sibyl_tenant_tokens",
            "tokens of each tenant's requests: prompt (of those that reached a prefill leg) and output (generated)",
            labels=["tenant", "kind"],
        )
        in_flight = GaugeMetricFamily(
            "sibyl_tenant_in_flight", "each tenant's requests in the gateway", labels=["tenant"]
        )
        available = GaugeMetricFamily(
            "sibyl_tenant_tokens_available",
            "tokens left in each tenant's per-minute bucket (tenants with tokens_per_minute)",
            labels=["tenant"],
        )
        for name, row in rows.items():
            for outcome, n in row["requests"].items():
                requests.add_metric([name, outcome], n)
            tokens.add_metric([name, "prompt"], row["prompt_tokens"])
            tokens.add_metric([name, "output"], row["output_tokens"])
            in_flight.add_metric([name], row["in_flight"])
            if row["tokens_available"] is not None:
                available.add_metric([name], row["tokens_available"])
        unauthorized = CounterMetricFamily(
            "sibyl_gateway_unauthorized", "/v1 requests refused with 401 (missing or unknown API key)"
        )
        unauthorized.add_metric([], t.table.unauthorized)
        reloads = CounterMetricFamily(
            "sibyl_tenant_keys_reloads", "reloads of the tenants' keys file by result (ok, error)", labels=["result"]
        )
        for result, n in t.reloads.items():
            reloads.add_metric([result], n)
        yield from (requests, tokens, in_flight, available, unauthorized, reloads)


def keys_file_line(name: str, key: str, **limits: Any) -> str:
    """The TOML table of a tenant `name` with API key `key` (stored hashed) and its limits."""
    lines = [f"[tenants.{_toml_key(name)}]", f'key_sha256 = "{hash_key(key)}"']
    lines += [f"{k} = {v}" for k, v in limits.items() if v is not None]
    return "\n".join(lines) + "\n"


def _toml_key(name: str) -> str:
    bare = name.replace("-", "").replace("_", "").isalnum() and name.isascii()
    return name if bare else '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'

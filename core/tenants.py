"""Tenants of the gateway: hashed API keys, per-tenant limits (in flight, tokens per minute) and fair release.

Pure bookkeeping on times the caller passes in: the live console (console/live/tenants.py) reads the
keys file, authenticates each request's bearer key here, charges the tenant's token bucket on
prompt + max_tokens at arrival, refunds what a request did not use when it finishes, and lets the
dispatcher's admission release held requests fairly between tenants (`FairShare`).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from core.errors import ConfigError
from core.types import Request

DEFAULT_TENANT = "default"
"""The one tenant of a console whose /v1 takes no keys."""
_HEX64 = re.compile(r"[0-9a-f]{64}")


def hash_key(key: str) -> str:
    """What the keys file stores of an API key: the hex sha256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode()).hexdigest()


class TenantSpec(BaseModel):
    """One `[tenants.NAME]` table of the keys file."""

    model_config = ConfigDict(extra="forbid")

    key_sha256: list[str] = Field(
        min_length=1, description="hex sha256 of the tenant's API key (a list: several keys, e.g. while rotating)"
    )
    max_in_flight: int | None = Field(None, ge=1, description="its requests in the gateway at once (none: no limit)")
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="prompt + max_tokens it may start per minute, unused max_tokens refunded (none: no limit)",
    )
    priority: int = Field(
        0, description="its requests' priority band at least (lower runs earlier; a request may ask for a higher value)"
    )
    weight: float = Field(1.0, gt=0, le=1000, description="its share when held requests are released between tenants")

    @field_validator("key_sha256", mode="before")
    @classmethod
    def _hashes(cls, v: Any) -> Any:
        hashes = [v] if isinstance(v, str) else v
        if isinstance(hashes, list):
            for h in hashes:
                if not isinstance(h, str) or not _HEX64.fullmatch(h.lower()):
                    raise ValueError(
                        "must be the 64 hex digits of sha256(key), as `sibyl-console tenants hash KEY` prints "
                        "(the file holds no plain keys)"
                    )
            return [h.lower() for h in hashes]
        return v


def _line_of(text: str, name: str) -> int | None:
    """The line of tenant `name`'s table header (TOML) or key (YAML) in `text`, best effort."""
    patterns = (rf"^\s*\[\s*tenants\s*\.\s*\"?{re.escape(name)}\"?\s*\]", rf"^\s*\"?{re.escape(name)}\"?\s*:")
    for k, line in enumerate(text.splitlines(), 1):
        if any(re.match(p, line) for p in patterns):
            return k
    return None


def tenant_specs(data: Mapping[str, Any], text: str, source: str) -> dict[str, TenantSpec]:
    """The tenants of a decoded keys file (`{"tenants": {NAME: {...}}}`); ConfigError naming the file,
    the line and field at fault and what is allowed."""
    extra = set(data) - {"tenants"}
    if extra:
        raise ConfigError(
            f"{source}: unknown top-level key(s) {', '.join(sorted(extra))}; allowed: [tenants.NAME] tables"
        )
    tables = data.get("tenants")
    if not isinstance(tables, Mapping) or not tables:
        raise ConfigError(
            f'{source}: no tenants; expected [tenants.NAME] tables with key_sha256 = "<sha256 of the key>"'
        )
    allowed = ", ".join(TenantSpec.model_fields)
    specs: dict[str, TenantSpec] = {}
    owner: dict[str, str] = {}
    for name, table in tables.items():
        line = _line_of(text, str(name))
        where = f"{source}" + (f", line {line}" if line else "") + f": tenant {name!r}"
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}: must be a table of {allowed}")
        try:
            spec = TenantSpec.model_validate(dict(table))
        except ValidationError as e:
            err = e.errors()[0]
            fld = ".".join(str(x) for x in err["loc"]) or "key_sha256"
            msg = err["msg"].removeprefix("Value error, ")
            raise ConfigError(f"{where}: field {fld!r}: {msg} (allowed fields: {allowed})") from None
        for h in spec.key_sha256:
            if h in owner:
                raise ConfigError(
                    f"{where}: key_sha256 {h[:12]}… is also tenant {owner[h]!r}'s; a key names one tenant"
                )
            owner[h] = str(name)
        specs[str(name)] = spec
    return specs


class TokenBucket:
    """`per_minute` tokens a minute, at most one minute's worth saved; refunds never overfill it."""

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.at = now

    def _fill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
            self.at = now

    def take(self, n: float, now: float) -> float:
        """Take `n` tokens and return 0, or take none and return the seconds until `n` are there
        (inf when `n` is more than a minute's worth)."""
        self._fill(now)
        if n <= self.level:
            self.level -= n
            return 0.0
        if n > self.capacity:
            return math.inf
        return (n - self.level) / self.rate

    def refund(self, n: float, now: float) -> None:
        self._fill(now)
        self.level = min(self.capacity, self.level + max(n, 0.0))

    def resize(self, per_minute: float, now: float) -> None:
        """A reloaded limit: the same share of the bucket stays full."""
        self._fill(now)
        share = self.level / self.capacity if self.capacity else 1.0
        self.capacity, self.rate = float(per_minute), per_minute / 60.0
        self.level = share * self.capacity


OUTCOMES = ("met", "missed", "failed", "limited")
"""What became of a tenant's requests: met or missed their SLO, failed (any other error or refusal),
limited (refused at arrival by the tenant's own limits)."""


@dataclass
class TenantState:
    """One tenant's limits in force and its counters."""

    spec: TenantSpec | None
    """None: the default tenant of a console without keys (no limit)."""
    bucket: TokenBucket | None = None
    in_flight: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    prompt_tokens: int = 0
    """Prompt tokens of its requests that reached a prefill leg."""
    output_tokens: int = 0
    """Tokens generated for it."""

    def describe(self, now: float) -> dict[str, Any]:
        s = self.spec
        b = self.bucket
        if b is not None:
            b._fill(now)
        return {
            "in_flight": self.in_flight,
            "max_in_flight": s.max_in_flight if s else None,
            "tokens_per_minute": s.tokens_per_minute if s else None,
            "tokens_available": None if b is None else int(b.level),
            "priority": s.priority if s else 0,
            "weight": s.weight if s else 1.0,
            "requests": dict(self.outcomes),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
        }


@dataclass(frozen=True)
class Refusal:
    """Why a tenant's request is refused at arrival (the gateway answers 429)."""

    limit: str
    """requests (in flight) or tokens (per minute)."""
    message: str
    retry_after_s: float | None
    """None: retrying cannot help (the request alone exceeds a minute's tokens)."""


@dataclass
class _Charge:
    tenant: str
    tokens: int
    prompt_tokens: int
    max_tokens: int


class TenantTable:
    """The tenants in force (from the keys file, or the one default tenant) and what each has in flight."""

    def __init__(self, specs: Mapping[str, TenantSpec] | None, now: float) -> None:
        self.keyed = specs is not None
        """Whether /v1 requires a key (else every request is the default tenant's, unlimited)."""
        self.tenants: dict[str, TenantState] = {}
        self._hashes: list[tuple[bytes, str]] = []
        self._charges: dict[Hashable, _Charge] = {}
        self.unauthorized = 0
        """Requests refused for a missing or unknown key."""
        self.replace(specs, now)

    def replace(self, specs: Mapping[str, TenantSpec] | None, now: float) -> None:
        """Put a (re)loaded table in force: counters and in-flight requests carry over, buckets keep
        their fill share; a tenant that is gone takes no new request (its requests in flight finish)."""
        self.keyed = specs is not None
        table = specs if specs is not None else {DEFAULT_TENANT: None}
        for name, spec in table.items():
            st = self.tenants.get(name)
            if st is None:
                st = self.tenants[name] = TenantState(spec)
            st.spec = spec
            tpm = spec.tokens_per_minute if spec else None
            if tpm is None:
                st.bucket = None
            elif st.bucket is None:
                st.bucket = TokenBucket(tpm, now)
            else:
                st.bucket.resize(tpm, now)
        self._hashes = [(bytes.fromhex(h), name) for name, spec in (specs or {}).items() for h in spec.key_sha256]
        self._active = set(table)

    def names(self) -> list[str]:
        """Tenants in force, in the file's order."""
        return [n for n in self.tenants if n in self._active]

    def authenticate(self, key: bytes | None) -> str | None:
        """The tenant whose key `key` (its bytes, UTF-8 as `hash_key` encodes) is, every stored hash
        compared in constant time; None if none. Without keys every request is the default tenant's."""
        if not self.keyed:
            return DEFAULT_TENANT
        if not key:
            self.unauthorized += 1
            return None
        digest = hashlib.sha256(key).digest()
        found = None
        for h, name in self._hashes:  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(digest, h):
                found = name
        if found is None:
            self.unauthorized += 1
        return found

    def spec(self, tenant: str) -> TenantSpec | None:
        st = self.tenants.get(tenant)
        return None if st is None else st.spec

    def admit(
        self, tenant: str, request_id: Hashable, prompt_tokens: int, max_tokens: int, now: float
    ) -> Refusal | None:
        """Charge `tenant` one request in flight and prompt + max_tokens tokens, or say why not."""
        st = self.tenants[tenant]
        s = st.spec
        if s is not None and s.max_in_flight is not None and st.in_flight >= s.max_in_flight:
            st.outcomes["limited"] += 1
            return Refusal(
                "requests",
                f"tenant {tenant!r} has {st.in_flight} requests in flight, its limit (max_in_flight = "
                f"{s.max_in_flight}); retry when one finishes",
                1.0,
            )
        tokens = prompt_tokens + max_tokens
        if st.bucket is not None:
            wait = st.bucket.take(tokens, now)
            if wait:
                st.outcomes["limited"] += 1
                tpm = int(st.bucket.capacity)
                if math.isinf(wait):
                    return Refusal(
                        "tokens",
                        f"tenant {tenant!r} may start {tpm} tokens a minute (tokens_per_minute) and this request "
                        f"alone needs {tokens} (prompt {prompt_tokens} + max_tokens {max_tokens}); lower max_tokens",
                        None,
                    )
                return Refusal(
                    "tokens",
                    f"tenant {tenant!r} is over its tokens per minute (limit {tpm}, available "
                    f"{int(st.bucket.level)}, requested {tokens} = prompt + max_tokens); retry in {math.ceil(wait)} s",
                    wait,
                )
        st.in_flight += 1
        self._charges[request_id] = _Charge(tenant, tokens, prompt_tokens, max_tokens)
        return None

    def finish(self, request_id: Hashable, outcome: str, output_tokens: int, prefilled: bool, now: float) -> None:
        """A request left: count its `outcome`, free its slot, refund the tokens it did not use (all of
        them when it never reached a prefill leg, else max_tokens − the tokens generated)."""
        charge = self._charges.pop(request_id, None)
        if charge is None:
            return
        st = self.tenants[charge.tenant]
        st.in_flight -= 1
        st.outcomes[outcome] += 1
        st.output_tokens += output_tokens
        if prefilled:
            st.prompt_tokens += charge.prompt_tokens
        if st.bucket is not None:
            unused = charge.tokens if not prefilled else charge.max_tokens - min(output_tokens, charge.max_tokens)
            st.bucket.refund(unused, now)

    def tenant_of(self, request_id: Hashable) -> str | None:
        """The tenant a request in flight is charged to."""
        c = self._charges.get(request_id)
        return None if c is None else c.tenant

    def weights(self) -> dict[str, float]:
        return {n: (st.spec.weight if st.spec else 1.0) for n, st in self.tenants.items()}

    def describe(self, now: float) -> dict[str, dict[str, Any]]:
        """Every tenant (those dropped by a reload while they had requests too) with limits and counters."""
        return {n: st.describe(now) for n, st in self.tenants.items() if n in self._active or st.in_flight}


class FairShare:
    """Release order between tenants: stride scheduling over the queue policy's order.

    The candidates are the held requests in the head's priority band (the queue policy's first
    request's `priority`), so a band-ordered policy keeps its bands. Among them each tenant has a
    pass; the tenant with the lowest pass releases its first request in the policy's order and its
    pass grows by 1 / its weight. A tenant that had nothing held starts at the pass of the last one
    served, so idle time earns no credit. Equal weights: round-robin; one tenant: the policy's order.
    """

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.weights: dict[str, float] = dict(weights or {})
        self.passes: dict[str, float] = {}
        self.vtime = 0.0

    def _pass(self, tenant: str) -> float:
        return max(self.passes.get(tenant, 0.0), self.vtime)

    def pick(self, items: Sequence[Request]) -> Request | None:
        """The request to release next of `items` (the queue policy's order)."""
        if not items:
            return None
        band = items[0].priority
        best: Request | None = None
        best_pass = math.inf
        for r in items:
            if r.priority != band:
                continue
            p = self._pass(r.tenant)
            if p < best_pass:
                best, best_pass = r, p
        return best

    def served(self, request: Request) -> None:
        """`request` was released: its tenant's pass moves on."""
        p = self._pass(request.tenant)
        self.vtime = p
        self.passes[request.tenant] = p + 1.0 / self.weights.get(request.tenant, 1.0)

    def ahead(self, held: Mapping[str, int], tenant: str) -> float:
        """Held requests released before one more of `tenant`'s (`held`: requests held per tenant): its
        own, and of every other tenant as many as its weight lets it release meanwhile, at most all."""
        own = held.get(tenant, 0)
        turns = (own + 1) / self.weights.get(tenant, 1.0)
        return own + sum(min(n, turns * self.weights.get(u, 1.0)) for u, n in held.items() if u != tenant)

    def order(self, items: Iterable[Request]) -> list[Request]:
        """The whole release order of `items` if nothing else arrived (for views and tests)."""
        shadow = FairShare(self.weights)
        shadow.passes, shadow.vtime = dict(self.passes), self.vtime
        rest = list(items)
        out: list[Request] = []
        while rest:
            r = shadow.pick(rest)
            assert r is not None
            shadow.served(r)
            rest.remove(r)
            out.append(r)
        return out

"""The one registry of policies: register built-ins and plugins, build a policy from {name, params}."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, TypeVar

from pydantic import ValidationError

from core.errors import PolicyError
from core.policies.base import PolicyParams
from core.types import PolicyKind

ENTRY_POINT_GROUP = "sibyl_console.policies"


@dataclass(frozen=True)
class PolicySpec:
    """How to build one named policy of one kind."""

    kind: PolicyKind
    name: str
    params_model: type[PolicyParams]
    factory: Callable[[Any], Any]
    summary: str

    def schema(self) -> dict[str, Any]:
        """JSON schema of the params (drives `--param`, the TUI form and the docs)."""
        return self.params_model.model_json_schema()

    def defaults(self) -> dict[str, Any]:
        return self.params_model().model_dump()

    @property
    def sim_only(self) -> bool:
        """Whether the policy reads every request's true output length, which only the
        simulator knows (a routing policy class declaring `needs_true_lengths = True`)."""
        return bool(getattr(self.factory, "needs_true_lengths", False))


_REGISTRY: dict[PolicyKind, dict[str, PolicySpec]] = {k: {} for k in PolicyKind}
_loaded = False

T = TypeVar("T")


def register(kind: PolicyKind, name: str, params: type[PolicyParams], summary: str) -> Callable[[T], T]:
    """Class decorator: make a policy buildable by name. The class is called with its params."""

    def deco(cls: T) -> T:
        if name in _REGISTRY[kind]:
            raise PolicyError(f"{kind} policy {name!r} is registered twice")
        _REGISTRY[kind][name] = PolicySpec(kind, name, params, cls, summary)  # type: ignore[arg-type]
        cls.name = name  # type: ignore[attr-defined]
        return cls

    return deco


def _ensure_loaded() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    import core.policies.builtin  # noqa: F401  (registers the built-ins)

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()


def specs(kind: PolicyKind | None = None) -> list[PolicySpec]:
    """Every registered policy (of one kind, or all), sorted by kind then name."""
    _ensure_loaded()
    kinds: Iterable[PolicyKind] = [kind] if kind else list(PolicyKind)
    return [_REGISTRY[k][n] for k in kinds for n in sorted(_REGISTRY[k])]


def spec(kind: PolicyKind | str, name: str) -> PolicySpec:
    _ensure_loaded()
    try:
        k = PolicyKind(kind)
    except ValueError:
        raise PolicyError(f"unknown policy kind {kind!r}; kinds: {', '.join(k.value for k in PolicyKind)}") from None
    known = _REGISTRY[k]
    if name not in known:
        have = ", ".join(sorted(known)) or "none registered yet"
        raise PolicyError(f"unknown {k} policy {name!r}; available: {have}")
    return known[name]


def build(kind: PolicyKind | str, name: str, params: dict[str, Any] | None = None) -> Any:
    """Validate params against the policy's model and build it; errors name the bad field."""
    s = spec(kind, name)
    try:
        p = s.params_model.model_validate(params or {})
    except ValidationError as e:
        fields = ", ".join(s.params_model.model_fields) or "none"
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'params'}: {err['msg']}" for err in e.errors())
        raise PolicyError(f"bad params for {s.kind} policy {name!r}: {problems} (params: {fields})") from None
    return s.factory(p)


def parse_policy_spec(text: str) -> tuple[str, dict[str, str]]:
    """The one parser of a policy written inline: `NAME`, `NAME:key=value,...` (the CLI's form) or
    `NAME(key=value, ...)` (the form the console prints a policy in) → (name, {key: value}).
    Values stay strings; the policy's params model types them."""
    text = text.strip()
    if text.endswith(")") and "(" in text:
        name, _, rest = text[:-1].partition("(")
    else:
        name, _, rest = text.partition(":")
    name = name.strip()
    params: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not name:
            raise PolicyError(f"policy {text!r}: expected NAME, NAME:key=value[,key=value] or NAME(key=value, ...)")
        params[key.strip()] = value.strip()
    if not name:
        raise PolicyError(f"policy {text!r}: no name")
    return name, params


def catalog(live: bool = False) -> list[dict[str, Any]]:
    """Every registered policy of every kind with its params schema and defaults; `live` leaves out
    the simulator-only ones (a clairvoyant needs true output lengths no live console knows)."""
    out = []
    for s in specs():
        if live and s.sim_only:
            continue
        out.append(
            {
                "kind": s.kind.value,
                "name": s.name,
                "summary": s.summary,
                "params_schema": s.schema(),
                "defaults": s.defaults(),
                "sim_only": s.sim_only,
            }
        )
    return out

"""A `sweep` CONFIG (TOML): its validated schema, its grid of points, and each point's stable key."""

from __future__ import annotations

import hashlib
import itertools
import json
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from core.cluster_spec import parse_cluster
from core.errors import ConfigError, PolicyError, SibylError
from core.perf import PerfProfile, get_profile
from core.policies import parse_policy_spec, registry
from core.traces import FORMATS, WORKLOADS
from core.types import PolicyKind

POINT_KEY_VERSION = 1
"""Bumped when what identifies a point changes (every stored point then runs again)."""


class SweepConfigError(ConfigError):
    """A sweep CONFIG file is unreadable or invalid (the message names the file and the field)."""


def params_for_mode(name: str, params: dict[str, Any], mode: str) -> dict[str, Any]:
    """The clairvoyant is told the simulator's decode model (it is an oracle anyway)."""
    if name == "clairvoyant" and "model" not in params:
        return {**params, "model": mode}
    return dict(params)


def _listify(value: Any) -> Any:
    """An axis may be written as one value: `seeds = 7` is `seeds = [7]`."""
    return value if isinstance(value, list) else [value]


T = TypeVar("T")
Axis = Annotated[list[T], BeforeValidator(_listify), Field(min_length=1)]
"""One axis of the grid: a non-empty list (or one value)."""
Positive = Annotated[float, Field(gt=0)]


@dataclass(frozen=True)
class WorkloadRef:
    """A synthetic workload by name, or a trace file (`trace` set)."""

    name: str
    trace: str | None = None
    format: str = "auto"
    limit: int | None = None

    def identity(self) -> dict[str, Any]:
        if self.trace is None:
            return {"synthetic": self.name}
        return {"trace": self.trace, "format": self.format, "limit": self.limit}


@dataclass(frozen=True)
class PolicyEntry:
    """One routing-policy setting of the grid: its label (a table row) and what runs."""

    label: str
    name: str
    params: dict[str, Any] = field(default_factory=dict, hash=False)


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_TRACE_KEYS = {"trace", "format", "limit", "label"}
_POLICY_KEYS = {"label", "name", "params"}


def _spec(kind: PolicyKind, text: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(text, str):
        raise ValueError(f"expected a policy spec string NAME[:key=value,...], got {text!r}")
    try:
        name, params = parse_policy_spec(text)
    except PolicyError:
        raise ValueError(f"{text!r}: expected NAME or NAME:key=value[,key=value]") from None
    return name, _normalized(kind, name, params)


def _normalized(kind: PolicyKind, name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Validate a policy's params and type them ("256" → 256), keeping only those given."""
    try:
        registry.build(kind, name, params)
    except SibylError as e:
        raise ValueError(str(e)) from None
    model = registry.spec(kind, name).params_model.model_validate(params)
    return model.model_dump(mode="json", exclude_unset=True)


class SloSpec(BaseModel):
    """The SLO every run's attainment is measured against."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float = Field(2000.0, gt=0)
    tpot_ms: float = Field(100.0, gt=0)


class SweepConfig(BaseModel):
    """The CONFIG of `sibyl-console sweep` (TOML); every list is an axis of the grid."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    name: str = Field(pattern=NAME_PATTERN, max_length=100)
    description: str = ""
    workloads: Axis[Any] = ["reasoning-chat"]
    """Synthetic workload names, or trace tables {trace, format, limit, label}."""
    requests: int = Field(2000, ge=1)
    """Requests per synthetic run (a trace is cut by its own `limit`)."""
    seeds: Axis[int] = [0]
    rates: Axis[Positive] | None = None
    """Arrival rates in req/s (a trace is rescaled to each)."""
    loads: Axis[Positive] | None = None
    """Arrival rates as a share of decode saturation (see console.offline.sweep.load_rate)."""
    burstiness: Axis[Positive] = [1.0]
    """Gamma shape of synthetic inter-arrival gaps (1 = Poisson)."""
    shapes: Axis[str] = ["4P16D"]
    modes: Axis[Literal["ps", "iteration"]] = ["ps"]
    policies: Axis[Any] = ["sibyl", "least_load", "round_robin"]
    """Routing policies: spec strings NAME[:key=value,...] or tables {label, name, params}."""
    queue: str = "fcfs"
    reschedule: str = "none"
    scaling: str = "static"
    profile: str = "h20-qwen3-32b"
    slo: SloSpec = SloSpec()
    shadow: bool = False
    store_requests: bool = True

    @field_validator("workloads", mode="after")
    @classmethod
    def _workloads(cls, items: list[Any]) -> list[WorkloadRef]:
        out = []
        for k, item in enumerate(items):
            try:
                out.append(_workload(item))
            except ValueError as e:
                raise ValueError(f"[{k}] {e}") from None
        return out

    @field_validator("policies", mode="after")
    @classmethod
    def _policies(cls, items: list[Any]) -> list[PolicyEntry]:
        out: list[PolicyEntry] = []
        for k, item in enumerate(items):
            try:
                out.append(_policy(item))
            except ValueError as e:
                raise ValueError(f"[{k}] {e}") from None
        labels = [p.label for p in out]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"labels must be unique; repeated: {', '.join(dup)}")
        settings = [json.dumps([p.name, p.params], sort_keys=True) for p in out]
        same = [p.label for p, s in zip(out, settings, strict=True) if settings.count(s) > 1]
        if same:
            raise ValueError(f"{' and '.join(same)} are the same policy setting")
        return out

    @field_validator("shapes", mode="after")
    @classmethod
    def _shapes(cls, items: list[str]) -> list[str]:
        for k, text in enumerate(items):
            try:
                parse_cluster(text)
            except ConfigError:
                raise ValueError(f"[{k}] {text!r}: expected <prefill>P<decode>D with counts >= 1, e.g. 4P16D") from None
        return [f"{p}P{d}D" for p, d in map(parse_cluster, items)]

    @field_validator("queue", mode="after")
    @classmethod
    def _queue(cls, text: str) -> str:
        _spec(PolicyKind.QUEUE, text)
        return text

    @field_validator("reschedule", mode="after")
    @classmethod
    def _reschedule(cls, text: str) -> str:
        _spec(PolicyKind.RESCHEDULE, text)
        return text

    @field_validator("scaling", mode="after")
    @classmethod
    def _scaling(cls, text: str) -> str:
        _spec(PolicyKind.SCALING, text)
        return text

    @model_validator(mode="after")
    def _rates_or_loads(self) -> SweepConfig:
        if self.rates is not None and self.loads is not None:
            raise ValueError("give either rates (req/s) or loads (share of decode saturation), not both")
        synthetic = [w.name for w in self.workloads if w.trace is None]
        if synthetic and self.rates is None and self.loads is None:
            raise ValueError(
                f"synthetic workloads ({', '.join(synthetic)}) need rates (req/s) or loads (share of decode saturation)"
            )
        return self

    def other_policies(self) -> dict[PolicyKind, tuple[str, dict[str, Any]]]:
        return {
            PolicyKind.QUEUE: _spec(PolicyKind.QUEUE, self.queue),
            PolicyKind.RESCHEDULE: _spec(PolicyKind.RESCHEDULE, self.reschedule),
            PolicyKind.SCALING: _spec(PolicyKind.SCALING, self.scaling),
        }


def _workload(item: Any) -> WorkloadRef:
    allowed = f"allowed: {', '.join(WORKLOADS)}, or a table {{trace = PATH, format = ..., limit = N}}"
    if isinstance(item, str):
        if item not in WORKLOADS:
            raise ValueError(f"unknown synthetic workload {item!r}; {allowed}")
        return WorkloadRef(item)
    if not isinstance(item, dict):
        raise ValueError(f"expected a workload name or a table, got {item!r}; {allowed}")
    unknown = sorted(set(item) - _TRACE_KEYS)
    if unknown or "trace" not in item:
        what = f"unknown key {', '.join(unknown)}" if unknown else "missing key trace"
        raise ValueError(f"{what}; a trace table has keys {', '.join(sorted(_TRACE_KEYS))}")
    fmt = item.get("format", "auto")
    if fmt not in ("auto", *FORMATS):
        raise ValueError(f"format {fmt!r} is not allowed; allowed: auto, {', '.join(FORMATS)}")
    limit = item.get("limit")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit {limit!r}: expected an integer >= 1")
    path = item["trace"]
    if not isinstance(path, str) or not path:
        raise ValueError(f"trace {path!r}: expected a file path")
    return WorkloadRef(str(item.get("label") or Path(path).stem), path, fmt, limit)


def _policy(item: Any) -> PolicyEntry:
    if isinstance(item, str):
        name, params = _spec(PolicyKind.ROUTING, item)
        return PolicyEntry(item, name, params)
    if not isinstance(item, dict):
        raise ValueError(f"expected a spec NAME[:key=value,...] or a table {{label, name, params}}, got {item!r}")
    unknown = sorted(set(item) - _POLICY_KEYS)
    if unknown or "name" not in item:
        what = f"unknown key {', '.join(unknown)}" if unknown else "missing key name"
        raise ValueError(f"{what}; a policy table has keys {', '.join(sorted(_POLICY_KEYS))}")
    params = item.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"params {params!r}: expected a table of key = value")
    name = item["name"]
    if not isinstance(name, str):
        raise ValueError(f"name {name!r}: expected a policy name")
    normal = _normalized(PolicyKind.ROUTING, name, params)
    label = item.get("label") or (name + (":" + ",".join(f"{k}={v}" for k, v in normal.items()) if normal else ""))
    return PolicyEntry(str(label), name, normal)


# --- loading ---------------------------------------------------------------------------------


def _where(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _model_at(loc: Sequence[int | str]) -> type[BaseModel] | None:
    model: type[BaseModel] = SweepConfig
    for part in loc:
        info = model.model_fields.get(str(part))
        sub = info.annotation if info else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return None
        model = sub
    return model


def _problem(err: Any) -> str:
    loc = list(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        allowed = ", ".join(parent.model_fields) if parent else "?"
        return f"{_where(loc)}: unknown field; allowed fields: {allowed}"
    if kind == "missing":
        return f"{_where(loc)}: required field is missing"
    if kind == "too_short":
        return f"{_where(loc)}: needs at least one value"
    if kind == "literal_error":
        return f"{_where(loc)}: {err['input']!r} is not allowed; allowed: {err['ctx']['expected']}"
    if kind == "string_pattern_mismatch":
        return f"{_where(loc)}: {err['input']!r}: expected letters, digits, '.', '_' or '-'"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if kind == "value_error" and msg.startswith("[") and "] " in msg:
        index, _, msg = msg[1:].partition("] ")  # a list's validator named the bad item
        loc.append(int(index))
    elif kind != "value_error" and not isinstance(err.get("input"), dict | list):
        msg += f" (got {err.get('input')!r})"
    return f"{_where(loc)}: {msg}"


def parse_config(data: dict[str, Any], source: str = "CONFIG") -> SweepConfig:
    """Validate a CONFIG's contents; errors name `source`, the field and what is allowed."""
    try:
        return SweepConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(_problem(err) for err in e.errors())
        raise SweepConfigError(f"sweep config {source}: {problems}") from None


def load_config(path: Path) -> SweepConfig:
    """Read and validate a TOML CONFIG; trace and profile paths are relative to its folder."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SweepConfigError(f"sweep config {path}: no such file") from None
    except OSError as e:
        raise SweepConfigError(f"sweep config {path}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise SweepConfigError(f"sweep config {path}: not valid TOML ({e})") from None
    config = parse_config(data, str(path))
    base = path.resolve().parent
    workloads = [
        w if w.trace is None else WorkloadRef(w.name, str(base / w.trace), w.format, w.limit) for w in config.workloads
    ]
    for k, w in enumerate(workloads):
        if w.trace is not None and not Path(w.trace).exists():
            raise SweepConfigError(f"sweep config {path}: workloads[{k}]: trace {w.trace}: no such file or folder")
    profile = config.profile
    if profile.endswith(".json") and not Path(profile).is_absolute():
        profile = str(base / profile)
    return config.model_copy(update={"workloads": workloads, "profile": profile})


def resolve_profile(config: SweepConfig, source: str = "CONFIG") -> PerfProfile:
    try:
        return get_profile(config.profile)
    except SibylError as e:
        raise SweepConfigError(f"sweep config {source}: profile: {e}") from None


# --- the grid --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One simulation of the grid: its coordinates and everything its result depends on."""

    workload: WorkloadRef
    requests: int
    mode: str
    cluster: str
    rate: float | None
    load: float | None
    burstiness: float | None
    seed: int
    policy: PolicyEntry
    params: dict[str, Any] = field(hash=False)
    """The policy's params for this point (the clairvoyant learns the decode model)."""
    others: dict[str, tuple[str, dict[str, Any]]] = field(hash=False)
    """queue / reschedule / scaling: (name, params)."""
    profile: str
    profile_digest: str
    slo: tuple[float, float]
    """(TTFT, TPOT) in seconds."""
    shadow: tuple[tuple[str, str], ...] = ()
    """Other policies scored in shadow mode: (name, params as JSON)."""

    @property
    def shape(self) -> tuple[int, int]:
        return parse_cluster(self.cluster)

    def identity(self) -> dict[str, Any]:
        """What the result depends on (not the policy's label, which is only a name)."""
        return {
            "v": POINT_KEY_VERSION,
            "workload": self.workload.identity(),
            "requests": self.requests if self.workload.trace is None else None,
            "mode": self.mode,
            "cluster": self.cluster,
            "rate": self.rate,
            "load": self.load,
            "burstiness": self.burstiness,
            "seed": self.seed,
            "policy": [self.policy.name, self.params],
            "others": {k: list(v) for k, v in sorted(self.others.items())},
            "profile": [self.profile, self.profile_digest],
            "slo": list(self.slo),
            "shadow": [list(s) for s in self.shadow],
        }

    @property
    def key(self) -> str:
        """A stable hash of `identity()`: the same point has the same key in every process."""
        text = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def coords(self) -> dict[str, Any]:
        """The grid coordinates, as stored with the run and shown in the tables."""
        return {
            "workload": self.workload.name,
            "mode": self.mode,
            "cluster": self.cluster,
            "rate": self.rate,
            "load": self.load,
            "burstiness": self.burstiness,
            "seed": self.seed,
            "policy": self.policy.label,
        }


def profile_digest(profile: PerfProfile) -> str:
    return hashlib.sha256(profile.model_dump_json().encode()).hexdigest()[:12]


def expand(config: SweepConfig, profile: PerfProfile) -> list[Point]:
    """Every point: workloads × modes × shapes × rates|loads × burstiness × seeds × policies.

    A trace keeps its own arrival pattern, so burstiness is not an axis of its points.
    """
    digest = profile_digest(profile)
    others = {str(k): v for k, v in config.other_policies().items()}
    policies: list[PolicyEntry] = list(config.policies)
    levels: list[tuple[float | None, float | None]] = (
        [(r, None) for r in config.rates]
        if config.rates is not None
        else [(None, x) for x in config.loads]
        if config.loads is not None
        else [(None, None)]
    )
    points: dict[str, Point] = {}
    for workload, mode, cluster, (rate, load), burst, seed, policy in itertools.product(
        config.workloads, config.modes, config.shapes, levels, config.burstiness, config.seeds, policies
    ):
        shadow: tuple[tuple[str, str], ...] = ()
        if config.shadow:
            shadow = tuple(
                (p.name, json.dumps(params_for_mode(p.name, p.params, mode), sort_keys=True))
                for p in policies
                if p is not policy
            )
        point = Point(
            workload=workload,
            requests=config.requests,
            mode=mode,
            cluster=cluster,
            rate=None if rate is None else float(rate),
            load=None if load is None else float(load),
            burstiness=None if workload.trace is not None else float(burst),
            seed=seed,
            policy=policy,
            params=params_for_mode(policy.name, policy.params, mode),
            others=others,
            profile=profile.name,
            profile_digest=digest,
            slo=(config.slo.ttft_ms / 1000, config.slo.tpot_ms / 1000),
            shadow=shadow,
        )
        points.setdefault(point.key, point)
    return list(points.values())


def axes_summary(config: SweepConfig) -> str:
    """`3 workloads × 2 modes × …` for the header line."""
    x: tuple[str, list[Any]] = (
        ("rates", config.rates) if config.rates is not None else ("loads", config.loads or [None])
    )
    parts: list[tuple[str, list[Any]]] = [
        ("workloads", config.workloads),
        ("modes", config.modes),
        ("shapes", config.shapes),
        x,
        ("burstiness", config.burstiness),
        ("seeds", config.seeds),
        ("policies", config.policies),
    ]
    return " × ".join(f"{len(v)} {n}" for n, v in parts)

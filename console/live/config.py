"""The live console's configuration: one pydantic model that a TOML/YAML file or CLI flags fill."""

from __future__ import annotations

import contextlib
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from adapters.backends import BackendSettings, EmulatorSettings, VllmSettings
from adapters.backends import registry as backends
from adapters.backends.settings import RaySettings, check_attach
from adapters.tracing import missing, traces_url
from adapters.vllm.lora import check_adapter_dir
from console.advisor.settings import AdvisorSettings
from console.live.config_lines import line_of
from core.admission import SloAdmission
from core.decision_log import DecisionSettings
from core.dispatch.prefix import APPROXIMATE_TTL_S
from core.errors import ConfigError, PolicyError
from core.policies import registry
from core.slo import SLOClass


class PrefixSettings(BaseModel):
    """`[prefix]`: how the console knows what each instance caches."""

    model_config = ConfigDict(extra="forbid")

    source: Literal["off", "approximate", "precise"] = Field(
        "approximate",
        description="off: routing sees no cache; approximate: what was routed to an instance counts as cached there "
        "for ttl_s; precise: each instance's KV events (the emulator and vLLM publish them with --kv-events-config)",
    )
    block_size: int | None = Field(None, gt=0, description="the engines' KV block size (default: the profile's)")
    ttl_s: float = Field(
        APPROXIMATE_TTL_S,
        gt=0,
        description="approximate: how long a routed prefix counts as cached at most (each instance's KV capacity "
        "bounds it too); longer than a conversation's pause between turns",
    )
    tokenize: Literal["auto", "local", "instance", "off"] = Field(
        "auto",
        description="text and chat prompts: local = the model's tokenizer and chat template in the gateway "
        "(`tokenizer`); instance = ask a prefill instance's /tokenize; auto = local when a tokenizer is known, "
        "/tokenize for what it cannot do exactly and when none is; off = only token-id prompts get prefix keys",
    )
    tokenizer: str | None = Field(
        None,
        description="the model's tokenizer: a model directory or a tokenizer.json (with tokenizer_config.json or "
        "chat_template.jinja beside it); default: the model directory `--backend vllm` launches",
    )
    decode_only: bool = Field(
        True,
        description="let a policy that decides so (prefix_pd) serve a request on a decode instance alone when it "
        "already holds most of the prompt",
    )


class TenantSettings(BaseModel):
    """`[tenants]`: API keys and per-tenant limits for /v1 (console/live/tenants.py)."""

    model_config = ConfigDict(extra="forbid")

    file: Path | None = Field(
        None,
        description="keys file ([tenants.NAME] tables: key_sha256, max_in_flight, tokens_per_minute, priority, "
        "weight); re-read when it changes; none: /v1 is open and every request is the default tenant's",
    )

    @field_validator("file")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        return None if v is None else v.expanduser().absolute()  # the server process may start elsewhere


class TracingSettings(BaseModel):
    """`[tracing]`: OpenTelemetry spans of each request's phases (console/live/tracing.py; the `tracing` extra)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = Field(
        None, description="export spans (default: on when an endpoint is set); off costs nothing on the hot path"
    )
    endpoint: str | None = Field(
        None,
        description="the OTLP receiver: http://HOST:4318 (/v1/traces is added) for OTLP/HTTP, HOST:4317 for gRPC",
    )
    protocol: Literal["http/protobuf", "grpc"] = Field(
        "http/protobuf", description="OTLP transport (grpc needs opentelemetry-exporter-otlp-proto-grpc)"
    )
    service_name: str = Field("sibyl-console", min_length=1, description="the gateway's service.name")
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="share of new traces recorded; a client's traceparent decides its own"
    )
    instances: bool = Field(
        True,
        description="started instances export to the same endpoint and join the trace (vLLM --otlp-traces-endpoint; "
        "the emulator emits vLLM's llm_request span)",
    )

    @model_validator(mode="after")
    def _endpoint(self) -> TracingSettings:
        if self.enabled is None:
            self.enabled = self.endpoint is not None
        if self.enabled and not self.endpoint:
            raise ValueError("tracing is enabled without an endpoint (set [tracing] endpoint or --otlp-endpoint)")
        if self.endpoint:
            traces_url(self.endpoint, self.protocol)  # a malformed OTLP/HTTP URL is refused here, not at export
        if self.enabled and (need := missing(self.protocol)) is not None:
            raise ValueError(f"tracing needs the OpenTelemetry packages: {need}")
        return self


def _adapter_paths(adapters: dict[str, str]) -> dict[str, str]:
    """Each adapter's directory made absolute, after checking it holds an adapter (its adapter_config.json)."""
    out = {}
    for name, path in adapters.items():
        if not name:
            raise ValueError("an adapter needs a name")
        try:
            out[name] = str(check_adapter_dir(path))
        except ValueError as e:
            raise ValueError(f"adapter {name!r}: {e}") from None
    return out


class LoraSettings(BaseModel):
    """`[lora]`: LoRA adapters served under the base model (console/live/lora.py loads them where requests run)."""

    model_config = ConfigDict(extra="forbid")

    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="NAME = PATH: adapters clients name in `model` (each PATH a PEFT adapter directory with "
        "adapter_config.json, as the instances read it); more come with `up --lora-adapter` and `lora add`",
    )
    max_loras: int | None = Field(
        None,
        ge=1,
        description="adapters the console keeps loaded on one instance, the least recently used idle one unloaded "
        "to make room (default: the emulator's max_cpu_loras or max_loras, vLLM's --max-cpu-loras or --max-loras "
        "from [vllm] extra_args, else 1)",
    )

    @field_validator("adapters")
    @classmethod
    def _paths(cls, v: dict[str, str]) -> dict[str, str]:
        return _adapter_paths(v)


class PoolSettings(BaseModel):
    """One `[[pools]]` entry: a base model's P/D pool (one per model behind the gateway)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="the base model's served name (what clients put in `model`)")
    name: str | None = Field(None, min_length=1, description="the pool's name (default: its model)")
    prefill: int = Field(2, ge=1, le=256, description="prefill instances to start")
    decode: int = Field(4, ge=1, le=256, description="decode instances to start")
    profile: str | None = Field(None, description="performance profile (default: the top-level profile)")
    path: str | None = Field(None, description="model path for --backend vllm (default: the top-level model)")
    adapters: dict[str, str] = Field(default_factory=dict, description="NAME = PATH: this pool's LoRA adapters")

    @field_validator("adapters")
    @classmethod
    def _paths(cls, v: dict[str, str]) -> dict[str, str]:
        return _adapter_paths(v)

    @property
    def pool_name(self) -> str:
        return self.name or self.model


class PolicyChoice(BaseModel):
    """A policy by name with its params (validated when the console builds it)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class ConsoleConfig(BaseModel):
    """Everything `sibyl-console up` needs; flags override the file, the file overrides defaults."""

    model_config = ConfigDict(extra="forbid")

    backend: str = Field(
        "emulator", description="which installed backend runs the instances (`sibyl-console doctor` lists them)"
    )
    prefill: int = Field(2, ge=1, le=256, description="prefill instances to start")
    decode: int = Field(4, ge=1, le=256, description="decode instances to start")
    profile: str = Field("h20-qwen3-32b", description="performance profile (emulator/sim timing, estimator priors)")
    model: str | None = Field(None, description="model path for --backend vllm")
    served_model_name: str = Field("sibyl-model", description="model name clients use")
    policy: str = Field(
        "prefix_aware",
        description="routing policy at start (prefix_aware, decoding by sibyl: benchmarks/README.md, prefix sweep)",
    )
    params: dict[str, Any] = Field(default_factory=dict, description="routing policy params")
    queue: PolicyChoice = Field(
        default_factory=lambda: PolicyChoice(name="fcfs"),
        description="queue policy at start (who goes next when the cluster is saturated)",
    )
    reschedule: PolicyChoice = Field(
        default_factory=lambda: PolicyChoice(name="none"),
        description="reschedule policy at start (periodic moves of running requests)",
    )
    scaling: PolicyChoice = Field(
        default_factory=lambda: PolicyChoice(name="static"),
        description="scaling policy at start (periodic add/remove/flip of instances)",
    )
    rank: PolicyChoice = Field(
        default_factory=lambda: PolicyChoice(name="engine"),
        description="rank policy at start (the data-parallel rank of a request on a DP decode group)",
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    headless: bool = False
    db: Path | None = None
    attach: dict[str, list[str]] | None = Field(None, description="{'prefill': [url...], 'decode': [url...]}")
    slo: dict[str, SLOClass] = Field(default_factory=lambda: {"default": SLOClass()})
    admission: SloAdmission = Field(
        default_factory=SloAdmission,
        description=(
            "admission that protects the SLO: hold while saturated, 429/503 with Retry-After past a class's wait bound"
        ),
    )
    poll_interval_s: float = Field(0.5, gt=0, le=1.0, description="instance /health + /metrics poll period")
    connect_timeout_s: float = Field(
        30.0,
        gt=0,
        description="how long the gateway waits for a TCP connection to an instance (a refused one fails at once)",
    )
    probe_timeout_s: float = Field(
        2.0,
        gt=0,
        description="how long /health and /metrics may take before a probe fails (a busy CPU vLLM answers slowly)",
    )
    down_after_failures: int = Field(2, ge=1, description="failed probes in a row that mark an instance down")
    breaker_failures: int = Field(
        5, ge=1, description="requests failing in a row on an instance that open its circuit breaker"
    )
    breaker_cooloff_s: float = Field(
        10.0, gt=0, description="how long an open breaker keeps the instance out of routing before one request tries it"
    )
    failure_migration_attempts: int = Field(
        1,
        ge=0,
        le=8,
        description="when a decode instance dies mid-stream, how many times a request is continued on another one "
        "(prompt + tokens already streamed, recomputed there); 0 turns failure migration off",
    )
    drain_timeout_s: float = Field(
        10.0, ge=0, description="on shutdown, how long in-flight requests may take to finish"
    )
    instance_drain_timeout_s: float = Field(
        300.0,
        ge=0,
        description="on scale-in, how long a draining instance's requests may take before it is stopped anyway",
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    instance_base_port: int = Field(0, ge=0, le=65535, description="first port for started instances (0: free ports)")
    prefix: PrefixSettings = Field(
        default_factory=PrefixSettings, description="how routing knows what each instance caches"
    )
    decisions: DecisionSettings = Field(
        default_factory=DecisionSettings, description="which decisions leave a record (runs why, the request inspector)"
    )
    tenants: TenantSettings = Field(
        default_factory=TenantSettings, description="API keys and per-tenant limits for /v1 (none: open, one tenant)"
    )
    tracing: TracingSettings = Field(
        default_factory=TracingSettings, description="OpenTelemetry spans of each request's phases (off by default)"
    )
    advisor: AdvisorSettings = Field(
        default_factory=AdvisorSettings, description="the live what-if advisor and policy canaries' autopilot"
    )
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA adapters served under the base model")
    pools: list[PoolSettings] = Field(
        default_factory=list,
        description="[[pools]]: one P/D pool per base model (model, name, prefill, decode, profile, path, adapters); "
        "none: one pool of the top-level prefill, decode, profile and served_model_name",
    )
    emulator: EmulatorSettings = Field(default_factory=EmulatorSettings)
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    ray: RaySettings = Field(
        default_factory=RaySettings, description="--backend ray: the Ray cluster, engine and per-role resources"
    )
    replay: Path | None = Field(None, description="trace to replay into the cluster once it is up")
    replay_speed: float = Field(1.0, gt=0)
    replay_loop: bool = False
    replay_hash_block_tokens: int = Field(
        512,
        gt=0,
        description="a Mooncake trace's hash block becomes this many prompt tokens (512: as recorded; smaller "
        "scales long prompts down while keeping their prefix structure)",
    )

    @field_validator("backend")
    @classmethod
    def _installed(cls, v: str) -> str:
        if v not in backends.names():
            raise ValueError(f"unknown backend {v!r}; installed: {', '.join(backends.names())}")
        return v

    @field_validator("attach")
    @classmethod
    def _roles(cls, v: dict[str, list[str]] | None) -> dict[str, list[str]] | None:
        return check_attach(v)

    @field_validator("slo")
    @classmethod
    def _named(cls, v: dict[str, SLOClass]) -> dict[str, SLOClass]:
        v = {name: c.model_copy(update={"name": name}) for name, c in v.items()}
        if "default" not in v:
            v["default"] = SLOClass()
        return v

    @model_validator(mode="after")
    def _one_pool(self) -> ConsoleConfig:
        """One `[[pools]]` entry is the console's pool: its model, counts, profile and adapters stand for the
        top-level ones. Names must be unique across pools and adapters."""
        seen: dict[str, str] = {}
        for i, p in enumerate(self.pools):
            for what, names in (("pool", {p.pool_name, p.model}), ("adapter", set(p.adapters))):
                for name in sorted(names):
                    if name in seen:
                        raise ValueError(
                            f"pools[{i}]: {what} name {name!r} is already {seen[name]}; names must be unique"
                        )
                    seen[name] = f"a {what} name of pools[{i}]"
        if len(self.pools) == 1:
            p = self.pools[0]
            self.served_model_name, self.prefill, self.decode = p.model, p.prefill, p.decode
            if p.profile:
                self.profile = p.profile
            if p.path:
                self.model = p.path
            if p.adapters:
                self.lora = self.lora.model_copy(update={"adapters": {**self.lora.adapters, **p.adapters}})
        return self

    @model_validator(mode="after")
    def _advisor_pool(self) -> ConsoleConfig:
        """`[advisor] pool` names one of the console's pools."""
        names = [p.pool_name for p in self.pools] or [self.served_model_name]
        if self.advisor.pool is not None and self.advisor.pool not in names:
            raise ValueError(f"advisor.pool: no pool {self.advisor.pool!r}; pools: {', '.join(names)}")
        return self

    @property
    def pool_name(self) -> str:
        """The name of the console's (single) pool."""
        return self.pools[0].pool_name if self.pools else self.served_model_name

    def max_loras(self) -> int:
        """Adapters the console keeps loaded per instance (see LoraSettings.max_loras)."""
        if self.lora.max_loras is not None:
            return self.lora.max_loras
        if self.backend == "emulator":
            return self.emulator.max_cpu_loras or self.emulator.max_loras
        args = self.vllm.extra_args
        for flag in ("--max-cpu-loras", "--max-loras"):
            for i, a in enumerate(args):
                key, eq, value = a.partition("=")
                if key == flag and (eq or i + 1 < len(args)):
                    with contextlib.suppress(ValueError):
                        return max(int(value if eq else args[i + 1]), 1)
        return 1

    @model_validator(mode="after")
    def _engine_priority(self) -> ConsoleConfig:
        """A queue policy that sets each request's engine `priority` (tail_aware) starts vLLM with
        `--scheduling-policy priority` unless the configuration chose the policy itself."""
        try:
            sets = bool(getattr(registry.spec("queue", self.queue.name).factory, "sets_engine_priority", False))
        except PolicyError:
            return self  # an unknown name is reported where policies are checked, with the list
        if sets and "scheduling_policy" not in self.vllm.model_fields_set:
            self.vllm = self.vllm.model_copy(update={"scheduling_policy": "priority"})
        return self

    @model_validator(mode="after")
    def _lora_instances(self) -> ConsoleConfig:
        """Adapters configured: emulated instances start with --enable-lora (and runtime loading) unless the
        configuration says otherwise."""
        if self.lora.adapters and self.backend == "emulator" and "enable_lora" not in self.emulator.model_fields_set:
            self.emulator = self.emulator.model_copy(update={"enable_lora": True})
        return self

    @model_validator(mode="after")
    def _kv_events(self) -> ConsoleConfig:
        """A precise prefix index needs the emulated instances to publish their KV events."""
        if self.prefix.source == "precise" and self.backend == "emulator" and not self.emulator.kv_events:
            self.emulator = self.emulator.model_copy(update={"kv_events": True})
        if self.prefix.source == "precise" and self.backend == "vllm" and not self.vllm.kv_events:
            self.vllm = self.vllm.model_copy(update={"kv_events": True})
        return self

    @model_validator(mode="after")
    def _trace_instances(self) -> ConsoleConfig:
        """With [tracing] instances on, started instances export their own spans to the same receiver."""
        t = self.tracing
        if not (t.enabled and t.instances and t.endpoint):
            return self
        update = {"otlp_traces_endpoint": traces_url(t.endpoint, t.protocol), "otlp_traces_protocol": t.protocol}
        if self.emulator.otlp_traces_endpoint is None:
            self.emulator = self.emulator.model_copy(update=update)
        if self.vllm.otlp_traces_endpoint is None:
            self.vllm = self.vllm.model_copy(update=update)
        return self

    def backend_settings(self) -> BackendSettings:
        """The part of this configuration the backend needs."""
        return BackendSettings(
            prefill=self.prefill,
            decode=self.decode,
            profile=self.profile,
            model=self.model,
            served_model_name=self.served_model_name,
            instance_base_port=self.instance_base_port,
            attach=self.attach,
            emulator=self.emulator,
            vllm=self.vllm,
            ray=self.ray,
        )


def parse_lora_adapters(items: list[str]) -> dict[str, str]:
    """`--lora-adapter NAME=PATH` (repeated) → {NAME: PATH}."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"--lora-adapter {item!r}: expected NAME=PATH (PATH a LoRA adapter directory)")
        out[name.strip()] = path.strip()
    return out


def parse_attach(text: str) -> dict[str, list[str]]:
    """`prefill=URL,URL;decode=URL` → {"prefill": [...], "decode": [...]}."""
    out: dict[str, list[str]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        role, sep, urls = part.partition("=")
        if not sep:
            raise ConfigError(f"--attach {text!r}: expected role=URL[,URL...][;role=URL...]")
        out.setdefault(role.strip(), []).extend(u.strip() for u in urls.split(",") if u.strip())
    return out


def read_mapping_file(path: Path, what: str = "config") -> tuple[dict[str, Any], str]:
    """The top-level mapping of a .toml, .yaml or .yml file and its text (for line numbers); a ConfigError
    naming the file and `what` it is when it cannot be read, parsed or is not a mapping."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read {what}: {e.strerror}") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"{path}: {what} must be .toml, .yaml or .yml")
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level of {what} must be a table/mapping")
    return data, text


def load_config(path: Path | None, overrides: dict[str, Any]) -> ConsoleConfig:
    """Defaults ← file ← flags (only flags the user actually gave, i.e. not None; "section.key"
    overrides one key of a section)."""
    data, text = read_mapping_file(path) if path is not None else ({}, "")
    for key, value in overrides.items():
        if value is None:
            continue
        section, _, field = key.rpartition(".")  # "vllm.venv" sets one key of the [vllm] table
        target = data
        if section:
            target = data.setdefault(section, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{path}: {section!r} must be a table/mapping")
        target[field] = value
    try:
        return ConsoleConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc: tuple[str | int, ...] = tuple(err["loc"])
        if not loc and (m := re.match(r"Value error, (\w+)\[(\d+)\]", err["msg"])):
            loc = (m.group(1), int(m.group(2)))  # a check across a list's entries names the entry in its message
        elif not loc and (m := re.match(r"Value error, (\w+)\.(\w+):", err["msg"])):
            loc = (m.group(1), m.group(2))  # a check across sections names the field in its message
        where = ".".join(str(x) for x in loc)
        allowed = ", ".join(ConsoleConfig.model_fields) if err["type"] == "extra_forbidden" and len(loc) == 1 else ""
        if loc and loc[-1] == "adapters" and (m := re.search(r"adapter '([^']+)'", err["msg"])):
            loc = (*loc, m.group(1))  # the adapter whose path does not load
        line = line_of(text, loc, path.suffix) if path is not None else None
        src = f"{path}:{line}: " if line is not None else f"{path}: " if path is not None else ""
        extra = f" (allowed keys: {allowed})" if allowed else ""
        raise ConfigError(f"{src}field {where!r}: {err['msg']}{extra}") from None

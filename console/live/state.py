"""The console's state as the control API serves it: `ConsoleState` with one `InstanceRow` per instance."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from core.slo import SLOClass


class _Model(BaseModel):
    # Unknown keys are kept (a newer console may send more) and every field has a default where the
    # dashboard has a fallback, so a client validates what any console sends. A snapshot is dumped
    # with exclude_unset: the JSON has exactly the keys the console set.
    model_config = ConfigDict(extra="allow")


class ScrapedCounters(_Model):
    """An instance's own cumulative counters at its last /metrics scrape (vLLM's names without `vllm:`)."""

    prompt_tokens_total: float | None = Field(None, description="prompt tokens it has processed (vllm:prompt_tokens)")
    generation_tokens_total: float | None = Field(None, description="tokens it has generated (vllm:generation_tokens)")
    success_total: float | None = Field(None, description="requests it finished (vllm:request_success)")
    preemptions_total: float | None = Field(None, description="requests it preempted (vllm:num_preemptions)")
    failed_transfers_total: float | None = Field(
        None, description="KV transfers that failed (vllm:nixl_num_failed_transfers)"
    )


class CalibratedTerm(_Model):
    """One step or KV term of an instance's profile as its online fitter last reported it."""

    value: float | None = Field(None, description="the value the instance is projected with, seconds (per unit)")
    prior: float | None = Field(None, description="the console's profile's value (the prior)")
    source: str = Field(
        "", description="fit, fit: clipped …, or prior: not identified (why) (the term then keeps its prior)"
    )
    residual: float | None = Field(
        None, description="relative RMS residual of the regression it belongs to (none before a fit)"
    )
    samples: int = Field(0, description="intervals (or legs) in the window that moved it")
    age_s: float | None = Field(None, description="seconds since the newest of them (none: none yet)")


class CalibrationCheck(_Model):
    """What an engine measured against what its fitted terms project, over the last 30 s."""

    measured_s: float = Field(description="mean seconds the engine reported (prefill time or time per output token)")
    projected_s: float = Field(description="mean seconds the fitted step model projects for the same intervals")


class InstanceCalibration(_Model):
    """An instance's online calibration (core/calibration/online.py): its fitted terms, refitted every few seconds."""

    calibrated: bool = Field(
        False,
        description="whether its prefill steps are projected with these terms (some step term was fitted, or the "
        "terms were scaled to what the engine measured); else with the console's profile",
    )
    from_peers: bool = Field(
        False,
        description="not calibrated itself, so projected with what its calibrated peers of the same role measured",
    )
    fitted_age_s: float | None = Field(None, description="seconds since the last refit")
    terms: dict[str, CalibratedTerm] = Field(default_factory=dict, description="each fitted term by profile name")
    correction: dict[str, float] = Field(
        default_factory=dict,
        description="per group (prefill, decode): the factor the terms not identified alone were scaled by so the "
        "projection matches what the engine measured (empty: none)",
    )
    check: dict[str, CalibrationCheck] = Field(
        default_factory=dict,
        description="per kind of interval (prefill: the engine's prefill time; tpot: its time per output token): "
        "measured against projected",
    )


class RefusalCount(_Model):
    """Requests refused for one cause since the console started; the last one's projected start against its bound."""

    count: int = Field(0, description="requests refused (429 at arrival, 503 once held)")
    last_projected_s: float | None = Field(
        None, description="seconds after its arrival the last one was projected to start"
    )
    bound_s: float | None = Field(None, description="the bound it was held to, seconds after arrival")


class InstanceRow(_Model):
    """One instance as the console sees it: identity, health, its own load and what the gateway routed to it."""

    id: str = Field(description="instance id (p0, d1, ...)")
    role: str = Field(description="prefill, decode or both")
    phase: str = Field(
        "active", description="starting, active, draining or stopped (only active instances are routed to)"
    )
    breaker: str = Field(
        "closed",
        description="its circuit breaker: closed, open (not routed to) or half_open (the next request tries it)",
    )
    url: str = Field("", description="base URL of its OpenAI-compatible server (empty while it starts)")
    healthy: bool = Field(False, description="whether its /health probes pass")
    managed: bool = Field(
        True, description="started by this console's backend (false: attached, never stopped by the console)"
    )
    running: int = Field(0, description="requests it runs, from its /metrics")
    waiting: int = Field(0, description="requests waiting in its queue, from its /metrics")
    kv_usage: float | None = Field(None, description="share of its KV cache in use, 0..1, from its /metrics")
    tokens_per_s: float | None = Field(None, description="tokens it generated per second between the last two scrapes")
    prefix_hit_rate: float | None = Field(
        None,
        description="prompt tokens found in its prefix cache ÷ tokens looked up, over the last 30 s (its own /metrics)",
    )
    cached_share: float | None = Field(
        None, description="prompt tokens found in its own cache ÷ prompt tokens it took in, over the last 30 s"
    )
    projected_load: float | None = Field(
        None, description="its load as the active routing policy sees it (none: the policy projects none)"
    )
    routed_running: int = Field(0, description="requests the gateway routed to it that are running there")
    routed_pending: int = Field(0, description="requests the gateway routed to it that have not started there yet")
    failures: int = Field(0, description="requests that failed because of it since the console started")
    pid: int | None = Field(None, description="its local process id when this console started it")
    node: str | None = Field(
        None, description="where it runs when the backend places instances across machines (none: this host)"
    )
    dp_ranks: list[int] | None = Field(
        None,
        description="resident KV tokens per rank of a data-parallel group "
        "(none: not a group, or the group places requests itself)",
    )
    scraped: ScrapedCounters = Field(
        default_factory=ScrapedCounters,
        description="its cumulative counters at the last /metrics scrape (empty while it starts)",
    )
    backlog_s: float | None = Field(
        None,
        description="prefill instances: seconds until what the gateway projects queued there has drained "
        "(its batching-aware projection, the backlog SLO admission judges by; 0: nothing queued)",
    )
    calibration: InstanceCalibration | None = Field(
        None, description="its online calibration: fitted terms, residual, age, source (none before its first refit)"
    )

    pool: str | None = Field(None, description="the pool it serves (one per base model)")
    adapters: list[str] | None = Field(None, description="the LoRA adapters loaded on it")

    @property
    def load(self) -> float:
        """Projected load as the active policy sees it, else running + waiting."""
        if self.projected_load is None:
            return float(self.running + self.waiting)
        return float(self.projected_load)


class ActivePolicy(_Model):
    """The active policy of one kind."""

    name: str = Field(description="registered policy name")
    params: dict[str, Any] = Field(default_factory=dict, description="its parameters, defaults filled in")


class SloStats(_Model):
    """Outcomes over a span (the last window, or the whole run); none where nothing finished yet."""

    requests: int | None = Field(None, description="requests that finished")
    failed: int | None = Field(None, description="requests that failed")
    attainment: float | None = Field(
        None,
        description=(
            "share of requests that met their SLO (TTFT and TPOT; "
            "a request without a measured TPOT on TTFT alone), 0..1"
        ),
    )
    ttft_attainment: float | None = Field(
        None, description="share that met their TTFT target, of those with a measured TTFT or failed"
    )
    tpot_attainment: float | None = Field(
        None,
        description=(
            "share that met their TPOT target, of those with a measured TPOT or failed (whole replies are left out)"
        ),
    )
    tpot_unknown: int | None = Field(
        None, description="requests that succeeded without a measured TPOT (whole, non-streamed replies)"
    )
    ttft_p50: float | None = Field(None, description="median time to first token, seconds")
    ttft_p99: float | None = Field(None, description="99th percentile time to first token, seconds")
    tpot_p50: float | None = Field(None, description="median time per output token, seconds")
    tpot_p99: float | None = Field(None, description="99th percentile time per output token, seconds")
    goodput_req_s: float | None = Field(None, description="requests per second that met their SLO (window only)")


class SloSnapshot(_Model):
    """SLO targets and attainment, over the last window and the run."""

    classes: dict[str, SLOClass] = Field(
        default_factory=dict, description="the SLO classes by name (their TTFT and TPOT targets)"
    )
    window_s: float = Field(60.0, description="length of the sliding window, seconds")
    window: SloStats = Field(default_factory=SloStats, description="outcomes of the last window_s seconds")
    run: SloStats = Field(default_factory=SloStats, description="outcomes since the console started")


class RequestCounts(_Model):
    """Requests through the gateway."""

    in_flight: int | None = Field(None, description="requests in the gateway now")
    total: int | None = Field(None, description="requests since the console started")
    failed: int | None = Field(None, description="requests that failed since the console started")


class QueueState(_Model):
    """The gateway's queue (requests the queue policy holds while the cluster is saturated) and its limits."""

    depth: int = Field(0, description="requests held now")
    by_class: dict[str, int] = Field(default_factory=dict, description="held requests per priority band or SLO class")
    max_queued: int | None = Field(None, description="the most it holds before it sheds (429)")
    max_in_flight_per_instance: int | None = Field(
        None, description="requests per instance above which arrivals are held"
    )
    ttl_s: float | None = Field(None, description="how long a request may be held before it is rejected (503)")
    admission: dict[str, float | int] | None = Field(
        None,
        description=(
            "SLO admission's limits in force (decode slots, wait bound, ...) and its shed/expired counts; none when off"
        ),
    )
    refusals: dict[str, RefusalCount] | None = Field(
        None,
        description="SLO admission's refusals by cause (prefill_backlog, decode_slots, kv, queue_full, tenant_limit); "
        "none when off",
    )


class TenantRow(_Model):
    """One tenant of /v1: its limits in force and what it has done since the console started."""

    in_flight: int = Field(0, description="its requests in the gateway now")
    max_in_flight: int | None = Field(None, description="its limit on requests in flight (none: no limit)")
    tokens_per_minute: int | None = Field(
        None, description="prompt + max_tokens it may start per minute (none: no limit)"
    )
    tokens_available: int | None = Field(None, description="tokens left in its per-minute bucket now")
    priority: int = Field(0, description="the earliest priority band its requests go in")
    weight: float = Field(1.0, description="its share when held requests are released between tenants")
    requests: dict[str, int] = Field(
        default_factory=dict,
        description="its requests by outcome: met, missed (their SLO), failed, limited (refused by its own limits)",
    )
    prompt_tokens: int = Field(0, description="prompt tokens of its requests that reached an instance")
    output_tokens: int = Field(0, description="tokens generated for it")


class TenantsState(_Model):
    """API keys and per-tenant limits of /v1."""

    keys_file: str | None = Field(None, description="the keys file (none: /v1 is open, one `default` tenant)")
    required: bool = Field(False, description="whether /v1 requires a tenant's API key")
    loaded_at: float | None = Field(None, description="when the table in force was loaded, Unix seconds")
    last_error: str | None = Field(
        None, description="why the last reload failed (the previous table stayed in force); none after a good one"
    )
    unauthorized: int = Field(0, description="requests refused with 401 (missing or unknown key)")
    tenants: dict[str, TenantRow] = Field(default_factory=dict, description="each tenant by name")


class ReplayProgress(_Model):
    """A trace replay started with `up --replay`."""

    status: str | None = Field(None, description="running, paused, stopped or done")
    paused: bool = Field(False, description="whether it is paused")
    total: int | None = Field(None, description="requests in the trace")
    sent: int | None = Field(None, description="requests sent so far")
    done: int | None = Field(None, description="requests answered so far")
    failed: int | None = Field(None, description="requests that failed")
    in_flight: int | None = Field(None, description="requests sent and not answered yet")
    laps: int | None = Field(None, description="times the trace was replayed in full (looping)")
    ttft_p50: float | None = Field(None, description="median time to first token the replayer saw, seconds")
    ttft_p99: float | None = Field(None, description="99th percentile time to first token the replayer saw, seconds")
    tpot_p50: float | None = Field(None, description="median time per output token the replayer saw, seconds")
    tpot_p99: float | None = Field(None, description="99th percentile time per output token the replayer saw, seconds")
    label: str | None = Field(None, description="the trace, its speed-up and whether it loops")


class PoolState(_Model):
    """One pool: a base model's instances, its policies, queue and admission, prefix index and LoRA adapters."""

    model: str = Field(description="the base model's served name")
    cluster: str | None = Field(None, description="its active prefill and decode instances, e.g. 1P1D")
    instances: list[str] = Field(default_factory=list, description="its instances' ids")
    policies: dict[str, ActivePolicy] = Field(default_factory=dict, description="its active policy of each kind")
    queue: QueueState | None = Field(
        None, description="its queue: the requests its queue policy holds, its limits, SLO admission and refusals"
    )
    assignment_ratio: float | None = Field(
        None, description="share of its routing decisions optimal at handoff (SIBYL's optimal assignment ratio)"
    )
    prefix: dict[str, Any] | None = Field(None, description="its prefix-cache index (as the top-level `prefix`)")
    adapters: dict[str, Any] = Field(
        default_factory=dict,
        description="its LoRA adapters by name: path, the instances holding it, requests running under it",
    )
    lora_counts: dict[str, int] = Field(
        default_factory=dict, description="adapter hits, misses, loads, evictions and load failures since start"
    )


class ConsoleState(_Model):
    """A snapshot of a running console (`GET /control/state`, the `state` events, `status --json`)."""

    run_id: str = Field("", description="the run this console records into")
    backend: str = Field("", description="what runs the instances (emulator, vllm, sim, ray...)")
    cluster: str = Field("", description="active prefill and decode instances, e.g. 2P4D")
    model: list[str] = Field(default_factory=list, description="model names the gateway serves")
    uptime_s: float = Field(0.0, description="seconds since the console started")
    started_at: float | None = Field(None, description="when it started, Unix seconds")
    instances: list[InstanceRow] = Field(description="every instance, starting ones included")
    policies: dict[str, ActivePolicy] = Field(
        default_factory=dict,
        description="the active policy of each kind (routing, queue, reschedule, scaling, rank); with several pools "
        "the first pool's (`pools` has each pool's)",
    )
    slo: SloSnapshot = Field(default_factory=SloSnapshot, description="SLO targets and attainment")
    requests: RequestCounts = Field(default_factory=RequestCounts, description="requests through the gateway")
    queue: QueueState | None = Field(
        None,
        description="the gateway's queue and its limits; with several pools its depth counts every pool's held "
        "requests and its limits, admission and refusals are the first pool's (`pools` has each pool's)",
    )
    assignment_ratio: float | None = Field(
        None,
        description="share of routing decisions that were optimal at handoff (SIBYL's optimal assignment ratio); "
        "with several pools the first pool's (`pools` has each pool's)",
    )
    draining: bool = Field(False, description="whether the console is stopping (new requests get 503)")
    replay: ReplayProgress | None = Field(None, description="a replay started with `up --replay` (none: no replay)")
    prefix: dict[str, Any] | None = Field(
        None,
        description="the prefix-cache index routing reads: source (off, approximate, precise), block size, the share "
        "of requests that had prefix keys, the mean /tokenize time, the local tokenizer and its mean time per prompt, "
        "and per instance its KV-event subscription's lag; with several pools the first pool's (`pools` has each "
        "pool's)",
    )
    capabilities: dict[str, bool] = Field(
        default_factory=dict,
        description="what the backend can do beyond the basics (scale, role_flip, migration...) and replay",
    )
    tenants: TenantsState | None = Field(None, description="API keys, per-tenant limits and counters of /v1")
    advisor: dict[str, Any] | None = Field(
        None,
        description="the what-if advisor ([advisor]; none: off): the pool it advises on, apply mode, period and "
        "window, its worker's pid "
        "and CPU share, and the latest advice's ranking (predicted P99 TTFT, attainment and gain of each candidate, "
        "whether the gain clears the advisor's error, which is shown beside it); GET /control/advice has it whole",
    )
    canary: dict[str, Any] | None = Field(
        None,
        description="the policy canary: the running one (plan, pool, elapsed, requests finished per arm, latest "
        "reading) and the last one that ended, with its verdict",
    )
    pools: dict[str, PoolState] | None = Field(
        None,
        description="the pools by name (one per base model): instances, policies, queue and admission, assignment "
        "ratio, prefix index, LoRA adapters",
    )

    def to_json(self) -> dict[str, Any]:
        """The JSON object served: the keys the console set, nothing added."""
        return self.model_dump(mode="json", exclude_unset=True)

    def policy_entries(self) -> dict[str, dict[str, Any]]:
        """The active policies as plain {name, params} objects (as the control API's events carry them)."""
        return {kind: p.model_dump(mode="json", exclude_unset=True) for kind, p in self.policies.items()}


def json_schema(ref_prefix: str = "#/components/schemas/") -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON schema of ConsoleState for an OpenAPI document: (its schema, the schemas it refers to by name)."""
    schema = ConsoleState.model_json_schema(ref_template=ref_prefix + "{model}")
    defs = schema.pop("$defs", {})
    return schema, defs

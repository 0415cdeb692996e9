"""The run store's tables (sqlmodel): runs, requests, policy events, instance samples and events, advisor events."""

from __future__ import annotations

from sqlmodel import Field, SQLModel

SCHEMA_VERSION = 11
"""1: first release. 2: requests.queued (when the gateway queue held a request). 3: runs.sweep
(the `sweep` a run belongs to). 4: requests.dp_rank (the data-parallel rank it decoded on).
5: requests.ttft_source (what a request's TTFT was measured to: its first streamed token, or the
end of its prefill leg for a whole reply whose TPOT is unknown). 6: requests.cached_tokens (prompt tokens the
engine found in its prefix cache). 7: the decisions table (decision records, created as a new table).
8: requests.tenant (the tenant it was charged to). 9: requests.model, lora, arm, session and prefix_keys (what
the request asked for and which canary arm it ran in), and the advisor_events table (advice and canaries).
10: policy_events.pool (the pool whose policy changed, with several pools: one per base model). 11:
instance_samples.health_rtt_s (the instance's /health round trip when sampled, so a live run's legs can be
calibrated before it ends)."""

MIGRATIONS: dict[int, list[str]] = {
    2: ["ALTER TABLE requests ADD COLUMN queued FLOAT"],
    3: ["ALTER TABLE runs ADD COLUMN sweep VARCHAR", "CREATE INDEX IF NOT EXISTS ix_runs_sweep ON runs (sweep)"],
    4: ["ALTER TABLE requests ADD COLUMN dp_rank INTEGER"],
    5: ["ALTER TABLE requests ADD COLUMN ttft_source VARCHAR"],
    6: ["ALTER TABLE requests ADD COLUMN cached_tokens INTEGER"],
    7: [],  # the decisions table: new, so create_all makes it (at any older version too)
    8: ["ALTER TABLE requests ADD COLUMN tenant VARCHAR"],
    9: [
        "ALTER TABLE requests ADD COLUMN model VARCHAR",
        "ALTER TABLE requests ADD COLUMN lora VARCHAR",
        "ALTER TABLE requests ADD COLUMN arm VARCHAR",
        "ALTER TABLE requests ADD COLUMN session VARCHAR",
        "ALTER TABLE requests ADD COLUMN prefix_keys BLOB",
    ],  # and the advisor_events table: new, so create_all makes it
    10: ["ALTER TABLE policy_events ADD COLUMN pool VARCHAR"],
    11: ["ALTER TABLE instance_samples ADD COLUMN health_rtt_s FLOAT"],
}
"""Statements that bring a store of version N-1 to N (tables created afresh need none)."""


class Run(SQLModel, table=True):
    __tablename__ = "runs"

    run_id: str = Field(primary_key=True)
    kind: str = Field(description="sim | live | replay")
    started_at: float
    ended_at: float | None = None
    status: str = Field(default="running", index=True, description="running | completed | failed | interrupted")
    backend: str = ""
    cluster: str = ""
    workload: str = ""
    seed: int | None = None
    policy: str = ""
    config: str = "{}"
    pid: int | None = None
    parent_run_id: str | None = None
    notes: str = ""
    summary: str | None = None
    sweep: str | None = Field(default=None, index=True, description="name of the `sweep` the run is a grid point of")


class RequestRecord(SQLModel, table=True):
    __tablename__ = "requests"

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(index=True)
    request_id: str
    arrival: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    max_tokens: int | None = None
    slo_class: str | None = None
    priority: int | None = None
    prefill_instance: str | None = None
    decode_instance: str | None = None
    dp_rank: int | None = Field(
        default=None,
        description="the data-parallel rank its decode leg asked for (None: not a DP group, or the group chose)",
    )
    queued: float | None = Field(default=None, description="when the gateway queue took it (None: routed at once)")
    prefill_start: float | None = None
    prefill_end: float | None = None
    decode_start: float | None = None
    first_token: float | None = None
    finish: float | None = None
    ttft: float | None = Field(
        default=None, description="time to first token, seconds (None: not measured; see ttft_source)"
    )
    tpot: float | None = Field(
        default=None, description="time per output token, seconds (None: not measured, e.g. a whole reply)"
    )
    ttft_source: str | None = Field(
        default=None,
        description="first_token: TTFT ends at the first streamed token; prefill_end: a whole (non-streamed) reply, "
        "TTFT ends when its prefill leg returned (no KV hand-off, no decode step) and TPOT is unknown; None: no "
        "TTFT, or a row written before schema 5, by the simulator or by a replay (their TTFT is the first token)",
    )
    e2e: float | None = None
    cached_tokens: int | None = Field(
        default=None,
        description="prompt tokens served from a prefix cache: the engine's usage.prompt_tokens_details.cached_tokens "
        "(replays), the simulator's exact count; None: not reported",
    )
    status: str = "ok"
    reason: str | None = None
    slo_met: bool | None = None
    tenant: str | None = Field(
        default=None,
        description="the tenant it was charged to: its API key's tenant, or default when /v1 takes no keys "
        "(None: written before schema 8, or by the simulator)",
    )
    model: str | None = Field(
        default=None,
        description="the base model it ran on (its pool's model; the adapter's base model when it named an adapter); "
        "None: not recorded (written before schema 9, or by a writer that does not know it)",
    )
    lora: str | None = Field(default=None, description="the LoRA adapter it named (None: the base model itself)")
    arm: str | None = Field(
        default=None, description="canary | control: its arm in the policy canary running when it arrived (None: none)"
    )
    session: str | None = Field(default=None, description="the session (conversation) it belonged to (None: none)")
    prefix_keys: bytes | None = Field(
        default=None,
        description="its prompt's prefix block keys, 8 bytes each (adapters/store/keys.py); RunStore.add_requests "
        "takes a sequence of ints and RunStore.requests gives a tuple back (None: not recorded)",
    )


class PolicyEventRecord(SQLModel, table=True):
    __tablename__ = "policy_events"

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(index=True)
    t: float
    kind: str
    old: str | None = None
    new: str
    params: str = "{}"
    source: str = "api"
    pool: str | None = Field(
        default=None,
        description="the pool whose policy it was (a live console's pool, one per base model); None: written "
        "before schema 10, or by a writer with no pools (the simulator)",
    )


class InstanceSample(SQLModel, table=True):
    __tablename__ = "instance_samples"

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(index=True)
    t: float
    instance_id: str
    role: str
    healthy: bool = True
    running: float = 0
    waiting: float = 0
    kv_usage: float = 0
    tokens_per_s: float = 0
    projected_load: float | None = None
    health_rtt_s: float | None = Field(
        default=None, description="median of the instance's recent /health round trips, seconds (None: none yet)"
    )


class InstanceEvent(SQLModel, table=True):
    __tablename__ = "instance_events"

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(index=True)
    t: float
    instance_id: str
    event: str = Field(description="up | down | starting | added | draining | removed | flipped | failed | refused")
    detail: str = ""


class DecisionRecord(SQLModel, table=True):
    """One decision as the policy saw it (core/decision_records.py): candidates with features and scores."""

    __tablename__ = "decisions"

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(index=True)
    request_id: str | None = Field(default=None, index=True, description="the request it was about (None: scaling)")
    t: float = Field(description="seconds since the run started")
    kind: str = Field(description="route | bind | handoff | rank | release | retry | scale | reschedule")
    stage: str = Field(description="what was chosen: prefill | decode | rank | queue | scaling | reschedule")
    policy: str
    scorer: str = Field(default="", description="whose scores these are when not `policy`'s (a composed router)")
    chosen: str | None = None
    score_name: str = Field(default="", description="what the scores measure, lower is better; empty: none")
    candidates: str = Field(
        default="{}",
        description="JSON: the candidates column-wise ({names, scores, eligible, features}), or the maker and "
        "arguments of core.decision_records that rebuild them (read through RunStore.decisions)",
    )
    info: str = Field(default="{}", description="JSON: decision-wide facts (tau, reason, still_best)")


ADVISOR_EVENTS = ("advice", "canary_start", "canary_reading", "canary_end")
"""The kinds of advisor event: a window's advice; a canary's start, each reading, and its end with the verdict."""


class AdvisorEventRecord(SQLModel, table=True):
    """What the advisor advised, and each policy canary's life (start, readings, end)."""

    __tablename__ = "advisor_events"

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(index=True)
    t: float = Field(description="seconds since the console started (the clock of requests and policy events)")
    event: str = Field(description="advice | canary_start | canary_reading | canary_end")
    canary: str | None = Field(default=None, description="the canary's id (None: an advice)")
    kind: str | None = Field(default=None, description="the policy kind advised or canaried (routing, queue, rank)")
    policy: str | None = Field(
        default=None, description="advice: the candidate it advised (None: keep the active ones); a canary: its policy"
    )
    decision: str | None = Field(
        default=None,
        description="a canary reading's decision (continue, promote, rollback, equal, inconclusive), its end's "
        "verdict (those, or interrupted); an advice: what was done with it (suggest, canary, auto)",
    )
    detail: str = Field(default="", description="the reason, in words")
    data: str = Field(default="{}", description="JSON: the whole advice, plan or reading")


ADVISOR_COLUMNS = [c for c in AdvisorEventRecord.model_fields if c not in ("id", "run_id")]
DECISION_COLUMNS = [c for c in DecisionRecord.model_fields if c not in ("id", "run_id")]
REQUEST_COLUMNS = [c for c in RequestRecord.model_fields if c not in ("id", "run_id")]
SAMPLE_COLUMNS = [c for c in InstanceSample.model_fields if c not in ("id", "run_id")]

"""A live request's record: the steps of its life, how it ended (`Outcome`), and the row the run store keeps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from core.types import Request


class Step(StrEnum):
    """Where a live request is in its life."""

    ADMITTED = "admitted"
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE_BOUND = "decode_bound"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"


class Outcome(StrEnum):
    """How a live request ended; its `reason` says the rest in words."""

    OK = "ok"
    """Its reply reached the client whole."""
    SHED = "shed"
    """Turned away at arrival by the queue policy (the queue is full): 429."""
    EXPIRED = "expired"
    """Held by the queue policy past its ttl, or past its class's wait bound (SLO admission): 503."""
    ABANDONED = "abandoned"
    """Its client left while the queue policy held it."""
    NO_CAPACITY = "no_capacity"
    """No instance to route it to, at arrival or at prefill end: 503."""
    TENANT_LIMIT = "tenant_limit"
    """Refused by its tenant's own limits: 429."""
    UPSTREAM = "upstream"
    """An instance failed it (refused a leg, died, or ended the stream early) and it could not be saved."""
    CLIENT_GONE = "client_gone"
    """Its client disconnected after it left the queue (mid-stream, or while its legs ran)."""
    INTERNAL = "internal"
    """A bug of the gateway's (logged)."""


@dataclass(slots=True, eq=False)
class RequestRecord:
    """What happened to one live request, stamped as it happens; its LiveRequest is the only writer.

    Outcomes, tracing, tenants and the request inspector read it; none of them sees the request."""

    request: Request
    stream: bool
    id: str = field(init=False, default="")
    step: Step = Step.ADMITTED
    times: dict[Step, float] = field(default_factory=dict)
    """When each step was entered (monotonic seconds)."""
    prefill_instance: str | None = None
    decode_instance: str | None = None
    """The decode instance now (a migration or a failover moves it)."""
    tried_prefill: list[str] = field(default_factory=list)
    """Prefill instances that failed this request."""
    tried_decode: list[str] = field(default_factory=list)
    """Decode instances that failed this request (refused it, or died mid-stream)."""
    output_tokens: int = 0
    first_token_at: float | None = None
    """When its first streamed token reached the gateway (None for a whole reply)."""
    cached_tokens: int | None = None
    """Prompt tokens its prefill instance found in its prefix cache (reported by an engine started with
    --enable-prompt-tokens-details; None: not reported, or no prefill leg)."""
    dp_rank: int | None = None
    """The data-parallel rank its decode leg asked for (a decode instance that is a DP group)."""
    reason: str | None = None
    """Why it failed (None when it did not)."""
    recovered: str | None = None
    """What the gateway did to save it after a failure (recorded as part of the reason)."""
    outcome: Outcome | None = None
    """How it ended (None while it is in the gateway)."""
    model: str = ""
    """The base model it ran on (its pool's model; for a request naming an adapter, the adapter's base model)."""
    lora_wait_s: float = 0.0
    """Seconds it waited for its LoRA adapter to be loaded where its legs run (0: held there, or no adapter)."""
    arm: str | None = None
    """canary or control: its arm in the policy canary running when it was routed (None: none ran)."""

    def __post_init__(self) -> None:
        self.id = str(self.request.id)
        self.times.setdefault(Step.ADMITTED, self.request.arrival)

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    def enter(self, step: Step, now: float | None = None) -> float:
        """Move to `step` and stamp it (now, unless told when)."""
        t = time.monotonic() if now is None else now
        self.step = step
        self.times[step] = t
        return t

    def at(self, step: Step) -> float | None:
        return self.times.get(step)

    @property
    def finish(self) -> float:
        """When it entered its last step (its end, once it has one)."""
        return self.times[self.step]

    def saved(self, note: str) -> None:
        """One more thing the gateway did to save it."""
        self.recovered = note if self.recovered is None else f"{self.recovered}; {note}"


class RequestRow(NamedTuple):
    """The stored row of a finished request (times in seconds since the console started).

    A named tuple, immutable as a frozen dataclass would be, but made and turned into the store's dict
    without a Python call per field: one is made per request on the gateway's hot path."""

    request_id: str
    arrival: float | None
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    slo_class: str
    priority: int
    prefill_instance: str | None
    decode_instance: str | None
    dp_rank: int | None
    queued: float | None
    prefill_start: float | None
    prefill_end: float | None
    decode_start: float | None
    first_token: float | None
    finish: float | None
    ttft: float | None
    tpot: float | None
    ttft_source: str | None
    cached_tokens: int | None
    e2e: float | None
    status: str
    """`ok` or `failed`."""
    reason: str | None
    slo_met: bool | None
    tenant: str
    model: str | None = None
    """The base model it ran on (None: not known)."""
    lora: str | None = None
    """The LoRA adapter it named (None: the base model)."""
    arm: str | None = None
    """canary or control: its arm in the policy canary running when it was routed (None: none ran)."""
    session: str | None = None
    """The session (conversation) it belonged to (None: none)."""
    prefix_keys: tuple[int, ...] | None = None
    """Its prompt's prefix block keys as routing saw them (None: none were computed), so a window read back
    from the run store keeps its prefix structure (console/advisor/window.py)."""

    def stored(self) -> dict[str, Any]:
        """The row as the run store takes it (adapters.store.RunRecorder.request): one key per column."""
        row = _EMPTY_ROW.copy()  # sized for every column already: filling it in needs no resize
        row.update(zip(ROW_COLUMNS, self, strict=True))
        return row


ROW_COLUMNS: tuple[str, ...] = RequestRow._fields
"""The stored columns of a request, in order."""
_EMPTY_ROW: dict[str, Any] = dict.fromkeys(ROW_COLUMNS)
"""Every column, None: what `RequestRow.stored` copies and fills in (never changed itself)."""

"""The vocabulary of the single-instance simulator (engine.py): request states, the per-request
record orderings read, the `Ordering` protocol and what it sees of the instance (`OrderedInstance`), engine
limits, and what a run returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from core.perf import PerfProfile

WAITING = 0
RUNNING = 1
DONE = 2
REJECTED = 3

Key = tuple[float, ...]


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request inside the instance simulator, with the per-request state orderings use."""

    rid: int
    arrival: float
    prompt: int
    output: int
    """True output length (tokens generated before it finishes)."""
    state: int = WAITING
    generated: int = 0
    computed: int = 0
    """Tokens whose KV is resident (reset to 0 on preemption)."""
    blocks: int = 0
    hw: int = 0
    """High-water mark of `computed`: tokens computed at least once (recompute is not counted)."""
    admit_seq: int = 0
    """Order of the latest admission into the running set (vLLM's running-list order)."""
    queue_seq: int = 0
    """FIFO position in the waiting queue (negative = put back at the head after a preemption)."""
    first_token: float = math.nan
    finish: float = math.nan
    preemptions: int = 0
    recomputed: int = 0
    """Tokens re-prefilled after preemptions."""
    evicted_step: int = -1
    sched_step: int = -1
    """Last step in which it was in the batch."""
    ver: int = 0
    """Version of its waiting-heap entry (stale entries are skipped)."""
    # --- ordering state (each ordering uses its own subset) -----------------------------------
    pred: int = 0
    """Predicted output length (predicted-length orderings)."""
    phi: float = 0.0
    """Tail-aware priority Φ (seconds)."""
    bin: int = -1
    """MemGuard bin ŵ (tokens) the current Φ was computed from."""
    lease: bool = False
    """MemGuard lease: not evictable and served first while its bin is unchanged."""
    promoted: bool = False
    """LTR starvation guard: promoted to the top for `runs` scheduled steps."""
    runs: int = 0
    idle_base: int = 0
    """Step from which LTR counts its idle steps (last scheduled, arrival or promotion)."""

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.generated

    @property
    def work(self) -> int:
        """Attained service w: prompt tokens prefilled (once) + tokens generated (spec §2.1/A.5;
        recomputed tokens are not counted again, §2.5)."""
        return min(self.hw, self.prompt) + self.generated

    @property
    def in_prefill(self) -> bool:
        """Before its first token (a recompute after preemption counts as decode phase)."""
        return self.generated == 0


class OrderedInstance(Protocol):
    """What an ordering sees of the instance it serves (engine.InstanceSim): its state, and the two re-keying
    calls an ordering may make."""

    @property
    def profile(self) -> PerfProfile: ...

    @property
    def step_no(self) -> int:
        """Steps taken so far."""
        ...

    @property
    def running(self) -> list[SimRequest]:
        """Resident requests, in admission order."""
        ...

    @property
    def waiting(self) -> dict[int, SimRequest]:
        """Waiting requests by id."""
        ...

    def requeue(self, r: SimRequest) -> None:
        """Re-key one waiting request (after its ordering changed its key)."""
        ...

    def rekey_waiting(self) -> None:
        """Rebuild the waiting order from scratch (after a global key change, e.g. a new γ)."""
        ...


class Ordering(Protocol):
    """A pluggable priority order for `InstanceSim` (lower key = served first)."""

    name: str
    admit_after_preemption: bool
    """False: no waiting request is admitted in a step that preempted (vLLM v1)."""

    def bind(self, inst: OrderedInstance) -> None:
        """Called once by the instance it serves, before any request arrives."""
        ...

    def on_arrival(self, r: SimRequest, now: float) -> None: ...

    def key(self, r: SimRequest) -> Key:
        """Scan key of a running or waiting request (waiting keys must stay fixed until the
        ordering calls `inst.requeue` or `inst.rekey_waiting`)."""
        ...

    def before_step(self, now: float) -> None: ...

    def victim(self, r: SimRequest, forced: bool) -> SimRequest | None:
        """Running request to preempt so that `r` fits (may be `r` itself), or None: r waits.
        `forced`: the step is empty so far and r is running; name someone to make progress."""
        ...

    def on_scheduled(self, r: SimRequest) -> None: ...

    def on_evict(self, r: SimRequest) -> None: ...

    def after_step(self, dt: float, tokens: int, now: float) -> None: ...

    def on_finish(self, r: SimRequest, now: float) -> None: ...


class InstanceParams(BaseModel):
    """Engine limits of the simulated instance (vLLM SchedulerConfig names in descriptions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_budget: int = Field(2048, ge=1, description="tokens per step over all requests (max_num_batched_tokens)")
    chunk_size: int = Field(
        1024,
        ge=1,
        description="prefill tokens per request per step (long_prefill_token_threshold; paper C)",
    )
    max_num_seqs: int | None = Field(
        None, ge=1, description="resident requests at most; None = the profile's max_num_seqs"
    )
    kv_capacity_tokens: int | None = Field(
        None, ge=1, description="KV capacity in tokens; None = the profile's kv_capacity_tokens"
    )
    block_size: int | None = Field(None, ge=1, description="tokens per KV block; None = the profile's block_size")
    reserve_full_isl: bool = Field(
        True,
        description=(
            "admit a waiting request only if KV for its whole input (prompt + generated) fits, "
            "not just its first chunk (vLLM 0.32 scheduler_reserve_full_isl, default on)"
        ),
    )


@dataclass
class SimStep:
    """What one step did (for tests and traces)."""

    start: float
    dt: float
    batch: list[tuple[int, int]]
    """(request id, tokens scheduled) in scan order."""
    preempted: list[int]
    decodes: int
    prefill_tokens: int


@dataclass
class InstanceSimResult:
    """Per-request outcomes (in submission order) and run counters."""

    ordering: str
    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    ttft: np.ndarray
    e2e: np.ndarray
    preemptions: np.ndarray
    recomputed: np.ndarray
    rejected: int
    steps: int
    busy_s: float
    makespan_s: float
    forced_evictions: int
    evictions_for_waiting: int
    evictions_for_running: int
    trace: list[tuple[float, float, float]] = field(default_factory=list)
    """(time, γ, τ) at each re-key check of a tail-aware ordering."""
    counters: dict[str, float] = field(default_factory=dict)
    """The ordering's own counters (promotions, valve evictions, final γ, ...)."""

    def summary(self) -> dict[str, float]:
        ok = np.isfinite(self.e2e)
        e2e, ttft = self.e2e[ok], self.ttft[ok]
        done = int(ok.sum())
        tokens = float(self.prompt[ok].sum() + self.output[ok].sum())
        tbt = (e2e - ttft)[self.output[ok] > 1] / (self.output[ok][self.output[ok] > 1] - 1)
        out: dict[str, float] = {
            "completed": float(done),
            "e2e_mean": float(e2e.mean()) if done else math.nan,
            "ttft_mean": float(ttft.mean()) if done else math.nan,
            "tbt_mean": float(tbt.mean()) if len(tbt) else math.nan,
            "preemptions": float(self.preemptions.sum()),
            "recomputed_tokens": float(self.recomputed.sum()),
            "forced_evictions": float(self.forced_evictions),
            "tok_per_s": tokens / self.makespan_s if self.makespan_s > 0 else math.nan,
            "req_per_s": done / self.makespan_s if self.makespan_s > 0 else math.nan,
        }
        for p in (50, 90, 95, 99):
            out[f"e2e_p{p}"] = float(np.percentile(e2e, p)) if done else math.nan
            out[f"ttft_p{p}"] = float(np.percentile(ttft, p)) if done else math.nan
        return out

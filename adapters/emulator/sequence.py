"""What the engine schedules and reports: sequences, token sinks and the step log's records."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class TokenSink(Protocol):
    """Where a streaming sequence's tokens go: formatted before the deadline, written at it."""

    def prepare(self, index: int, finish_reason: str | None, step: int, deadline: float) -> None: ...

    def release(self) -> None: ...

    def close(self) -> None:
        """The sequence finished (any reason); nothing more will be released."""


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine."""

    id: str
    prompt_tokens: int
    max_tokens: int
    """Tokens to generate before finishing (already drawn when ignore_eos is off)."""
    stop_early: bool = False
    """True when it ends before the client's max_tokens (finish_reason "stop")."""
    priority: int = 0
    arrival: float = 0.0
    """`time.monotonic()` when the request arrived (set by the HTTP layer)."""
    prefill_only: bool = False
    """P leg of P/D: finish after the first token."""
    hold_kv: bool = False
    """Keep the blocks allocated after finishing (until pulled or expired)."""
    external_tokens: int = 0
    """Prompt tokens whose KV was pulled from a prefill instance (not computed here)."""
    max_tokens_param: int = 0
    """The max_tokens the client asked for (for vllm:request_params_max_tokens)."""
    sink: TokenSink | None = None
    generated: int = 0
    computed: int = 0
    """Tokens whose KV is in this instance's cache."""
    prefilling: bool = True
    blocks: int = 0
    order: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    prev_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    local_prefill_tokens: int = 0
    """Tokens prefilled here, recomputation after preemption included."""
    finish_reason: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    in_running: bool = False
    in_waiting: bool = False
    frozen: bool = False
    """Being migrated away: not scheduled until it leaves or the migration is given up."""
    resumed: bool = False
    """Migrated in from another instance (its latencies began there)."""
    handoff: bytes | None = None
    """Migrated away: the JSON the last event of its stream carries (where it went)."""
    dp_rank: int = -1
    """The data-parallel rank it runs on in a DP group (asked with X-data-parallel-rank; -1: any)."""
    prompt_ids: list[int] | None = None
    """The prompt's token ids; None: no prefix caching for it (the engine counts blocks only)."""
    output_base: int = 0
    """Token id of its generated token 0 (generated token i is output_base + i)."""
    keys: list[int] = field(default_factory=list)
    """Block keys (core.cache.keys) of its full blocks so far, prompt then output."""
    kv_id: int = -1
    """Its allocation in the instance's block pool (-1: none yet)."""
    kv_full: int = 0
    """Full blocks of it the pool has cached (prefix_cache.py)."""
    cached_tokens: int = -1
    """Prompt tokens found in the local prefix cache when first admitted (-1: never looked up)."""
    lora: str | None = None
    """The LoRA adapter it runs under (the request's `model` named it; None: the base model)."""
    lora_int_id: int = 0
    """The adapter's id on this instance (vLLM's lora_int_id; 0: none), which its KV events carry."""
    lora_pinned: bool = False
    """Its adapter is pinned in the instance's adapter cache (from its first admission until it finishes)."""

    def __post_init__(self) -> None:
        if self.external_tokens:
            # vLLM loads the KV of the prompt and recomputes its last token to sample the first.
            self.computed = self.prompt_tokens - 1
            self.prefilling = False

    @property
    def context(self) -> int:
        """Tokens that exist: the prompt plus what was generated."""
        return self.prompt_tokens + self.generated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def done_reason(self) -> str:
        """The finish_reason once its last token is out: "stop" for a drawn early end, else "length"."""
        return "stop" if self.stop_early and not self.prefill_only else "length"


STEP_LOG = 2048
"""Steps an instance keeps for GET /admin/steps (about a minute of a busy instance; each record
is ~320 bytes, so 20,000 of them were most of a decode emulator's RSS growth in a 30-minute soak)."""


@dataclass(slots=True)
class StepRecord:
    """What one engine step did; the benchmark recomputes its duration from the profile."""

    n: int
    start: float
    end: float
    batch: int
    kv_tokens: int
    tokens: int
    """Tokens computed in the step (prefill chunks plus one per decoding sequence)."""
    chunks: list[tuple[int, int]]
    """Prefill chunks as (from token, to token)."""
    sampled: int
    slowdown: float
    start_kind: str
    """"chain" (at the previous deadline), "idle" (work arrived) or "slip" (a step behind)."""
    woke: float = 0.0
    """When the engine woke up for the deadline (sleep lateness = woke - end)."""
    released: float = 0.0
    """When the step's tokens were all written (write lag = released - end)."""


class Scheduler(Protocol):
    """What the HTTP layer, metrics and admin API need from an instance's scheduler.

    `engine.Engine` (vLLM-style continuous batching) is the emulator's; `adapters.sim_cluster`
    serves the simulator's instance model through the same surface.
    """

    clock: Callable[[], float]
    block_size: int
    total_blocks: int
    steps: deque[StepRecord]
    on_step: Callable[[StepRecord, list[Sequence]], None] | None
    on_finish: Callable[[Sequence], None] | None
    on_preempt: Callable[[Sequence], None] | None
    flush: Callable[[list[TokenSink]], None]

    @property
    def held_blocks(self) -> int: ...

    @property
    def running(self) -> list[Sequence]: ...

    @property
    def preemptions(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    @property
    def step_no(self) -> int: ...

    @property
    def max_num_seqs(self) -> int | None:
        """Running slots (None: unbounded)."""

    @property
    def max_num_batched_tokens(self) -> int | None:
        """Per-step token budget (None: no chunking)."""

    @property
    def kv_usage(self) -> float: ...

    def submit(self, s: Sequence) -> None: ...

    def abort(self, s: Sequence) -> None: ...

    def release_held(self, blocks: int) -> None: ...

    def kick(self) -> None: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

"""What a cluster simulation is given besides its trace (scheduled policy swaps) and what it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from core.sim.cluster.migration import MigrationEvent
from core.sim.cluster.scaling import ScaleEvent
from core.types import PolicyKind

Mode = Literal["ps", "iteration"]
"""Decode model: processor sharing (SIBYL App. I) or iteration-level continuous batching."""

FAIL_REASONS = {
    "shed": "shed at arrival: the admission queue was full",
    "expired": "expired in the admission queue (ttl_s)",
    "kv_capacity": "not served: exceeds decode KV capacity",
    "no_capacity": "no routable instance of a needed role",
    "unfinished": "still in flight when the simulation ended",
}
"""Status of a failed request → what happened to it."""


@dataclass(frozen=True)
class ScheduledSwap:
    """A policy swap the simulation applies at a given virtual time."""

    time: float
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    kind: PolicyKind = PolicyKind.ROUTING


@dataclass
class ClusterSimResult:
    """Per-request timelines (arrays indexed like the trace) and run-level facts."""

    arrival: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    prefill_instance: np.ndarray
    """Position in `prefill_ids` (-1: never routed)."""
    decode_instance: np.ndarray
    """Position in `decode_ids` (-1: never bound)."""
    prefill_start: np.ndarray
    prefill_end: np.ndarray
    decode_start: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    ok: np.ndarray
    instance_ids: list[str]
    """Every instance of the run, in the dispatcher's index order."""
    events: int
    preemptions: int
    assignment_ratio: float
    shadow_ratios: dict[str, float]
    policy_events: list[Any]
    status: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=object))
    """Per request: "ok" or a key of FAIL_REASONS."""
    prefill_ids: list[str] = field(default_factory=list)
    """Instances that served prefill at some point (flipped ones appear in both lists)."""
    decode_ids: list[str] = field(default_factory=list)
    scale_events: list[ScaleEvent] = field(default_factory=list)
    """Every executed (or refused) scale action step, in time order."""
    queued: int = 0
    """Requests that were held by admission at least once."""
    migrations_proposed: int = 0
    """Migrations proposed by the reschedule policy."""
    migrations: int = 0
    """Migrations carried out (KV transferred, request resumed on its target)."""
    migrations_refused: dict[str, int] = field(default_factory=dict)
    """Proposed migrations not carried out, per reason (see core.sim.cluster.migration.REFUSALS)."""
    migrated_tokens: int = 0
    """KV tokens moved by the migrations carried out."""
    migration_events: list[MigrationEvent] = field(default_factory=list)
    """Every accepted, started, finished, refused or cancelled migration, in time order."""
    request_migrations: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per request: how many times it migrated."""
    cached_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per request: prompt tokens found cached where its prefill ran (on its decode instance
    when it was served there alone), so not computed; zeros when the cache is not modelled."""
    decode_cached_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per request: prompt tokens its decode instance already held (not pulled)."""
    kv_transferred_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per request: KV tokens pulled from its prefill instance to its decode instance."""
    cache_hit_rates: dict[str, float] = field(default_factory=dict)
    """Per instance id: prompt tokens found cached / looked up (empty: cache not modelled)."""
    cache_lookups: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per instance id: (prompt tokens looked up, found cached)."""
    cache_block_size: int = 0
    """Tokens per KV block of the modelled cache (0: not modelled)."""
    lora_loads: int = 0
    """LoRA adapter loads over every instance (core/sim/cluster/lora.py; 0: no adapters)."""
    lora_hits: int = 0
    """Admissions that found their adapter held (or loading) on the instance."""
    lora_evictions: int = 0
    """Adapters evicted (least recently used) to make room for a load."""

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate of the prefill side: cached / prompt tokens over requests whose
        prefill ran (decode-only ones on their decode instance)."""
        started = ~np.isnan(self.prefill_start)
        total = int(self.prompt_tokens[started].sum())
        return float(self.cached_tokens[started].sum()) / total if total else 0.0

    @property
    def shed(self) -> int:
        return int(np.count_nonzero(self.status == "shed"))

    @property
    def expired(self) -> int:
        return int(np.count_nonzero(self.status == "expired"))

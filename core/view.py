"""The read-only cluster view a policy decides on: instances, the request table, the estimators."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from core.cache.index import PrefixLookup
from core.estimators import DecodeRateEstimator, PrefillTimeEstimator, SurvivalEstimator
from core.lora import LoraResidency
from core.perf import PerfProfile
from core.prefill import PrefillQueues
from core.request_table import RUNNING, RequestTable
from core.slo import DEFAULT_SLO, SLOClass
from core.types import InstancePhase, Request, Role

PHASES: tuple[InstancePhase, ...] = tuple(InstancePhase)
"""Phase codes as stored in `ClusterView.phase` (index into this tuple)."""
ACTIVE_CODE = PHASES.index(InstancePhase.ACTIVE)


def phase_code(phase: InstancePhase) -> int:
    return PHASES.index(phase)


def _bools() -> np.ndarray:
    return np.zeros(0, dtype=bool)


def _floats() -> np.ndarray:
    return np.zeros(0)


def _ints() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


class DecisionNotes(Protocol):
    """Where policies note what they saw while a sampled decision is taken (core/decision_records.py's `Explain`,
    which `note` fills and the dispatcher turns into records): stage → the choice noted."""

    choices: dict[str, Any]


@dataclass
class ClusterView:
    """What policies see. The dispatcher owns and updates it in place; policies must not mutate it."""

    profile: PerfProfile
    table: RequestTable
    survival: SurvivalEstimator
    prefill_time: PrefillTimeEstimator
    decode_rate: DecodeRateEstimator
    now: float = 0.0
    instance_ids: list[str] = field(default_factory=list)
    """Every instance ever added, by index; an index is never reused."""
    roles: list[Role] = field(default_factory=list)
    serves_prefill: np.ndarray = field(default_factory=_bools)
    serves_decode: np.ndarray = field(default_factory=_bools)
    healthy: np.ndarray = field(default_factory=_bools)
    phase: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))
    """InstancePhase code per index (see PHASES); only ACTIVE instances are routable."""
    prefill_free_at: np.ndarray = field(default_factory=_floats)
    """When each prefill instance is projected to have finished what was routed to it and may start
    its next step: the drain time of `prefill_queues`' batching-aware projection (the same array)."""
    kv_usage: np.ndarray = field(default_factory=_floats)
    """Observed KV usage in [0, 1] per index (live polling); NaN when never observed."""
    waiting_obs: np.ndarray = field(default_factory=_ints)
    """Observed engine-side waiting requests per index (live polling); 0 when unknown."""
    waiting_obs_at: np.ndarray = field(default_factory=_floats)
    """When each `waiting_obs` was reported (inf: unknown, taken as reported now)."""
    running_n: np.ndarray = field(default_factory=_ints)
    """Running (decoding) requests per instance index, kept incrementally by the dispatcher."""
    pending_n: np.ndarray = field(default_factory=_ints)
    """Requests bound to each decode instance that have not started decoding yet."""
    prefill_n: np.ndarray = field(default_factory=_ints)
    """Requests routed to each prefill instance whose prefill has not ended yet."""
    slo: dict[str, SLOClass] = field(default_factory=lambda: {"default": DEFAULT_SLO})
    """The SLO classes requests name (`default` always present)."""
    index: dict[str, int] = field(default_factory=dict)
    """Instance id → index (the dispatcher keeps it)."""
    prefix: PrefixLookup | None = None
    """Every instance's prefix cache as far as it is known (exact in the simulator, approximate
    from routing decisions or precise from KV events live); None: unknown, nothing counts as
    cached. Read it through `cached_tokens`."""
    block_size: int = 16
    """Tokens per KV block of the keys in `Request.prefix_keys` and of `prefix`."""
    decode_only: bool = False
    """Whether a request may be served by a decode instance alone (Assignment.prefill None): the
    simulator models it; a live console sets it when its backend forwards such requests."""
    lora: LoraResidency | None = None
    """Which LoRA adapters each instance holds or is loading (core/lora.py), kept by whoever runs the
    instances (the console from its load calls and `vllm:lora_requests_info`); None: unknown
    (adapter-aware routing then routes as its wrapped policy does)."""
    explain: DecisionNotes | None = None
    """Set by the dispatcher while a sampled decision is taken: policies `note` what they saw into it."""
    prefill_queues: PrefillQueues | None = None
    """The dispatcher's projection of each prefill instance's steps (core/prefill.py); made with the
    view. Read it through `first_token_at`."""
    _masks: dict[Role, np.ndarray] = field(default_factory=dict)
    _n_routable: dict[Role, int] = field(default_factory=dict)
    _where: dict[Role, list[int]] = field(default_factory=dict)
    _cached: tuple[Request, float, np.ndarray] | None = None
    queues: PrefillQueues = field(init=False, repr=False, compare=False)
    """`prefill_queues`, never None once the view is made (an attribute, not a property: the dispatcher
    reads it several times a request)."""

    def __post_init__(self) -> None:
        if self.prefill_queues is None:
            self.prefill_queues = PrefillQueues(self.profile, self.prefill_time)
            self.prefill_queues.view = self
            for _ in range(len(self.prefill_free_at)):
                self.prefill_queues.add_instance()
            self.prefill_queues.free_at[:] = self.prefill_free_at
            self.prefill_free_at = self.prefill_queues.free_at
        self.queues = self.prefill_queues

    def first_token_at(self, tokens: float | np.ndarray) -> np.ndarray:
        """Per instance index: when a prompt of `tokens` uncached tokens (one number, or one per
        instance) routed now would get its first token there, batched with what is projected there
        as vLLM's scheduler batches (core/prefill.py). Meaningful on prefill instances only."""
        return self.queues.first_token_at(tokens, self.now, self.prefill_free_at)

    def first_token_at_one(self, p: int, tokens: float) -> float:
        """`first_token_at` on instance p alone."""
        return self.queues.first_token_at_one(p, tokens, self.now, float(self.prefill_free_at[p]))

    def cached_tokens(self, request: Request) -> np.ndarray:
        """Prompt tokens each instance (by index) would find cached for `request`: its matched
        leading blocks × block size, capped as vLLM caps a hit (whole blocks of at most
        prompt − 1 tokens). Zeros without a prefix view or keys. Remembered for the request and
        `now` until `forget_cached` (the dispatcher calls it after each decision); read-only."""
        n = self.n_instances
        keys = request.prefix_keys
        if self.prefix is None or not keys:
            return np.zeros(n)
        memo = self._cached
        if memo is not None and memo[0] is request and memo[1] == self.now and len(memo[2]) == n:
            return memo[2]
        bs = self.block_size
        cap = max(request.prompt_tokens - 1, 0) // bs
        out = np.zeros(n)
        matched = self.prefix.match(keys[:cap] if cap < len(keys) else keys, self.now)
        if matched:
            # one vectorised store (64 scalar stores into the array cost ~18 µs at 64 instances)
            get = self.index.get
            pos = [get(str(iid), -1) for iid in matched]
            depth = list(matched.values())
            if -1 in pos:
                depth = [m for i, m in zip(pos, depth, strict=True) if i >= 0]
                pos = [i for i in pos if i >= 0]
            out[pos] = np.minimum(depth, cap) * bs
        self._cached = (request, self.now, out)
        return out

    def forget_cached(self) -> None:
        """Drop the remembered `cached_tokens` (the caches may change before the next decision)."""
        self._cached = None

    def invalidate(self) -> None:
        """Forget cached masks after instances are added, removed, flipped or change health."""
        self._masks.clear()
        self._n_routable.clear()
        self._where.clear()

    def narrowed(self, prefill: np.ndarray, decode: np.ndarray) -> ClusterView:
        """A shallow copy whose routable prefill and decode instances are only those of the boolean
        masks given (and routable here): what a wrapping policy hands the policy it wraps. Every
        array is shared (policies must not mutate the view); only the masks differ."""
        v = copy.copy(self)
        v._masks = {Role.PREFILL: prefill & self.prefill_mask(), Role.DECODE: decode & self.decode_mask()}
        v._n_routable = {}
        v._where = {}
        return v

    def routable_count(self, role: Role) -> int:
        """How many instances are routable for `role` (cached like the masks)."""
        n = self._n_routable.get(role)
        if n is None:
            n = self._n_routable[role] = int(np.count_nonzero(self.routable(role)))
        return n

    def routable_indices(self, role: Role) -> list[int]:
        """The instance indices `routable(role)` holds, ascending (cached like the masks; read-only)."""
        where = self._where.get(role)
        if where is None:
            where = self._where[role] = np.flatnonzero(self.routable(role)).tolist()
        return where

    def routable(self, role: Role) -> np.ndarray:
        """Boolean mask over instance indices that are ACTIVE, healthy and serve `role`."""
        mask = self._masks.get(role)
        if mask is None:
            serves = self.serves_decode if role == Role.DECODE else self.serves_prefill
            mask = self._masks[role] = serves & self.healthy & (self.phase == ACTIVE_CODE)
        return mask

    def decode_mask(self) -> np.ndarray:
        return self.routable(Role.DECODE)

    def prefill_mask(self) -> np.ndarray:
        return self.routable(Role.PREFILL)

    def phase_of(self, i: int) -> InstancePhase:
        return PHASES[int(self.phase[i])]

    @property
    def n_instances(self) -> int:
        return len(self.instance_ids)

    def running_counts(self) -> np.ndarray:
        return self.running_n

    def pending_counts(self) -> np.ndarray:
        return self.pending_n

    def in_flight(self) -> np.ndarray:
        """Per index: requests in prefill on it, plus pending and running on it as decode."""
        out: np.ndarray = self.prefill_n + self.pending_n + self.running_n
        return out

    def physical_load(self) -> np.ndarray:
        """KV tokens (prompt + generated so far) of running requests, per instance index."""
        t = self.table
        n = t.n
        run = t.state[:n] == RUNNING
        tokens = t.l_in[:n] + t.generated_at(self.now)
        return np.bincount(t.inst[:n][run], weights=tokens[run], minlength=self.n_instances)

    def decode_tokens(self) -> np.ndarray:
        """KV tokens per instance index of requests bound to it as decode: running ones (prompt +
        generated so far) plus pending ones (their prompt, about to arrive)."""
        t = self.table
        n = t.n
        bound = t.inst[:n] >= 0
        tokens = t.l_in[:n] + np.where(t.state[:n] == RUNNING, t.generated_at(self.now), 0.0)
        return np.bincount(t.inst[:n][bound], weights=tokens[bound], minlength=self.n_instances)

    def handoff_s(self, prompt_tokens: float, d: int = -1, busy_step_s: float | None = None) -> float:
        """Seconds from a prompt's first token on its prefill instance to the client's, on decode
        instance `d` (else the soonest routable one): the KV read and the decode step that makes
        the token, after the step a busy decode instance makes it wait for. vLLM 0.32's NIXL pull
        starts when the decode engine's step under way ends and the sequence joins at the step
        boundary after the read ends (adapters/emulator/kv_legs.py), about half a step each: so
        on a busy instance two of its steps (`busy_step_s`, a measured decode step, else the
        profile's at its running count), on an idle one the read and one step of the prompt. Plus
        the HTTP legs of the hand-off (three round trips, as the simulator counts them)."""
        p = self.profile
        fixed = p.kv_transfer_time(prompt_tokens) + 3 * p.http_rtt_s
        if d >= 0:
            n = int(self.running_n[d])
        else:
            mask = self.decode_mask()
            n = int(self.running_n[mask].min()) if mask.any() else 0
        if n <= 0:
            return float(fixed + p.step_time(1, prompt_tokens))
        step = busy_step_s if busy_step_s else p.step_time(n, n * p.ps_context_tokens)
        return float(fixed + 2 * step)

    def kv_estimate(self) -> np.ndarray:
        """KV usage per index: observed when polled, else physical load / KV capacity (at most 1,
        like the engine's gauge: the processor-sharing model does not bound resident KV)."""
        est = np.minimum(self.physical_load() / float(self.profile.kv_capacity_tokens), 1.0)
        return np.where(np.isnan(self.kv_usage), est, self.kv_usage)

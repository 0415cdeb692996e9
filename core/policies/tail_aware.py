"""Queue policy tail_aware: release held requests in γ-Boost order, Φ = arrival − b_γ(τ·ŵ).

The gateway ("outside-engine") form of UniBoost, shared/design/papers/tail-aware.md §4 items 3–4:
while the cluster is saturated, admission holds requests and this policy releases the one with
the lowest Φ = a − b_γ(τ·floor_bin(prompt tokens)) first (§2.2 boost, §2.6 bins, §2.3 units; no
prefix-cache estimate, ĥ = 0). The boost is bounded (b_max = b_γ(τ·k)), so a request held longer
than b_max is never overtaken by a later arrival (§2.2 "no starvation"), and aging is implicit.

γ is adapted online (γ-Ada, §2.7) from end-to-end latencies the dispatcher reports through
`observe_completion`; τ (seconds per token of the serving pool, the "server" of this queue) is
`tau_s` if given, else measured from completions observed while requests are held (tokens
completed per second under saturation), starting from `tau_prior_s`. Keys are recomputed when γ
is updated. What this form cannot do (§4): decay the boost with decode progress, reorder running
requests, preempt, or hold MemGuard leases; those need the engine plugin (core/sim/instance models it).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable

from pydantic import Field

from core.policies.base import QueueParams, QueuePolicyBase
from core.policies.gamma import GammaAda, GammaAdaParams, boost, quantize
from core.policies.registry import register
from core.types import PolicyKind, Request


class TailAwareQueueParams(QueueParams, GammaAdaParams):
    """Admission limits plus the γ-Boost / γ-Ada parameters (spec §2.6–2.7 defaults)."""

    tau_s: float | None = Field(
        None,
        gt=0,
        description=(
            "seconds per token of the serving pool (1 / tokens per second at saturation); "
            "None = measured from completions observed while requests are held"
        ),
    )
    tau_prior_s: float = Field(
        5e-4, gt=0, description="τ until it is measured (2,000 tokens/s, the spec's §2.3 example)"
    )
    tau_window: int = Field(200, ge=2, description="completions observed while holding that the τ estimate uses")


@register(
    PolicyKind.QUEUE,
    "tail_aware",
    TailAwareQueueParams,
    "gamma-Boost: lowest arrival - boost(prompt tokens) first, gamma adapted from E2E tails",
)
class TailAwareQueue(QueuePolicyBase):
    """Held requests released lowest Φ first (ties: arrival, then push order).

    Call `observe_completion(request, e2e_s, output_tokens)` for every finished request so γ
    (and τ) adapt; without it the policy keeps its initial γ (u_k = u_init). Depth is reported
    per SLO class.
    """

    params: TailAwareQueueParams
    sets_engine_priority = True

    def __init__(self, params: TailAwareQueueParams) -> None:
        super().__init__(params)
        self._ada = GammaAda(params)
        self._held: dict[Hashable, tuple[Request, int, float]] = {}
        """Held request id → (request, push sequence, Φ)."""
        self._heap: list[tuple[float, float, int, Hashable]] = []
        self._seq = 0
        self._done: deque[tuple[float, int]] = deque(maxlen=params.tau_window)
        """(completion time, prompt + output tokens) of completions observed while holding."""
        self.tau = params.tau_s or params.tau_prior_s
        """τ (s/token) the current keys use."""
        self.gamma = self._ada.gamma(self.tau)
        """γ (1/s) the current keys use."""

    # --- Φ -----------------------------------------------------------------------------------
    def phi(self, request: Request) -> float:
        """Φ = arrival − b_γ(τ·ŵ), ŵ = k·2^⌊log2(max(1, prompt/k))⌋ (seconds; lower first)."""
        w_hat = quantize(float(request.prompt_tokens), self.params.bin_tokens)
        return request.arrival - boost(self.tau * w_hat, self.gamma)

    def order_key(self, request: Request) -> dict[str, float]:
        """What orders a held request (decision records): Φ, lowest first."""
        return {"phi": self.phi(request)}

    @property
    def max_boost_s(self) -> float:
        """b_max = b_γ(τ·k): a request held longer than this is never overtaken."""
        return boost(self.tau * self.params.bin_tokens, self.gamma)

    def _rekey(self) -> None:
        held = {rid: (r, seq, self.phi(r)) for rid, (r, seq, _) in self._held.items()}
        self._held = held
        self._heap = [(phi, r.arrival, seq, rid) for rid, (r, seq, phi) in held.items()]
        heapq.heapify(self._heap)

    # --- the QueuePolicy protocol ------------------------------------------------------------
    def push(self, request: Request, now: float) -> None:
        self.remove(request.id)
        self._seq += 1
        phi = self.phi(request)
        self._held[request.id] = (request, self._seq, phi)
        heapq.heappush(self._heap, (phi, request.arrival, self._seq, request.id))

    def pop(self, now: float) -> Request | None:
        heap = self._heap
        while heap:
            _, _, seq, rid = heapq.heappop(heap)
            entry = self._held.get(rid)
            if entry is not None and entry[1] == seq:
                del self._held[rid]
                return entry[0]
        return None

    def remove(self, request_id: str | int) -> Request | None:
        entry = self._held.pop(request_id, None)
        return None if entry is None else entry[0]

    def __len__(self) -> int:
        return len(self._held)

    def items(self) -> list[Request]:
        order = sorted(self._held.values(), key=lambda e: (e[2], e[0].arrival, e[1]))
        return [e[0] for e in order]

    def depth_by_class(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r, _, _ in self._held.values():
            out[r.slo_class] = out.get(r.slo_class, 0) + 1
        return out

    def engine_priority(self, request: Request) -> int:
        """Φ in milliseconds, for vLLM's `priority` (lower first): the engine's waiting queue then
        follows the same order as this one (it still cannot reorder running requests)."""
        return round(self.phi(request) * 1000)

    # --- learning from completions -----------------------------------------------------------
    def measured_tau(self) -> float | None:
        """Seconds per token from completions observed while holding, or None (too few)."""
        if len(self._done) < 2:
            return None
        first = min(self._done)
        span = max(t for t, _ in self._done) - first[0]
        tokens = sum(n for _, n in self._done) - first[1]  # work done after the first one
        if span <= 0 or tokens <= 0:
            return None
        return span / tokens

    def observe_completion(self, request: Request, e2e_s: float, output_tokens: int) -> None:
        """A request finished `e2e_s` seconds after its arrival with `output_tokens` tokens.

        Feeds γ-Ada (and τ while requests are held); when γ is updated every held request is
        re-keyed with the new γ and τ.
        """
        t = request.arrival + e2e_s
        if self._held:
            self._done.append((t, request.prompt_tokens + output_tokens))
        self._ada.observe(t, e2e_s)
        tau = self.params.tau_s or self.measured_tau() or self.params.tau_prior_s
        if self._ada.update(t, tau):
            self.tau, self.gamma = tau, self._ada.gamma(tau)
            self._rekey()

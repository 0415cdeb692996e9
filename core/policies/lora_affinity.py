"""Adapter-aware routing wrapped around any routing policy: instances holding the request's LoRA adapter
first within a load bound, past it a less busy instance with the adapter's load time counted."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import Field

from core.decision_records import annotate, note
from core.errors import NoCapacityError, PolicyError
from core.lora import Tier
from core.policies import registry
from core.policies.base import PolicyParams, QueuePolicy, RoutingPolicy, RoutingPolicyBase
from core.policies.choice import RotatingArgmin
from core.types import Assignment, PolicyKind, Request, Role
from core.view import ClusterView

AFFINITY, SPILL, SATURATED = "affinity", "spill", "saturated"
"""How one side (prefill or decode) was narrowed: to holders within the bound; to every instance that
can take the adapter (load time counted); not at all (every slot everywhere is in use)."""


class LoraAffinityParams(PolicyParams):
    """The wrapped policy decides among the candidates this policy leaves it."""

    routing: str = Field(
        "least_load",
        description="the routing policy wrapped (any: least_load, sibyl, prefix_aware, ...); it chooses "
        "among the instances this policy leaves it, and base-model requests are its alone",
    )
    routing_params: dict[str, Any] = Field(
        default_factory=dict, description="params of the wrapped policy (its own defaults when empty)"
    )
    epsilon: float = Field(
        0.5,
        ge=0,
        description=(
            "load bound (consistent hashing with bounded loads, as session_affinity; Ray Serve's "
            "rule): an instance holding the adapter is preferred while its requests in flight of "
            "that role (in prefill; pending + running on decode), counting this one, stay within "
            "(1 + epsilon) × the mean over routable instances of the role. Past the bound on every "
            "holder, the request goes where its estimated TTFT counting the adapter's load is least"
        ),
    )

    min_bound: int = Field(
        4,
        ge=1,
        description=(
            "the load bound is never below this many requests in flight of the role, counting this "
            "one, so a lightly loaded holder is not passed over (a miss costs a whole adapter load)"
        ),
    )


@registry.register(
    PolicyKind.ROUTING,
    "lora_affinity",
    LoraAffinityParams,
    "LoRA requests to instances holding their adapter within a load bound (both legs), past it "
    "where the estimated TTFT counting the adapter's load is least; wraps any routing policy, "
    "which decides among those candidates and alone for base-model requests",
)
class LoraAffinity(RoutingPolicyBase):
    """Residency comes from `view.lora` (core/lora.py). For a request naming an adapter, each leg's
    candidates are narrowed in tiers (llm-d's residency tiers, Ray Serve's multiplexing rule):

    1. *affinity*: routable instances holding (or loading) the adapter whose load is within the
       bound (at least `min_bound`); the wrapped policy chooses among them.
    2. *spill* (no holder within the bound): every routable instance that can take the adapter (held,
       or a slot free or held by an idle adapter, which the load evicts least recently used first).
       The prefill instance is the one with the least estimated TTFT = queued work + seconds until
       the adapter is usable there + prefill of the uncached tokens; the wrapped policy chooses the
       decode instance among the decode side's candidates.
    3. *saturated* (every slot of every instance is in use): no narrowing.

    The projected handoff adds the wait for the adapter on the prefill instance, and is no earlier
    than the adapter is usable on the decode instance (its load runs during the prefill). Without a
    residency view or for a base-model request, the wrapped policy routes alone."""

    params: LoraAffinityParams

    def __init__(self, params: LoraAffinityParams) -> None:
        super().__init__(params)
        if params.routing == self.name:
            raise PolicyError("lora_affinity cannot wrap itself")
        if registry.spec(PolicyKind.ROUTING, params.routing).sim_only:
            raise PolicyError(f"lora_affinity cannot wrap {params.routing!r}: it knows true output lengths")
        self.inner: RoutingPolicy = registry.build(PolicyKind.ROUTING, params.routing, params.routing_params)
        self.bind_at = self.inner.bind_at
        self.needs_progress = self.inner.needs_progress
        self.reads_prefix = self.inner.reads_prefix
        self._argmin = RotatingArgmin()

    # --- the narrowing ---------------------------------------------------------------------------
    def _side(
        self, view: ClusterView, role: Role, load: np.ndarray, tiers: np.ndarray, wait: np.ndarray
    ) -> tuple[np.ndarray, str, int]:
        """One leg's candidates, how they were chosen, and the load bound."""
        mask = view.routable(role)
        n = view.routable_count(role)
        if n == 0:
            return mask, SATURATED, 0
        mean = (float(load[mask].sum()) + 1.0) / n
        bound = max(math.ceil((1.0 + self.params.epsilon) * mean - 1e-9), self.params.min_bound)
        holders = mask & (tiers <= Tier.LOADING)
        within = holders & (load + 1 <= bound)
        if within.any():
            return within, AFFINITY, bound
        placeable = mask & np.isfinite(wait)
        if placeable.any():
            return placeable, SPILL, bound
        return mask, SATURATED, bound

    def _spill_prefill(self, request: Request, view: ClusterView, cand: np.ndarray, wait: np.ndarray) -> int:
        """The spill tier's prefill choice: least estimated TTFT with the adapter's wait counted."""
        return self._argmin(_ttft_with_load(request, view, wait), cand)

    def route(self, request: Request, view: ClusterView) -> Assignment:
        adapter, lora = request.lora, view.lora
        if not adapter or lora is None:
            return self.inner.route(request, view)
        if view.routable_count(Role.PREFILL) == 0:
            raise NoCapacityError("no healthy prefill instance")
        ids = view.instance_ids
        now, load_s = view.now, view.profile.lora_load_s
        tiers = lora.tiers(adapter, ids, now)
        wait = lora.wait_s(adapter, ids, now, load_s)
        p_cand, p_mode, p_bound = self._side(view, Role.PREFILL, view.prefill_n, tiers, wait)
        d_load = view.pending_n + view.running_n
        d_cand, d_mode, d_bound = self._side(view, Role.DECODE, d_load, tiers, wait)
        p_spill = -1
        if p_mode == SPILL:
            p_spill = self._spill_prefill(request, view, p_cand, wait)
            p_cand = np.zeros_like(p_cand)
            p_cand[p_spill] = True
        a = self.inner.route(request, view.narrowed(p_cand, d_cand))
        if view.explain is not None:
            self._record(request, view, a, p_spill, (p_mode, p_bound), (d_mode, d_bound), tiers, wait)
        return Assignment(a.prefill, a.decode, self._handoff(view, a, wait))

    def _handoff(self, view: ClusterView, a: Assignment, wait: np.ndarray) -> float:
        """The wrapped policy's τ, later by the wait for the adapter on the prefill instance and no
        earlier than it is usable on the decode instance."""
        tau = a.projected_handoff
        index = view.index
        if a.prefill is not None:
            w = float(wait[index[a.prefill]])
            if math.isfinite(w):  # inf: every slot in use; how long until one frees is unknown
                tau += w
        if a.decode is not None:
            w = float(wait[index[a.decode]])
            if math.isfinite(w):
                tau = max(tau, view.now + w)
        return tau

    def _record(
        self,
        request: Request,
        view: ClusterView,
        a: Assignment,
        p_spill: int,
        prefill: tuple[str, int],
        decode: tuple[str, int],
        tiers: np.ndarray,
        wait: np.ndarray,
    ) -> None:
        """Decision records: the spill tier's own prefill scores, and on both legs each candidate's
        residency (tier code, see core.lora.Tier; seconds until the adapter is usable there)."""
        if p_spill >= 0:
            mask = view.prefill_mask() & np.isfinite(wait)
            ttft = _ttft_with_load(request, view, wait)
            note(view, "prefill", self.name, "est_ttft_with_lora_load_s", ttft, mask, p_spill)
        features = {"lora_tier": tiers.astype(float), "lora_wait_s": wait.copy()}
        for stage, (mode, bound) in (("prefill", prefill), ("decode", decode)):
            info: dict[str, float | str] = {"lora": str(request.lora), "lora_tier": mode, "lora_load_bound": bound}
            annotate(view, stage, info, **features)

    # --- late binding and composition -------------------------------------------------------------
    def _decode_view(self, request: Request, view: ClusterView) -> ClusterView:
        adapter, lora = request.lora, view.lora
        if not adapter or lora is None:
            return view
        ids = view.instance_ids
        tiers = lora.tiers(adapter, ids, view.now)
        wait = lora.wait_s(adapter, ids, view.now, view.profile.lora_load_s)
        d_cand, _, _ = self._side(view, Role.DECODE, view.pending_n + view.running_n, tiers, wait)
        return view.narrowed(view.prefill_mask(), d_cand)

    def choose_decode(self, request: Request, view: ClusterView) -> int:
        return self.inner.choose_decode(request, self._decode_view(request, view))

    def choose_decode_at(self, request: Request, view: ClusterView, tau: float) -> int:
        narrowed = self._decode_view(request, view)
        inner = self.inner
        if isinstance(inner, RoutingPolicyBase):
            return inner.choose_decode_at(request, narrowed, tau)
        d = inner.route(request, narrowed).decode
        return view.index[d] if d is not None else inner.choose_decode(request, narrowed)

    def decode_loads(self, request: Request, view: ClusterView, tau: float) -> np.ndarray:
        inner = self.inner
        if isinstance(inner, RoutingPolicyBase):
            return inner.decode_loads(request, view, tau)
        return inner.display_load(view)

    def display_load(self, view: ClusterView) -> np.ndarray:
        return self.inner.display_load(view)

    def assign_targets(self, request: Request, view: ClusterView, queue: QueuePolicy) -> None:
        self.inner.assign_targets(request, view, queue)

    def observe_completion(self, request: Request, ttft_s: float, tpot_s: float, queue_s: float) -> None:
        self.inner.observe_completion(request, ttft_s, tpot_s, queue_s)

    def close(self) -> None:
        self.inner.close()


def _ttft_with_load(request: Request, view: ClusterView, wait: np.ndarray) -> np.ndarray:
    """Per instance index: seconds until the request's first token there, its uncached tokens batched
    with the prompts projected there (view.first_token_at, as prefix_aware estimates), plus the wait
    for its adapter there (the load stalls the engine, so it adds to everything queued)."""
    cached = view.cached_tokens(request)
    first = view.first_token_at(np.maximum(request.prompt_tokens - cached, 1.0))
    out: np.ndarray = first - view.now + wait
    return out

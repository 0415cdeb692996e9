"""Prefill by cache, decode by load: the shared part of routing policies that choose the prefill instance
themselves and take the decode choice of another policy."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import Field

from core.decision_records import note
from core.errors import NoCapacityError, PolicyError
from core.policies import registry
from core.policies.base import PolicyParams, QueuePolicy, RoutingPolicy, RoutingPolicyBase
from core.types import PolicyKind, Request, Role
from core.view import ClusterView


class ComposedParams(PolicyParams):
    """Params of a policy whose decode choice is another routing policy's."""

    decode: str = Field(
        "sibyl",
        description=(
            "the routing policy whose decode choice is used (sibyl, least_load, round_robin, ...); "
            "its binding time (bind_at) and dashboard load are this policy's too"
        ),
    )
    decode_params: dict[str, Any] = Field(
        default_factory=dict, description="params of the decode policy (its own defaults when empty)"
    )


def build_decode_policy(name: str, params: dict[str, Any], allow_sim_only: bool = False) -> RoutingPolicy:
    """Build the routing policy a composed policy takes its decode choice from."""
    if registry.spec(PolicyKind.ROUTING, name).sim_only and not allow_sim_only:
        raise PolicyError(
            f"decode policy {name!r} knows true output lengths (simulator only); "
            "only a simulator-only policy (oracle) may compose it"
        )
    policy: RoutingPolicy = registry.build(PolicyKind.ROUTING, name, params)
    return policy


class ComposedRouting(RoutingPolicyBase):
    """A routing policy that picks the prefill side itself and delegates the decode side."""

    params: ComposedParams
    allow_sim_only_decode = False

    def __init__(self, params: ComposedParams) -> None:
        super().__init__(params)
        self.decoder = build_decode_policy(params.decode, params.decode_params, self.allow_sim_only_decode)
        self.bind_at = self.decoder.bind_at
        self.needs_progress = self.decoder.needs_progress

    def decode_at(self, request: Request, view: ClusterView, tau: float) -> int | None:
        """The decode policy's choice for a request whose KV lands at `tau`; None when it binds late."""
        dec = self.decoder
        if dec.bind_at == "prefill_end":
            return None
        if isinstance(dec, RoutingPolicyBase):
            return dec.choose_decode_at(request, view, tau)
        d = dec.route(request, view).decode  # a plugin policy outside the base: its own decision
        return view.index[d] if d is not None else None

    def decode_loads(self, request: Request, view: ClusterView, tau: float) -> np.ndarray:
        dec = self.decoder
        if isinstance(dec, RoutingPolicyBase):
            return dec.decode_loads(request, view, tau)
        return dec.display_load(view)

    def choose_decode(self, request: Request, view: ClusterView) -> int:
        return self.decoder.choose_decode(request, view)

    def display_load(self, view: ClusterView) -> np.ndarray:
        return self.decoder.display_load(view)

    def assign_targets(self, request: Request, view: ClusterView, queue: QueuePolicy) -> None:
        self.decoder.assign_targets(request, view, queue)

    def observe_completion(self, request: Request, ttft_s: float, tpot_s: float, queue_s: float) -> None:
        self.decoder.observe_completion(request, ttft_s, tpot_s, queue_s)

    def close(self) -> None:
        self.decoder.close()


def prefill_ttft(request: Request, view: ClusterView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per instance index (inf where not a routable prefill instance): estimated seconds until
    this request's first token would come out there — its uncached tokens batched with the prompts
    projected there, as the engine batches them (view.first_token_at) — the queued work alone
    (prefill_free_at − now, the projected drain), and the cached tokens."""
    mask = view.prefill_mask()
    if view.routable_count(Role.PREFILL) == 0:
        raise NoCapacityError("no healthy prefill instance")
    queued = np.where(mask, np.maximum(view.prefill_free_at - view.now, 0.0), np.inf)
    cached = view.cached_tokens(request)
    first = view.first_token_at(np.maximum(request.prompt_tokens - cached, 1.0))
    return np.where(mask, first - view.now, np.inf), queued, cached


def guarded_argmin(
    ttft: np.ndarray, queued: np.ndarray, balance_s: float | None, argmin: Any, view: ClusterView | None = None
) -> int:
    """The least `ttft` among instances whose queued work is within `balance_s` of the least
    queued one (the load guard against herding onto a hot instance; None: no guard); noted as the
    prefill choice of `view`'s decision when it is recorded."""
    ok = np.isfinite(queued)
    if balance_s is not None:
        low = queued[queued.argmin()]  # the least finite one, unless a NaN or nothing finite is at the bottom
        if not math.isfinite(low):
            low = queued[ok].min()  # (raises when nothing is finite)
        ok &= queued <= low + balance_s
    p = int(argmin(ttft, ok))
    if view is not None and view.explain is not None:
        note(
            view,
            "prefill",
            "guarded_ttft",
            "est_ttft_s",
            ttft,
            ok,
            p,
            {"balance_s": "none" if balance_s is None else balance_s},
        )
    return p

"""Helpers shared by routing policies: the prefill choice, the handoff projection, tie-breaking argmin."""

from __future__ import annotations

import numpy as np

from core.decision_records import note
from core.errors import NoCapacityError
from core.types import Request, Role
from core.view import ClusterView


def least_queued_prefill(request: Request, view: ClusterView) -> tuple[int, float]:
    """The healthy prefill instance where this request's first token would come out soonest,
    batched with the prompts projected there as the engine batches them (core/prefill.py), the
    least queued of those where it ties, and when."""
    mask = view.prefill_mask()
    count = view.routable_count(Role.PREFILL)
    if count == 0:
        raise NoCapacityError("no healthy prefill instance")
    if view.explain is None:
        if count == 1:
            p = int(mask.argmax())
            return p, view.first_token_at_one(p, request.prompt_tokens)
        soonest = view.queues.soonest(request.prompt_tokens, view.now, view.prefill_free_at, mask)
        if soonest is not None:  # no step to join anywhere: the instance that frees up first
            return soonest
    first = np.where(mask, view.first_token_at(request.prompt_tokens), np.inf)
    p = int(first.argmin())
    ties = first <= first[p]
    if np.count_nonzero(ties) > 1:  # the same first token on several (a free join): the least queued
        p = int(np.where(ties, np.maximum(view.prefill_free_at, view.now), np.inf).argmin())
    if view.explain is not None:
        note(view, "prefill", "least_queued_prefill", "first_token_in_s", first - view.now, mask, p)
    return p, float(first[p])


def projected_handoff(request: Request, prefill_end: float, view: ClusterView) -> float:
    """τ: when decoding would start — prefill end plus the KV transfer of the prompt."""
    return prefill_end + view.profile.kv_transfer_time(request.prompt_tokens)


def decode_candidates(view: ClusterView) -> np.ndarray:
    if view.routable_count(Role.DECODE) == 0:
        raise NoCapacityError("no healthy decode instance")
    return view.decode_mask()


def sole_candidate(view: ClusterView) -> int | None:
    """The only routable decode instance, or None when there is a choice to make (scoring one
    candidate decides nothing, so a policy may skip it)."""
    return int(view.decode_mask().argmax()) if view.routable_count(Role.DECODE) == 1 else None


class RotatingArgmin:
    """argmin over a masked array whose ties are broken round-robin (no herding onto index 0)."""

    def __init__(self) -> None:
        self.cursor = 0

    def __call__(self, values: np.ndarray, mask: np.ndarray, tol: float = 1e-9) -> int:
        v = np.where(mask, values, np.inf)
        # v[argmin] is v.min() (NaN first, as min) at a sixth of the call overhead on small arrays.
        best = v[v.argmin()]
        ties = (v <= best + tol * max(1.0, abs(best))).nonzero()[0]
        self.cursor += 1
        return int(ties[self.cursor % len(ties)])

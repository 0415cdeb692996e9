"""Joint prefix-aware P/D choice: prefill by estimated TTFT, decode by another policy tie-broken by the blocks each
decode instance lacks, and a decode-only decider."""

from __future__ import annotations

import numpy as np
from pydantic import Field

from core.decision_records import note
from core.policies.choice import RotatingArgmin, decode_candidates
from core.policies.compose import guarded_argmin, prefill_ttft
from core.policies.prefix_aware import PrefixAware, PrefixAwareParams
from core.policies.registry import register
from core.types import Assignment, PolicyKind, Request
from core.view import ClusterView


class PrefixPDParams(PrefixAwareParams):
    decode_slack: float = Field(
        0.5,
        ge=0,
        description=(
            "decode instances the decode policy ranks within this much of its best (in its own "
            "load unit: requests for sibyl's and least_load's defaults) are equally good to it; "
            "among them the one whose pull (KV transfer of the blocks it lacks) is shortest wins, "
            "then the decode policy's load. 0: a pure tie-break"
        ),
    )
    decode_only_min_share: float = Field(
        0.9,
        ge=0,
        description=(
            "serve a request on its decode instance alone (no prefill leg) when that instance "
            "already holds at least this share of the prompt (llm-d's prefix-based P/D decider); "
            "only where the world allows it (view.decode_only); above 1: never"
        ),
    )


@register(
    PolicyKind.ROUTING,
    "prefix_pd",
    PrefixPDParams,
    "prefix_aware, plus a decode choice that prefers (within decode_slack of the decode policy's "
    "best) the instance pulling the fewest missing blocks, and decode-only service when the "
    "decode instance holds decode_only_min_share of the prompt",
)
class PrefixPD(PrefixAware):
    """Decode choice: let L be the decode policy's ranking (`decode_loads` at τ) over routable
    decode instances; candidates are those with L ≤ min L + decode_slack; among them the least
    missing tokens (prompt − cached there: the shortest pull, as kv_transfer_time grows with
    them), ties by L, then round robin. With a
    late-binding decode policy the same rule runs at the handoff (τ = now)."""

    reads_prefix = True

    params: PrefixPDParams

    def __init__(self, params: PrefixPDParams) -> None:
        super().__init__(params)
        self._dargmin = RotatingArgmin()

    def pick_decode(self, request: Request, view: ClusterView, tau: float) -> int:
        mask = decode_candidates(view)
        load = np.asarray(self.decode_loads(request, view, tau), dtype=float)
        best = float(np.min(np.where(mask, load, np.inf)))
        near = mask & (load <= best + self.params.decode_slack + 1e-9)
        # Fewest missing tokens first (the pull's seconds, kv_transfer_time, grow with them), then
        # the decode policy's load: scaled into [0, 0.5), below one token of difference.
        missing = request.prompt_tokens - view.cached_tokens(request)
        span = float(np.ptp(np.where(near, load, best))) or 1.0
        score = missing + 0.5 * (load - best) / span
        d = int(self._dargmin(score, near, tol=1e-12))
        note(view, "decode", self.name, "missing_tokens+load", score, near, d, decode_load=load, missing_tokens=missing)
        return d

    def choose_decode(self, request: Request, view: ClusterView) -> int:
        return self.pick_decode(request, view, view.now)

    def route(self, request: Request, view: ClusterView) -> Assignment:
        ids = view.instance_ids
        prm = self.params
        if view.decode_only and prm.decode_only_min_share <= 1.0 and request.prefix_keys:
            d = self.pick_decode(request, view, view.now)
            cached = float(view.cached_tokens(request)[d])
            if cached >= prm.decode_only_min_share * request.prompt_tokens:
                tau = view.now + float(view.prefill_time(max(request.prompt_tokens - int(cached), 1)))
                return Assignment(None, ids[d], tau)
        ttft, queued, _ = prefill_ttft(request, view)
        p = guarded_argmin(ttft, queued, prm.balance_s, self._argmin, view)
        tau = view.now + float(ttft[p]) + view.profile.kv_transfer_time(request.prompt_tokens)
        if self.decoder.bind_at == "prefill_end":
            return Assignment(ids[p], None, tau)
        return Assignment(ids[p], ids[self.pick_decode(request, view, tau)], tau)

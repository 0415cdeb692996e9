"""Prefix-aware prefill choice: the least estimated TTFT (queued work + uncached prefill) under a load guard;
decode by another policy."""

from __future__ import annotations

from pydantic import Field

from core.policies.choice import RotatingArgmin
from core.policies.compose import ComposedParams, ComposedRouting, guarded_argmin, prefill_ttft
from core.policies.registry import register
from core.types import Assignment, PolicyKind, Request, Role
from core.view import ClusterView


class PrefixAwareParams(ComposedParams):
    balance_s: float | None = Field(
        2.0,
        ge=0,
        description=(
            "load guard: only prefill instances whose queued work is within this many seconds of "
            "the least queued one are candidates, so a hot prefix cannot herd every request onto "
            "one instance (as SGLang's cache_aware balance thresholds); None: no guard"
        ),
    )


@register(
    PolicyKind.ROUTING,
    "prefix_aware",
    PrefixAwareParams,
    "prefill where the estimated TTFT (queued work + uncached prefill) is least, within a load "
    "guard; decode by another routing policy (default sibyl)",
)
class PrefixAware(ComposedRouting):
    """Estimated TTFT on prefill instance p: when the first token of its prompt − cached on p would
    come out there, batched with the prompts projected there (view.first_token_at, core/prefill.py),
    the cached tokens read from the view's prefix lookup (exact in the simulator, approximate or
    precise live). Without a prefix lookup it is the soonest first token of the same prompt
    everywhere, i.e. the baselines' prefill choice."""

    reads_prefix = True

    params: PrefixAwareParams

    def __init__(self, params: PrefixAwareParams) -> None:
        super().__init__(params)
        self._argmin = RotatingArgmin()

    def route(self, request: Request, view: ClusterView) -> Assignment:
        if view.explain is None and view.routable_count(Role.PREFILL) == 1:
            # one candidate decides nothing: its estimate alone (the same arithmetic as prefill_ttft's)
            p = int(view.prefill_mask().argmax())
            self._argmin.cursor += 1  # as the scoring path's argmin would (ties later rotate alike)
            cached = float(view.cached_tokens(request)[p]) if request.prefix_keys else 0.0
            ttft_p = view.first_token_at_one(p, max(request.prompt_tokens - cached, 1.0)) - view.now
        else:
            ttft, queued_all, _ = prefill_ttft(request, view)
            p = guarded_argmin(ttft, queued_all, self.params.balance_s, self._argmin, view)
            ttft_p = float(ttft[p])
        tau = view.now + ttft_p + view.profile.kv_transfer_time(request.prompt_tokens)
        d = self.decode_at(request, view, tau)
        ids = view.instance_ids
        return Assignment(ids[p], None if d is None else ids[d], tau)

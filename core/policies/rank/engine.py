"""Rank policy `engine`: send no rank and leave the choice to the DP group's own balancer (vLLM's default)."""

from __future__ import annotations

from core.policies.base import NoParams
from core.policies.rank.base import RankPolicyBase
from core.policies.rank.state import DPState
from core.policies.registry import register
from core.types import PolicyKind


@register(
    PolicyKind.RANK,
    "engine",
    NoParams,
    "baseline: no rank sent; the DP group's own balancer places the request (vLLM's default)",
)
class EngineBalancer(RankPolicyBase):
    """No rank: the dispatcher builds no rank state and sends no `X-data-parallel-rank`."""

    acts = False

    def choose(self, state: DPState, prompt_tokens: int) -> int | None:
        return None

"""Rank policy `jsq`, join the shortest queue: each request, oldest first, to the least loaded rank with a free
slot (tie: lowest index)."""

from __future__ import annotations

import heapq
from typing import Literal

from pydantic import Field

from core.policies.rank.base import AssigningRankPolicy, DPParams
from core.policies.rank.state import DPState, Pairs, Waiting, fillable
from core.policies.registry import register
from core.types import PolicyKind


class JsqParams(DPParams):
    """Join-shortest-queue: each request, oldest first, to the least loaded rank with a free slot."""

    by: Literal["tokens", "requests"] = Field(
        "tokens",
        description=(
            "tokens: least resident KV tokens (the authors' JSQ, Table 1); requests: fewest "
            "running requests (vLLM's DP balancer with a central pool)"
        ),
    )


@register(
    PolicyKind.RANK,
    "jsq",
    JsqParams,
    "join the shortest queue: the rank with the fewest resident KV tokens (or requests)",
)
class JsqRank(AssigningRankPolicy):
    """JSQ: the oldest n_k requests in order, each to the least loaded rank with a free slot (tie: lowest index)."""

    params: JsqParams

    def __init__(self, params: JsqParams | None = None) -> None:
        super().__init__(params or JsqParams())

    def assign(self, state: DPState, waiting: Waiting) -> Pairs:
        n = fillable(state, waiting)
        by_tokens = self.params.by == "tokens"
        key = (state.loads if by_tokens else state.running).tolist()
        free = state.free.tolist()
        heap = [(key[g], g) for g in range(state.ranks) if free[g] > 0]
        heapq.heapify(heap)
        sizes = waiting.sizes.tolist()
        out: Pairs = []
        for i in range(n):
            k, g = heapq.heappop(heap)
            out.append((i, g))
            free[g] -= 1
            if free[g] > 0:
                heapq.heappush(heap, (k + (sizes[i] if by_tokens else 1), g))
        return out

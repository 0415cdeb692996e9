"""Rank policy `fcfs`, BF-IO's FCFS baseline (paper App. B, Alg. 2): ranks in index order, each filled from the
head of the pool."""

from __future__ import annotations

import numpy as np

from core.policies.rank.base import AssigningRankPolicy, DPParams
from core.policies.rank.state import DPState, Pairs, Waiting, fillable
from core.policies.registry import register
from core.types import PolicyKind


class FcfsParams(DPParams):
    """FCFS takes no parameters."""


@register(
    PolicyKind.RANK, "fcfs", FcfsParams, "BF-IO's FCFS baseline: the first rank (in index order) with a free slot"
)
class FcfsRank(AssigningRankPolicy):
    """The oldest n_k requests, in order, to the free slots of the ranks in index order."""

    def __init__(self, params: FcfsParams | None = None) -> None:
        super().__init__(params or FcfsParams())

    def assign(self, state: DPState, waiting: Waiting) -> Pairs:
        n = fillable(state, waiting)
        ranks = np.repeat(np.arange(state.ranks), state.free)[:n]
        return list(zip(range(n), ranks.tolist(), strict=True))

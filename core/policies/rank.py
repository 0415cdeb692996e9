"""Rank policies (kind `rank`): which data-parallel rank of a decode instance a request runs on.

A decode instance may be a data-parallel group of G ranks that step together, each step as long
as its most loaded rank's (BF-IO, shared/design/papers/bf-io.md). Live, the rank is chosen when a
request's decode leg is sent (vLLM's `X-data-parallel-rank` header), from the dispatcher's own
record of what each rank holds: a one-request admission round of the same policies the DP
simulator runs (core/sim/dp/assign.py), so `fcfs`, `jsq` and `bf_io` decide here as they do there.
`engine` sends no rank and leaves the choice to the group's own balancer (vLLM's default).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from core.policies.base import NoParams, PolicyBase, PolicyParams
from core.policies.registry import register
from core.sim.dp.assign import (
    BfIo,
    BfIoParams,
    DPAssignPolicy,
    FcfsAssign,
    FcfsParams,
    Jsq,
    JsqParams,
)
from core.sim.dp.model import DPState, Waiting
from core.types import PolicyKind


class RankPolicyBase(PolicyBase, ABC):
    """Chooses a rank for one request about to decode on a DP group; None: let the group choose."""

    kind: ClassVar[PolicyKind] = PolicyKind.RANK
    acts: bool = True
    """False for `engine`: the dispatcher then builds no rank state at all."""
    needs_requests: bool = False
    """Whether `choose` needs the resident requests' sizes and predicted remaining steps."""

    @abstractmethod
    def choose(self, state: DPState, prompt_tokens: int) -> int | None:
        """The rank for a request of `prompt_tokens` on a group in `state`; None: the group decides."""


class _Assigning(RankPolicyBase):
    """A core/sim/dp/assign policy asked about a pool of one request."""

    policy: DPAssignPolicy

    def __init__(self, params: PolicyParams) -> None:
        super().__init__(params)

    def choose(self, state: DPState, prompt_tokens: int) -> int | None:
        pairs = self.policy.assign(state, Waiting(np.array([max(1, prompt_tokens)])))
        if pairs:
            return pairs[0][1]
        # every rank's slots are taken: the request waits in a rank's queue; take the lightest
        return int(np.argmin(state.loads))


@register(
    PolicyKind.RANK,
    "engine",
    NoParams,
    "baseline: no rank sent; the DP group's own balancer places the request (vLLM's default)",
)
class EngineBalancer(RankPolicyBase):
    acts = False

    def choose(self, state: DPState, prompt_tokens: int) -> int | None:
        return None


@register(
    PolicyKind.RANK, "fcfs", FcfsParams, "BF-IO's FCFS baseline: the first rank (in index order) with a free slot"
)
class FcfsRank(_Assigning):
    def __init__(self, params: FcfsParams) -> None:
        super().__init__(params)
        self.policy = FcfsAssign(params)


@register(
    PolicyKind.RANK,
    "jsq",
    JsqParams,
    "join the shortest queue: the rank with the fewest resident KV tokens (or requests)",
)
class JsqRank(_Assigning):
    def __init__(self, params: JsqParams) -> None:
        super().__init__(params)
        self.policy = Jsq(params)


@register(
    PolicyKind.RANK,
    "bf_io",
    BfIoParams,
    "BF-IO: the rank where the request raises the predicted straggler load least over the next H steps",
)
class BfIoRank(_Assigning):
    def __init__(self, params: BfIoParams) -> None:
        super().__init__(params)
        self.policy = BfIo(params)
        self.needs_requests = params.horizon > 0


def dp_state(ranks: int, slots: int, rank_of: np.ndarray, size: np.ndarray, remaining: np.ndarray | None) -> DPState:
    """The snapshot a rank policy decides on, from the requests resident on one group (a rank
    holding more than its slots, the rest queued by the group, simply has none free)."""
    return DPState.from_requests(ranks, max(slots, 1), rank_of, size, remaining, overfull=True)

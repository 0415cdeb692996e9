"""The rank policy's two faces: a whole admission round (what the DP simulator asks) and one request (what the
dispatcher asks live), with the params base and the protocol the simulator drives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import numpy as np

from core.policies.base import PolicyBase, PolicyParams
from core.policies.rank.state import DPState, Pairs, Waiting
from core.types import PolicyKind


class DPParams(PolicyParams):
    """Base of the rank policies' params (the DP simulator's exact oracle uses it too)."""


class DPAssignPolicy(Protocol):
    """Chooses ranks (and, for some, which requests) for one admission round; pure, no I/O."""

    name: str

    @property
    def params(self) -> DPParams: ...

    @property
    def needs_requests(self) -> bool:
        """Whether the snapshot must carry the resident requests (lookahead), not just counters."""
        ...

    def assign(self, state: DPState, waiting: Waiting) -> Pairs:
        """`[(waiting index, rank), ...]`, admitting exactly n_k = min(|W|, Σ free) requests into free slots."""
        ...


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


class AssigningRankPolicy(RankPolicyBase):
    """A rank policy that decides whole admission rounds; live, one request is a round of one."""

    params: DPParams

    @abstractmethod
    def assign(self, state: DPState, waiting: Waiting) -> Pairs:
        """`[(waiting index, rank), ...]`, admitting exactly n_k = min(|W|, Σ free) requests into free slots."""

    def choose(self, state: DPState, prompt_tokens: int) -> int | None:
        pairs = self.assign(state, Waiting(np.array([max(1, prompt_tokens)])))
        if pairs:
            return pairs[0][1]
        # every rank's slots are taken: the request waits in a rank's queue; take the lightest
        return int(np.argmin(state.loads))

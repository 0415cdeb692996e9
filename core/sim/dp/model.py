"""A data-parallel decode group: barrier step time and imbalance/idle/energy metrics (its snapshots and the
IO cost, which the rank policies decide on, are core/policies/rank/state.py).

Model (shared/design/papers/bf-io.md §2): G ranks of B slots; a request resident on rank g
weighs w_i = s_i + gen_i KV tokens and grows by one token per step; rank load L_g = Σ w_i. Every
step waits for the slowest rank: Δt = C + t_tok · max_g L_g on the loads the step starts with.
Imbalance Imb = G·max_g L_g − Σ_g L_g (tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAPER_T_TOK_S = 1.5 * 2 * 576 * 61e-6 / 2**20
"""Seconds per resident KV token per step in the authors' simulator (≈1.005e-7 s)."""


def paper_overhead_s(slots: int) -> float:
    """C of the authors' simulator: (0.6 ms·B + 35 ms)/16 (4.89 ms at B = 72)."""
    return (0.6e-3 * slots + 35e-3) / 16


@dataclass(frozen=True)
class DPGroup:
    """One DP decode group: `ranks` ranks of `slots` slots; each step waits for the most loaded rank."""

    ranks: int
    slots: int
    overhead_s: float
    """C: the fixed synchronisation/communication time of a step."""
    t_tok_s: float
    """Time per resident KV token on a rank per step."""

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.slots < 1:
            raise ValueError(f"a DP group needs ranks >= 1 and slots >= 1, got {self.ranks}, {self.slots}")
        if self.overhead_s < 0 or self.t_tok_s < 0:
            raise ValueError("step-time constants must be non-negative")

    @classmethod
    def paper(cls, ranks: int = 16, slots: int = 72) -> DPGroup:
        """The authors' setting: C = (0.6 ms·B + 35 ms)/16, t_tok = 1.5·2·576·61·1e-6/2^20 s."""
        return cls(ranks, slots, paper_overhead_s(slots), PAPER_T_TOK_S)

    def step_time(self, loads: np.ndarray) -> float:
        """Δt = C + t_tok · max_g L_g, on the loads the step starts with (before they grow)."""
        top = float(np.max(loads)) if len(loads) else 0.0
        return self.overhead_s + self.t_tok_s * top


def imbalance(loads: np.ndarray) -> float:
    """Imb = G·max_g L_g − Σ_g L_g = Σ_g (max − L_g): tokens the other ranks could have processed."""
    loads = np.asarray(loads, dtype=np.float64)
    return float(len(loads) * loads.max() - loads.sum()) if len(loads) else 0.0


def idle_fraction(loads: np.ndarray) -> float:
    """mean_g (1 − L_g / max L) = Imb / (G · max L): the share of the step the ranks wait (0 if empty)."""
    loads = np.asarray(loads, dtype=np.float64)
    top = loads.max() if len(loads) else 0.0
    return float(np.mean(1.0 - loads / top)) if top > 0 else 0.0


@dataclass(frozen=True)
class PowerModel:
    """P(u) = P_idle + (P_max − P_idle)·u^γ per rank, with u = L_g / max L (the authors' code).

    The paper defines u/u_sat from MFU; the released code substitutes each rank's busy share of the
    step, so the straggler draws P_max and a rank with nothing resident draws P_idle.
    """

    idle_w: float = 100.0
    max_w: float = 400.0
    gamma: float = 0.7

    def rank_power_w(self, loads: np.ndarray) -> np.ndarray:
        loads = np.asarray(loads, dtype=np.float64)
        top = loads.max() if len(loads) else 0.0
        if top <= 0:
            return np.full(len(loads), self.idle_w)
        u = np.clip(loads / top, 0.0, 1.0)
        return self.idle_w + (self.max_w - self.idle_w) * u**self.gamma

    def step_energy_j(self, loads: np.ndarray, dt: float) -> float:
        """Σ_g P_g · Δt for one step."""
        return float(self.rank_power_w(loads).sum() * dt)

"""γ-Boost building blocks of the tail-aware ordering (shared/design/papers/tail-aware.md, "the
spec"): the boost function b_γ, MemGuard binning, predicted lengths, the engine's seconds per token
τ, and γ-Ada, the online estimate of γ from completed requests' E2E tail. The live `tail_aware` queue
policy (tail_aware.py) and the instance simulator's tail-aware ordering (core/sim/instance/orderings.py) use them.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.perf import PerfProfile

LN5 = math.log(5.0)
"""Eq. 9 numerator: ln F̄(t95) − ln F̄(t99) = ln(0.05/0.01) (spec §2.7)."""
LN_99_95 = math.log(99.0 / 95.0)
"""Algorithm 1 UPDATEGAMMA's numerator ln 99 − ln 95 (a CDF ratio; spec §2.7 inconsistency)."""


# --- γ-Boost building blocks --------------------------------------------------------------


def boost(x: float, gamma: float) -> float:
    """b_γ(x) = (1/γ)·ln(1/(1 − e^{−γx})), spec §2.2 (paper Eq. 2); +inf at x ≤ 0."""
    if x <= 0:
        return math.inf
    u = gamma * x
    if u < math.log(2.0):
        return -math.log(-math.expm1(-u)) / gamma
    return -math.log1p(-math.exp(-u)) / gamma


def quantize(w: float, k: int) -> int:
    """MemGuard bin ŵ = k·2^⌊log2(max(1, w/k))⌋ (spec §2.6, floor reading of Algorithm 1):
    k=256: w < 512 → 256, 512–1023 → 512, 1024–2047 → 1024, 10,000 → 8192."""
    m = int(w // k)
    if m < 2:
        return k
    return k << (m.bit_length() - 1)


def predicted_length(rid: int, true_len: int, sigma: float, seed: int) -> int:
    """Log-normal predictor L̂ = max(1, round(L·e^{σZ})) with Z from (seed, rid); σ=0 → L."""
    if sigma <= 0:
        return int(true_len)
    z = float(np.random.default_rng([seed, rid]).standard_normal())
    return max(1, round(true_len * math.exp(sigma * z)))


def profile_tau(profile: PerfProfile) -> float:
    """Offline τ prior (s/token): a full decode step at max_num_seqs with the profile's assumed
    context, per token (spec §2.3: "or an offline profile at saturation")."""
    m = profile.max_num_seqs
    return profile.step_time(m, m * profile.ps_context_tokens) / m


class GammaAdaParams(BaseModel):
    """γ-Boost and γ-Ada parameters shared by the instance ordering and the gateway queue policy.

    Values not given by the paper are the spec's §2.7 proposals [G]; k = 256 is the paper's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bin_tokens: int = Field(256, ge=1, description="MemGuard bin size k in tokens (paper default 256; spec §2.6)")
    adapt_gamma: bool = Field(True, description="adapt γ online from E2E tails (γ-Ada, spec §2.7); False keeps u_init")
    gamma_numerator: float = Field(
        LN5,
        gt=0,
        description="numerator of γ̂ = num/(t99 − t95): ln 5 per Eq. 9 (Algorithm 1: ln(99/95))",
    )
    window_samples: int = Field(1000, ge=2, description="γ-Ada window: last completions kept")
    window_s: float = Field(120.0, gt=0, description="γ-Ada window: completions of the last s")
    update_every: int = Field(100, ge=1, description="completions between two γ updates")
    update_min_interval_s: float = Field(
        5.0, ge=0, description="seconds between two γ updates (the later of the two triggers)"
    )
    min_samples: int = Field(200, ge=2, description="E2E samples needed for a γ update")
    beta: float = Field(0.2, gt=0, le=1, description="EMA weight of a new γ estimate")
    epsilon_s: float = Field(0.01, gt=0, description="floor on t99 − t95 (seconds)")
    u_min: float = Field(0.01, gt=0, description="lower clip of u_k = γ·τ·k (0.01 ≈ LAS-like, Fig. 3)")
    u_max: float = Field(100.0, gt=0, description="upper clip of u_k = γ·τ·k (> 5 ≈ FCFS)")
    u_init: float = Field(1.0, gt=0, description="initial u_k = γ·τ·k before the first update")

    @model_validator(mode="after")
    def _check_bounds(self) -> GammaAdaParams:
        if not self.u_min <= self.u_init <= self.u_max:
            raise ValueError("need u_min <= u_init <= u_max")
        return self


class GammaAda:
    """γ-Ada (spec §2.7): γ̂ = num / max(t99 − t95, ε) over recent E2E samples, EMA with β,
    clipped so that u_k = γ·τ·k stays in [u_min, u_max]."""

    def __init__(self, params: GammaAdaParams) -> None:
        self.p = params
        self._samples: deque[tuple[float, float]] = deque(maxlen=params.window_samples)
        self._since = 0
        self._last_update = -math.inf
        self._gamma: float | None = None
        self.updates = 0

    def bounds(self, tau: float) -> tuple[float, float]:
        tk = tau * self.p.bin_tokens
        return self.p.u_min / tk, self.p.u_max / tk

    def gamma(self, tau: float) -> float:
        """Current γ (1/s) for engine seconds-per-token τ."""
        lo, hi = self.bounds(tau)
        if self._gamma is None:
            return self.p.u_init / (tau * self.p.bin_tokens)
        return min(max(self._gamma, lo), hi)

    def observe(self, t: float, e2e: float) -> None:
        """One completed request: finished at `t`, end-to-end latency `e2e` seconds."""
        self._samples.append((t, e2e))
        self._since += 1

    def window(self, now: float) -> list[float]:
        lo = now - self.p.window_s
        return [e for t, e in self._samples if t >= lo]

    def update(self, now: float, tau: float) -> bool:
        """Update γ if due (≥ update_every completions and ≥ update_min_interval_s since the
        last update, ≥ min_samples in the window); True if it changed."""
        p = self.p
        if not p.adapt_gamma or self._since < p.update_every:
            return False
        if now - self._last_update < p.update_min_interval_s:
            return False
        xs = self.window(now)
        if len(xs) < p.min_samples:
            return False
        x95, x99 = np.percentile(np.asarray(xs), [95.0, 99.0])
        g_hat = p.gamma_numerator / max(float(x99 - x95), p.epsilon_s)
        g = (1 - p.beta) * self.gamma(tau) + p.beta * g_hat
        lo, hi = self.bounds(tau)
        self._gamma = min(max(g, lo), hi)
        self._since = 0
        self._last_update = now
        self.updates += 1
        return True

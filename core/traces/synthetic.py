"""Synthetic workloads matched to SIBYL's datasets: Random, ShareGPT and Zeta with reasoning."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from core.errors import TraceError
from core.traces.arrivals import gamma_arrivals
from core.traces.model import Trace

# Lengths come from fixed distributions whose parameters were fitted offline (exactly, by summing
# the survival function of the continuous law over the integer support, with SciPy, which is not
# a dependency of this package) so that the *final integer* lengths have the target moments:
#
#     length = clip(ceil(X), lo, hi)
#
# ``reasoning-chat`` — SIBYL §5 "ShareGPT with reasoning (out mean 5657, σ≈3317, cap 8192,
# prompt mean 183)" on Qwen3-32B with reasoning on:
#
# * output: X ~ Gamma(shape 0.393161, scale 90815.4), clipped to [1, 8192].
#   Target mean 5657 / std 3317 → achieved (exact) 5657.0 / 3317.0; 57.3 % of outputs sit at
#   the 8192 cap. The std is larger than a uniform law on [0, 8192] has (2365), so any law that
#   matches it is U-shaped: many short answers plus a big atom at the cap. A gamma with shape < 1
#   is the two-parameter law that gives exactly that (lognormal and Weibull fits also put 57-58 %
#   at the cap).
# * prompt: X ~ LogNormal(mu 4.747845, sigma 1.0), clipped to [4, 1024]. Target mean 183 →
#   achieved 183.0 (std 195.4; 1.5 % clipped at 1024). [G] sigma = 1.0 and the [4, 1024] range
#   are our choices: the paper gives only the mean, and `vllm bench serve`'s default ShareGPT
#   pruning drops prompts shorter than 4 or longer than 1024 tokens.
#
# ``reasoning-code`` — SIBYL §5 "Zeta code edits (prompt mean 345, up to 1.7k; out heavy, often
# capped)". The paper gives no output moments, so [G] we target output mean 6500 and std 2600:
# heavier than ShareGPT's 5657 (the paper calls Zeta outputs "heavy" and its Zeta runs show the
# largest TPOT gains, e.g. −78 % P99 vs ILS in the 64-decode simulation), "often capped" (about
# 60 % at 8192), and with a lighter short tail than chat (a code edit always needs some
# reasoning: p10 ≈ 1.8k tokens vs 0.2k for chat).
#
# * output: X ~ Gamma(shape 0.989695, scale 17360.8), clipped to [1, 8192]. Target mean 6500 /
#   std 2600 → achieved (exact) 6500.0 / 2600.0; 61.9 % at the cap.
# * prompt: X ~ LogNormal(mu 5.663656, sigma 0.6), clipped to [1, 1700]. Target mean 345 →
#   achieved 345.0 (std 223.0). [G] sigma = 0.6 puts the unclipped p99.85 at 1.7k, so "up to
#   1.7k" holds naturally and only 0.16 % of prompts hit the 1700 clip.
#
# ``random`` — SIBYL's Random dataset: prompt ~ U{1..512}, output ~ U{1..8192}.
#
# Arrivals: gamma inter-arrival gaps with shape = burstiness (1.0 = Poisson) at ``rate`` req/s;
# the first request arrives at 0.0 (see :mod:`core.traces.arrivals`). Lengths and arrivals use
# independent random streams derived from ``seed``, so changing ``rate`` or ``burstiness`` keeps
# the same lengths.

WORKLOADS = ("random", "reasoning-chat", "reasoning-code")

OUTPUT_CAP = 8192
"""SIBYL's max output tokens (max_tokens) for the reasoning datasets."""


@dataclass(frozen=True)
class _Gamma:
    shape: float
    scale: float
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.gamma(self.shape, self.scale, size=n)
        return np.clip(np.ceil(x), self.lo, self.hi).astype(np.int64)


@dataclass(frozen=True)
class _LogNormal:
    mu: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.lognormal(self.mu, self.sigma, size=n)
        return np.clip(np.ceil(x), self.lo, self.hi).astype(np.int64)


@dataclass(frozen=True)
class _Uniform:
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.lo, self.hi, size=n, endpoint=True, dtype=np.int64)


_Law: TypeAlias = _Gamma | _LogNormal | _Uniform

# (prompt law, output law). Targets and achieved moments are in the module docstring.
_LAWS: dict[str, tuple[_Law, _Law]] = {
    "random": (_Uniform(1, 512), _Uniform(1, OUTPUT_CAP)),
    # prompt mean 183 (achieved 183.0); output mean 5657 / std 3317 (achieved 5657.0 / 3317.0)
    "reasoning-chat": (
        _LogNormal(mu=4.747845, sigma=1.0, lo=4, hi=1024),
        _Gamma(shape=0.393161, scale=90815.4, lo=1, hi=OUTPUT_CAP),
    ),
    # prompt mean 345 (achieved 345.0); output mean 6500 / std 2600 (achieved 6500.0 / 2600.0)
    "reasoning-code": (
        _LogNormal(mu=5.663656, sigma=0.6, lo=1, hi=1700),
        _Gamma(shape=0.989695, scale=17360.8, lo=1, hi=OUTPUT_CAP),
    ),
}


def synthetic_lengths(workload: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_tokens, output_tokens) int64 arrays of ``n`` samples from ``workload``."""
    if workload not in _LAWS:
        raise TraceError(f"unknown synthetic workload {workload!r}; choose one of {WORKLOADS}")
    if n < 0:
        raise TraceError(f"number of requests must be >= 0, got {n}")
    prompt_law, output_law = _LAWS[workload]
    return prompt_law.sample(rng, n), output_law.sample(rng, n)


def synthetic_trace(workload: str, *, requests: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> Trace:
    """``requests`` synthetic requests of ``workload`` arriving at ``rate`` req/s.

    Gamma inter-arrival gaps with shape ``burstiness`` (1.0 = Poisson), first arrival at 0.0.
    Deterministic for a given seed.
    """
    if workload not in _LAWS:
        raise TraceError(f"unknown synthetic workload {workload!r}; choose one of {WORKLOADS}")
    if requests < 0:
        raise TraceError(f"number of requests must be >= 0, got {requests}")
    if not rate > 0:
        raise TraceError(f"arrival rate must be > 0 req/s, got {rate}")
    length_seq, arrival_seq = np.random.SeedSequence(seed).spawn(2)
    prompts, outputs = synthetic_lengths(workload, requests, np.random.default_rng(length_seq))
    arrivals = gamma_arrivals(requests, rate, burstiness, np.random.default_rng(arrival_seq))
    rate_text = "inf" if math.isinf(rate) else f"{rate:g}"
    return Trace(
        name=f"synthetic:{workload}",
        arrivals=arrivals,
        prompt_tokens=prompts,
        output_tokens=outputs,
        source=(
            f"synthetic workload={workload} requests={requests} rate={rate_text} burstiness={burstiness:g} seed={seed}"
        ),
    )

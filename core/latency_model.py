"""HyperFlexis' latency model (its Eq. 1–2, from DistServe), fitted on relative error.

    prefill of a batch:   E_p = a + b·Σ l_in + c·Σ l_in²
    one decode iteration: E_d = a' + b'·Σ l_cur + c'·B

Fitted by least squares on relative error, Σ((pred − actual)/actual)² (the paper's Appendix A):
each design row and its target are divided by the measured time and regressed onto ones. The
policy is given only the fit, never the profile it came from: `from_profile` samples the
paper's profiling grid from a PerfProfile with multiplicative lognormal noise (no perfect
foresight); `fit` takes measured samples (a live run's, or a benchmark's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.perf import PerfProfile

BATCH_GRID = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192)
"""Batch sizes of the paper's profiling grid (Appendix A)."""
LENGTH_GRID = (4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2020)
"""Input lengths of the grid ("284" in the paper read as 384, as the spec notes)."""
MIN_STEP_S = 1e-6
"""Predictions are floored here: a fit with a negative intercept never predicts ≤ 0 s."""


def _relative_lstsq(design: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, float]:
    """Coefficients minimising the squared relative error, and its root mean square."""
    scaled = design / seconds[:, None]
    coef, *_ = np.linalg.lstsq(scaled, np.ones(len(seconds)), rcond=None)
    rel = scaled @ coef - 1.0
    return coef, float(np.sqrt(np.mean(rel**2)))


@dataclass(frozen=True)
class LatencyModel:
    """Fitted coefficients of Eq. 1 (prefill) and Eq. 2 (decode step), with their fit quality."""

    a: float
    b: float
    c: float
    a_d: float
    b_d: float
    c_d: float
    prefill_rel_rmse: float = 0.0
    """Root-mean-square relative error of the prefill fit on its samples."""
    decode_rel_rmse: float = 0.0
    samples: int = 0

    def prefill(self, tokens: float, squares: float | None = None) -> float:
        """E_p for a batch holding `tokens` prompt tokens (Σ l_in² = `squares`, default one prompt)."""
        sq = tokens * tokens if squares is None else squares
        return max(self.a + self.b * tokens + self.c * sq, MIN_STEP_S)

    def decode_step(self, kv_tokens: np.ndarray | float, batch: np.ndarray | float) -> np.ndarray:
        """E_d for batches of `batch` sequences holding `kv_tokens` context tokens (vectorised)."""
        out: np.ndarray = np.maximum(
            self.a_d + self.b_d * np.asarray(kv_tokens, dtype=float) + self.c_d * np.asarray(batch, dtype=float),
            MIN_STEP_S,
        )
        return out

    def token_budget(self, ttft_s: float, tpot_s: float, decode_step_s: float) -> float:
        """n_token (Eq. 5): new prompt tokens a worker can take without breaking the tightest SLOs;
        0 when its decode step already eats the TPOT."""
        if decode_step_s >= tpot_s or self.b <= 0:
            return 0.0
        return max((ttft_s * (1.0 - decode_step_s / tpot_s) - self.a) / self.b, 0.0)

    @classmethod
    def fit(
        cls,
        prefill_tokens: np.ndarray,
        prefill_s: np.ndarray,
        decode_kv: np.ndarray,
        decode_batch: np.ndarray,
        decode_s: np.ndarray,
        prefill_squares: np.ndarray | None = None,
    ) -> LatencyModel:
        """Fit both equations from measured samples (single prompts unless `prefill_squares`)."""
        pt = np.asarray(prefill_tokens, dtype=float)
        sq = pt * pt if prefill_squares is None else np.asarray(prefill_squares, dtype=float)
        p_coef, p_err = _relative_lstsq(np.column_stack([np.ones_like(pt), pt, sq]), np.asarray(prefill_s, dtype=float))
        kv = np.asarray(decode_kv, dtype=float)
        bt = np.asarray(decode_batch, dtype=float)
        d_coef, d_err = _relative_lstsq(np.column_stack([np.ones_like(kv), kv, bt]), np.asarray(decode_s, dtype=float))
        return cls(
            a=float(p_coef[0]),
            b=float(p_coef[1]),
            c=float(p_coef[2]),
            a_d=float(d_coef[0]),
            b_d=float(d_coef[1]),
            c_d=float(d_coef[2]),
            prefill_rel_rmse=p_err,
            decode_rel_rmse=d_err,
            samples=len(pt) + len(kv),
        )

    @classmethod
    def from_profile(cls, profile: PerfProfile, noise_sigma: float = 0.05, seed: int = 0) -> LatencyModel:
        """Sample the profiling grid from `profile` with lognormal noise σ and fit (the spec's §3.1)."""
        rng = np.random.default_rng(seed)
        lengths = np.array([n for n in LENGTH_GRID if n <= profile.max_model_len], dtype=float)
        # Prefill samples are single prompts: in this project's engines (and vLLM's chunked prefill)
        # prompts do not share one fixed-cost batch, so Eq. 1's intercept is per prompt. Lengths
        # continue past the grid (doubling) up to the context length.
        extra = [2020 * 2**k for k in range(1, 12) if 2020 * 2**k <= profile.max_model_len]
        pt = np.concatenate([lengths, np.array(extra, dtype=float)])
        sq = pt * pt
        p_true = np.asarray(profile.prefill_time(pt), dtype=float)
        batches = np.array([b for b in BATCH_GRID if b <= profile.max_num_seqs], dtype=float)
        bb, ll = np.meshgrid(batches, lengths)
        kv = (bb * ll).ravel()
        bt = bb.ravel()
        fits = kv <= profile.kv_capacity_tokens
        kv, bt = kv[fits], bt[fits]
        d_true = np.array([profile.step_time(int(b), float(k)) for b, k in zip(bt, kv, strict=True)])
        noise = (lambda n: rng.lognormal(0.0, noise_sigma, n)) if noise_sigma > 0 else (lambda n: np.ones(n))
        return cls.fit(pt, p_true * noise(len(pt)), kv, bt, d_true * noise(len(kv)), prefill_squares=sq)

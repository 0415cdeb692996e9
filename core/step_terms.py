"""What one prefill engine step costs and holds (`StepTerms`): the profile's terms and the closed forms on them.

core/prefill.py projects queues step by step with them; these are the answers that need no stepping:
a prompt alone on an idle instance (`alone_s`), what one more adds to a busy one (`marginal_s`), a
backlog of equal prompts (`backlog_s`). The costs are the emulator's (adapters/emulator/engine.py):
a step of B sequences holding K KV tokens, `prefill_base_s` once when it carries prefill, each
chunk's own tokens, and each prompt's intake (`prefill_host_per_request_s`) between steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.perf import PerfProfile

SERIAL_BUDGET = 1 << 62
"""The token budget of `StepTerms.of(..., serial=True)`: no prompt is ever split or held back by it."""


@dataclass(frozen=True, slots=True)
class StepTerms:
    """What one engine step costs and holds (the profile's terms; the prefill ones may be fitted)."""

    budget: int
    """max_num_batched_tokens: tokens one step computes at most."""
    max_seqs: int
    """max_num_seqs: sequences running at once."""
    base: float
    """prefill_base_s: paid once by a step that carries any prefill chunk."""
    per_token: float
    per_token2: float
    step_base: float
    """decode_step_base_s: every step's fixed cost."""
    per_seq: float
    per_kv: float
    host: float
    """prefill_host_per_request_s: the host work each prompt's intake adds between steps."""
    chunked: bool = True
    """Chunked prefill (vLLM's default); off: a prompt waits for a step with room for all of it,
    and one longer than the budget runs alone."""

    @classmethod
    def of(
        cls, profile: PerfProfile, coef: Sequence[float] | None = None, *, chunked: bool = True, serial: bool = False
    ) -> StepTerms:
        """The profile's terms; `coef` (base, per token, per token²) replaces its prefill ones.
        `serial`: SIBYL App. I's prefill (the simulator's ps mode) instead of vLLM's: one prompt a
        step, whole, with no engine-step cost, so a prompt of l tokens takes exactly
        `prefill_time(l)`, after its intake's host work."""
        a, b, c = coef if coef is not None else (
            profile.prefill_base_s,
            profile.prefill_per_token_s,
            profile.prefill_per_token2_s,
        )
        if serial:
            host = profile.prefill_host_per_request_s
            return cls(SERIAL_BUDGET, 1, float(a), float(b), float(c), 0.0, 0.0, 0.0, host, chunked=False)
        return cls(
            profile.max_num_batched_tokens,
            profile.max_num_seqs,
            float(a),
            float(b),
            float(c),
            profile.decode_step_base_s,
            profile.decode_step_per_seq_s,
            profile.decode_step_per_kv_token_s,
            profile.prefill_host_per_request_s,
            chunked,
        )

    def prefill_s(self, tokens: float) -> float:
        """The prefill terms' own time for a prompt of `tokens`: base + per token + per token² (the
        estimator's t(l), in the same arithmetic, when they are its coefficients)."""
        return self.base + self.per_token * tokens + self.per_token2 * tokens * tokens

    def chunk_s(self, lo: float, hi: float) -> float:
        """The per-token cost of computing prompt tokens lo..hi in one chunk."""
        return self.per_token * (hi - lo) + self.per_token2 * (hi * hi - lo * lo)

    def step_s(self, seqs: int, kv_tokens: float, chunk_s: float | None) -> float:
        """One step of `seqs` sequences holding `kv_tokens`; `chunk_s` its chunks' cost (None: no prefill)."""
        s = self.step_base + self.per_seq * seqs + self.per_kv * kv_tokens
        return s if chunk_s is None else s + self.base + chunk_s

    def chunks(self, tokens: float) -> int:
        """Steps a prompt of `tokens` takes on an idle instance."""
        return max(math.ceil(tokens / self.budget), 1) if self.chunked else 1

    def alone_s(self, tokens: float) -> float:
        """Seconds from an idle instance taking a prompt of `tokens` to its first token: its intake,
        then its chunks, each its own step (chunk i ends at min(i·budget, tokens))."""
        k = max(math.ceil(tokens / self.budget), 1) if self.chunked else 1  # chunks(tokens)
        sum_hi = self.budget * k * (k - 1) / 2 + tokens
        per_step = self.step_base + self.per_seq + self.base
        steps = k * per_step + self.per_kv * sum_hi + self.per_token * tokens + self.per_token2 * tokens * tokens
        return self.host + steps

    def alone_array(self, tokens: np.ndarray) -> np.ndarray:
        """`alone_s` of each of `tokens`."""
        per_step = self.host + self.step_base + self.per_seq + self.base
        if not self.chunked or float(tokens.max(initial=0.0)) <= self.budget:
            out: np.ndarray = per_step + (self.per_kv + self.per_token) * tokens + self.per_token2 * tokens * tokens
            return out
        k = np.maximum(np.ceil(tokens / self.budget), 1.0)
        sum_hi = self.budget * k * (k - 1) / 2 + tokens
        per_step -= self.host  # the intake once, not per chunk
        steps = k * per_step + self.per_kv * sum_hi + self.per_token * tokens + self.per_token2 * tokens * tokens
        out = self.host + steps
        return out

    def marginal_s(self, tokens: float) -> float:
        """Seconds one more prompt of `tokens` adds to a busy instance's backlog, its share of the
        steps' fixed costs amortised over the budget, or over the slots when more prompts of its
        size fit the budget than a step holds (held requests are sized with it)."""
        steps = (self.step_base + self.base) * max(tokens / self.budget, 1.0 / self.max_seqs)
        return steps + self.per_seq + self.host + self.per_token * tokens + self.per_token2 * tokens * tokens

    def backlog_s(self, ahead: float, each: float, tokens: float = 0.0) -> float:
        """Seconds until a prompt of `tokens` gets its first token behind `ahead` prompts of `each`
        tokens on an idle instance (0 tokens: until those drain), in whole steps of the budget and
        the slots (closed form: exact when the prompts fit the steps whole, e.g. 512-token prompts
        under a 2048 budget; otherwise each step boundary splits a prompt, one more sequence a
        step). The prompts ahead wait in the engine (their intake is done); the new one's intake
        comes first."""
        n = ahead + (1 if tokens > 0 else 0)
        total = ahead * each + tokens
        if n <= 0 or total <= 0:
            return 0.0
        k = max(math.ceil(total / self.budget), math.ceil(n / self.max_seqs), 1)
        aligned = each > 0 and self.budget % each == 0 and (tokens <= 0 or tokens == each)
        splits = 0 if aligned or not self.chunked else k - 1
        fixed = k * (self.step_base + self.base) + self.per_seq * (n + splits) + self.per_kv * total
        work = self.per_token * total + self.per_token2 * (ahead * each * each + tokens * tokens)
        return fixed + work + (self.host if tokens > 0 else 0.0)

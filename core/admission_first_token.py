"""What SLO admission projects for an arrival: when its first token would come out of each prefill instance."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from core.admission_signals import StepJoiners, TtftDrifts
from core.types import Request, Role

if TYPE_CHECKING:
    from core.step_terms import StepTerms
    from core.view import ClusterView


class FirstTokenProjection:
    """SloGate's projection of a request's first token per routable prefill instance: batched into
    the dispatcher's projection (core/prefill.py), or behind what the engine reports waiting if that
    is later, plus the prompts expected to join its step (`StepJoiners`), corrected by the
    instance's measured drifts (`TtftDrifts`).

    Up to `StepJoiners.SMALL_POOL` routable instances it is computed one instance at a time in
    floats (`first_token_one`), past that in arrays (`first_token_array`): the same arithmetic,
    held equal by tests/core/test_admission_first_token.py. NumPy's fixed cost per call made the
    arrays ~40 µs an arrival on 1P1D, a tenth of the gateway's CPU per request."""

    drift: TtftDrifts
    joiners: StepJoiners
    typical_prompt: float
    _terms: StepTerms

    @staticmethod
    def _uncached(r: Request, v: ClusterView) -> float | np.ndarray:
        """The prompt tokens `r` would compute: one per instance (less its expected prefix hit there)
        where the prefix view expects one anywhere, else the whole prompt."""
        if v.prefix is None or not r.prefix_keys:
            return float(r.prompt_tokens)
        cached = v.cached_tokens(r)
        return np.maximum(float(r.prompt_tokens) - cached, 1.0) if cached.any() else float(r.prompt_tokens)

    def first_token_s(self, r: Request, v: ClusterView, now: float) -> np.ndarray:
        """Per routable prefill instance: seconds from now until `r`'s first token would come out
        there if routed now — batched into the projection, or behind what the engine reports
        waiting if that is later — scaled by the instance's measured drift. The prompt is what each
        instance would compute: less the prefix it is expected to find cached there."""
        q = v.queues
        self._terms = q.terms
        tokens = self._uncached(r, v)
        where = v.routable_indices(Role.PREFILL)
        if len(where) > StepJoiners.SMALL_POOL:
            return self.first_token_array(v, v.prefill_mask(), tokens, now)
        obs = v.waiting_obs
        waiting = any(obs[p] for p in where)
        return np.array(
            [
                self.first_token_one(v, p, float(tokens[p]) if isinstance(tokens, np.ndarray) else tokens, now, waiting)
                for p in where
            ]
        )

    def first_token_one(self, v: ClusterView, p: int, tokens: float, now: float, waiting: bool) -> float:
        """`first_token_s` on prefill instance p alone, in floats; `waiting`: some routable prefill
        engine reports waiting prompts (then every instance's projection is held to its engine's)."""
        q = v.queues
        terms = q.terms_of(p)
        free = float(v.prefill_free_at[p])
        projected = q.first_token_at_one(p, tokens, now, free) - now
        if waiting:
            projected = max(projected, self.engine_first_token_s(v, p, terms, tokens, now))
        alone = terms.alone_s(tokens)
        j = self.joiners
        until = q.step_start_one(p, tokens, now, free) - now if j.rate_known(p) else 0.0
        joining = j.expected_one(p, until, now, self._terms, self.typical_prompt, tokens)
        own_r, own_a = self.drift.own_terms(p)
        return alone * own_r + own_a + (max(projected - alone, 0.0) + joining) * self.drift.wait_ratio(p)

    def first_token_array(self, v: ClusterView, mask: np.ndarray, tokens: float | np.ndarray, now: float) -> np.ndarray:
        """`first_token_s` over every `mask`ed instance at once, in arrays (large pools)."""
        q = v.queues
        where = np.flatnonzero(mask)
        projected = v.first_token_at(tokens)[mask] - now
        if v.waiting_obs[mask].any():
            own = np.broadcast_to(np.asarray(tokens, dtype=float), mask.shape)
            engine = np.array(
                [self.engine_first_token_s(v, int(p), q.terms_of(int(p)), float(own[p]), now) for p in where]
            )
            projected = np.maximum(projected, engine)
        alone = self._alone_s(v, where, tokens)
        mine = tokens[mask] if isinstance(tokens, np.ndarray) else tokens
        starts = q.step_starts(tokens, now, v.prefill_free_at)[mask] - now
        joining = self.joiners.expected_s(where, starts, now, q.terms, self.typical_prompt, mine)
        own_r, wait_r, own_a = self.drift.ratios(v.n_instances)
        waits = np.maximum(projected - alone, 0.0) + joining
        out: np.ndarray = alone * own_r[mask] + own_a[mask] + waits * wait_r[mask]
        return out

    def engine_first_token_s(self, v: ClusterView, p: int, terms: StepTerms, tokens: float, now: float) -> float:
        """Seconds from now to the first token of a prompt of `tokens` behind what prefill instance
        p's engine last reported waiting (`StepTerms.backlog_s`, typical prompts batched), less what
        of those has drained since the report, never less than the prompt's own steps. A report is
        up to a poll period old: on emulated 1P1D at 0.8·C (`benchmarks/admission.py`, seed 37, 160 s)
        a 1,981-token prompt arriving at an idle instance was projected one typical prompt late
        (2.16 s against 1.88 s served) from a report that one prompt was still waiting."""
        waiting = float(v.waiting_obs[p])
        ahead = terms.backlog_s(waiting, self.typical_prompt)
        drained = min(max(now - float(v.waiting_obs_at[p]), 0.0), ahead)
        behind = terms.backlog_s(waiting, self.typical_prompt, tokens) if tokens > 0 else ahead
        return behind - drained

    def engine_backlog_s(self, v: ClusterView, p: int, terms: StepTerms, now: float) -> float:
        """Seconds from now until what prefill instance p's engine last reported waiting has drained
        (`engine_first_token_s` of no prompt of its own: never negative, as no more drains than was ahead)."""
        return self.engine_first_token_s(v, p, terms, 0.0, now)

    @staticmethod
    def _alone_s(v: ClusterView, where: np.ndarray, tokens: float | np.ndarray) -> float | np.ndarray:
        """Per routable prefill instance (`where`): the prompt's prefill alone there (its own terms, if any)."""
        q = v.queues
        if np.ndim(tokens) == 0 and not q.own.own:
            return q.terms.alone_s(float(tokens))
        own = np.broadcast_to(np.asarray(tokens, dtype=float), (v.n_instances,))
        return np.array([q.terms_of(int(p)).alone_s(float(own[p])) for p in where])

    def _own_s(self, r: Request, v: ClusterView, p: int) -> float:
        """`r`'s prefill alone on prefill instance p (its uncached prompt there, scaled by p's
        measured drift), with no queue ahead."""
        tokens = self._uncached(r, v)
        own = float(tokens[p]) if isinstance(tokens, np.ndarray) else float(tokens)
        own_r, own_a = self.drift.own_terms(p)
        return v.queues.terms_of(p).alone_s(own) * own_r + own_a

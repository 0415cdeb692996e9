"""Prefill on a decode instance: where SLO admission may serve a request the prefill pool would start too late."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from core.request_table import PENDING
from core.step_terms import StepTerms

if TYPE_CHECKING:
    from core.perf import PerfProfile
    from core.view import ClusterView


@dataclass
class LocalStep:
    """The last step a decode instance was projected to run with local prefills in it."""

    start: float
    end: float
    tokens: float
    """The prompt tokens in it (within `max_num_batched_tokens`)."""
    deadlines: list[float] = field(default_factory=list)
    """When each prompt in it must have its first token (its arrival + its budget)."""


@dataclass(frozen=True)
class LocalChoice:
    """Where a request goes alone and what that does there."""

    decode: int
    start: float
    end: float
    """When its step starts and ends: its first token (the dispatcher's clock)."""
    stall_s: float
    """What it adds to the decode instance's steps: every request decoding there waits that long."""
    joins: bool
    """It joins a step projected for earlier local prefills (not yet started)."""
    deadline: float
    """When its first token must have come out (its arrival + its budget)."""
    tokens: float
    """Its prompt's tokens (what it takes of the step's budget)."""


class LocalPrefill:
    """Requests routed to a decode instance alone, which computes their prompt itself (no prefill leg).

    This is conditional disaggregation (Dynamo's disaggregated router, llm-d's P/D decider): when the
    prefill pool would start a request past its target, a decode instance may prefill it locally.
    vLLM 0.32's scheduler puts a waiting prompt into the decode instance's next step beside the running
    decodes, within the step's token budget, so:

    * prompts sent to an instance before its next step starts share that step: its first tokens all
      come out at its end, and the step costs the decode step plus `prefill_base_s` once plus each
      prompt's tokens (as the emulator steps it); one that does not fit the budget goes to the step after;
    * the step starts at once on an idle instance, else at the next step boundary (after the local
      step under way, or within a decode step);
    * every sequence decoding there waits for that extra cost.

    So a decode instance is chosen only if the request's first token and those of the prompts already
    in the step it would join stay within their budgets; every request bound there keeps its TPOT
    within headroom × its target with the stall added to the stalls it already took (its decode step
    plus all of them spread over the tokens it is expected to make: its `max_tokens`, or fewer as the
    finished requests' outputs say, `stalls_fit`); every request in prefill bound there
    whose decode is projected to start during that step still starts within its TTFT target after it
    (a request bound only at its prefill's end is not seen: the TTFT margin hears what it costs them);
    and it has a free slot.
    """

    def __init__(self, profile: PerfProfile) -> None:
        self.profile = profile
        self.terms = StepTerms.of(profile)
        """What a prompt adds to a step (the profile's terms, as the prefill projection steps them)."""
        self.steps: dict[int, LocalStep] = {}
        """Per decode index: the last step projected with local prefills in it."""
        self.stalled: dict[Hashable, float] = {}
        """Per request bound to a decode instance: seconds of local prefill its decode waits for."""
        self.chosen: dict[Hashable, LocalChoice] = {}
        """Requests admitted to go to a decode instance alone, until routed."""
        self.routed = 0
        """Requests served by a decode instance alone so far."""
        self.output_mean: float | None = None
        """Output tokens of the requests finished lately (exponentially weighted; None before the first)."""

    def finished(self, output_tokens: int) -> None:
        """A request finished after `output_tokens` tokens."""
        m = self.output_mean
        self.output_mean = float(output_tokens) if m is None else m + 0.05 * (output_tokens - m)

    def step_s(self, v: ClusterView, d: int, measured_tpot_s: float) -> float:
        """Decode instance d's step now: the profile's at its running count, or the measured TPOT if longer."""
        n = max(int(v.running_n[d]), 1)
        return max(self.profile.step_time(n, n * self.profile.ps_context_tokens), measured_tpot_s)

    def chunk_s(self, tokens: float) -> float:
        """What a prompt of `tokens` adds to a step that already pays the prefill's fixed cost (the
        chunks of one longer than the step's budget each start a step of their own), with its intake."""
        t = self.terms
        return t.chunk_s(0.0, tokens) + (t.chunks(tokens) - 1) * t.base + t.host

    def propose(
        self, v: ClusterView, d: int, tokens: float, cost: float, deadline: float, step_s: float, now: float
    ) -> LocalChoice | None:
        """The step a prompt of `tokens` (adding `cost` to a step, `chunk_s`) sent to decode instance d
        now would get its first token from, if that keeps its `deadline` and those of the prompts
        already in the step; else None."""
        base = self.terms.base
        last = self.steps.get(d)
        if last is not None and last.start > now and last.tokens + tokens <= self.terms.budget:
            end = last.end + cost
            if end > min(last.deadlines, default=math.inf) or end > deadline:
                return None  # joining would make one already in it late, or itself
            return LocalChoice(d, last.start, end, cost, True, deadline, tokens)
        if last is not None and last.end > now:
            start = last.end  # after the local step under way or already formed
        else:
            idle = int(v.running_n[d]) == 0
            start = now if idle else now + step_s
        end = start + step_s + base + cost
        return None if end > deadline else LocalChoice(d, start, end, base + cost, False, deadline, tokens)

    def stalls_fit(self, v: ClusterView, d: int, stall_s: float, step_s: float, headroom: float) -> bool:
        """Every request bound to decode instance d keeps its TPOT within headroom × its target once it
        also waits `stall_s`: its stalls spread over the tokens it is expected to make, its max_tokens
        or, if fewer, the mean output the finished requests made (vLLM stops at EOS), but at least one
        more than it has made."""
        t = v.table
        n = t.n
        rows = np.flatnonzero((t.inst[:n] == d) & (t.max_out[:n] > 1))
        if not len(rows):
            return True
        expected = t.max_out[rows]
        if self.output_mean is not None:
            expected = np.minimum(expected, np.maximum(t.generated_at(v.now, rows) + 1, self.output_mean))
        taken = np.array([self.stalled.get(t.ids[i], 0.0) for i in rows])
        tpot = step_s + (taken + stall_s) / np.maximum(expected - 1, 1)
        return bool(np.all(tpot <= headroom * t.tpot_slo[rows]))

    def handoffs_fit(self, v: ClusterView, c: LocalChoice, step_s: float) -> bool:
        """Every request in prefill bound to decode instance `c.decode` whose decode is projected to
        start while the chosen step runs still starts within its TTFT target once that step is over
        (vLLM joins a pulled sequence at a step boundary)."""
        t = v.table
        n = t.n
        tau = t.tau[:n]
        rows = np.flatnonzero((t.inst[:n] == c.decode) & (t.state[:n] == PENDING) & (tau >= c.start) & (tau < c.end))
        return bool(np.all(c.end + step_s <= t.arrival[rows] + t.ttft_slo[rows]))

    def choose(
        self,
        v: ClusterView,
        tokens: float,
        cost: float,
        deadline: float,
        slots: int,
        tpot_s: float,
        headroom: float,
        now: float,
    ) -> LocalChoice | None:
        """The routable decode instance where a prompt of `tokens` (adding `cost` to a step, `chunk_s`)
        gets its first token soonest by `deadline`, with a free slot of `slots` and every request there
        within its TPOT (`tpot_s`: the measured decode step, 0 if none); None if there is none."""
        t = v.table
        n = t.n
        bound = np.bincount(t.inst[:n][t.inst[:n] >= 0], minlength=v.n_instances)
        best: LocalChoice | None = None
        for d in (int(x) for x in np.flatnonzero(v.decode_mask())):
            if bound[d] >= slots:
                continue
            step = self.step_s(v, d, tpot_s)
            c = self.propose(v, d, tokens, cost, deadline, step, now)
            if c is None or (best is not None and c.end >= best.end):
                continue
            if self.stalls_fit(v, d, c.stall_s, step, headroom) and self.handoffs_fit(v, c, step):
                best = c
        return best

    def route(self, v: ClusterView, c: LocalChoice) -> float:
        """A request goes to decode instance `c.decode` alone: its prompt is in the step chosen and
        every request bound there takes the stall. Returns when its first token is projected."""
        t = v.table
        n = t.n
        bound = {t.ids[i] for i in np.flatnonzero(t.inst[:n] >= 0)}
        self.stalled = {k: s for k, s in self.stalled.items() if k in bound}  # the finished ones go
        for i in np.flatnonzero(t.inst[:n] == c.decode):
            self.stalled[t.ids[i]] = self.stalled.get(t.ids[i], 0.0) + c.stall_s
        last = self.steps.get(c.decode)
        if c.joins and last is not None:
            last.end = c.end
            last.tokens += c.tokens
            last.deadlines.append(c.deadline)
        else:
            self.steps[c.decode] = LocalStep(c.start, c.end, c.tokens, [c.deadline])
        self.routed += 1
        return c.end

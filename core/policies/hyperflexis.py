"""HyperFlexis multi-SLO dispatch (seed 004): routing that binds the decode instance at prefill end,
and the central queue ordered by TPOT target, then arrival.

Spec: ../shared/design/papers/hyperflexis.md §3. What maps onto this project's decision points:

- Central queue (§3.3): the `hyperflexis` queue policy releases held requests tightest TPOT first,
  then by arrival; a request whose TTFT deadline has already passed is hopeless and waits for a
  second pass (served oldest first, only when no feasible request is held) — never dropped.
- Prefill stage (§3.6): a prefill instance prefills its prompts one after another, so the
  paper's "earliest-maturity P worker" is the one whose routed prefills finish first. The
  admission test p = Φ(t_rem / (s·E_p)) ≥ θ is evaluated there: a request that fails it still
  goes to the earliest worker (the spec's second pass), and `assess` reports it.
- Decode stage, the Migrator (§3.6): at prefill end, among decode instances where the KV fits
  (free tokens ≥ l_cur + growth reserve) and the predicted step E_d(B ∪ {r}) stays under
  (1 − margin) · the tightest TPOT bound there, the one with the smallest predicted step
  (earliest maturity). If none qualifies, the smallest predicted step anyway: this project's
  late binding has no decode-side queue to hold the request in.
- Latency model (§3.1): `core.latency_model.LatencyModel`, fitted on the profile's grid with
  lognormal noise, so the policy never reads the profile directly.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from core.decision_records import note
from core.latency_model import LatencyModel
from core.policies.base import (
    BindPoint,
    PolicyParams,
    QueueParams,
    QueuePolicy,
    QueuePolicyBase,
    RoutingPolicyBase,
)
from core.policies.choice import decode_candidates, least_queued_prefill, projected_handoff
from core.policies.priority_slo import PrioritySLO, PrioritySLOParams
from core.policies.registry import register
from core.request_table import PENDING
from core.types import Assignment, PolicyKind, Request
from core.view import ClusterView

PRIORITY_MEMORY = 4096
"""Requests given targets by priority that are remembered before untracked ones are dropped."""


def normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


class HyperFlexisParams(PolicyParams):
    theta: float = Field(0.7, gt=0, lt=1, description="admission threshold on p = Φ(t_rem / (s·E_p)) (the spec's θ)")
    tpot_margin: float = Field(
        0.1, ge=0, lt=1, description="decode: admit while the predicted step ≤ (1 − margin) · tightest TPOT there"
    )
    growth_reserve_tokens: int = Field(
        64, ge=0, description="decode: KV tokens kept free for each admitted request's growth"
    )
    fit_noise: float = Field(
        0.05, ge=0, le=0.5, description="lognormal σ of the profile samples the latency model is fitted on"
    )
    seed: int = Field(0, description="seed of the fitting noise")
    priority_slo: PrioritySLOParams | None = Field(
        None,
        description="requests naming no SLO class get targets from their priority (Algorithm 2); none: class defaults",
    )


@dataclass(frozen=True, slots=True)
class PrefillAssessment:
    """The prefill-stage admission test for one request on its chosen worker."""

    instance: int
    finish_s: float
    """Projected prefill end (absolute)."""
    t_rem_s: float
    """Slack left for the TTFT after prefill, KV transfer and one decode step."""
    p: float
    admitted: bool
    """p ≥ θ and within the worker's token budget (Eq. 5): the deadline is likely met; otherwise
    the spec's second pass placed it."""


@register(
    PolicyKind.ROUTING,
    "hyperflexis",
    HyperFlexisParams,
    "multi-SLO: earliest prefill, decode chosen at prefill end by TPOT headroom and KV room (HyperFlexis)",
)
class HyperFlexisRouting(RoutingPolicyBase):
    """HyperFlexis' dispatcher and Migrator over this project's P/D decision points."""

    params: HyperFlexisParams
    bind_at: BindPoint = "prefill_end"
    needs_progress = True

    def __init__(self, params: HyperFlexisParams) -> None:
        super().__init__(params)
        self._model: LatencyModel | None = None
        self._model_for: int | None = None
        self.mapper = PrioritySLO(params.priority_slo) if params.priority_slo is not None else None
        self._priority: dict[Hashable, int] = {}
        """Priority of the requests this policy gave targets to, until they complete."""

    def assign_targets(self, request: Request, view: ClusterView, queue: QueuePolicy) -> None:
        """Algorithm 2 for a request that gave only a priority (when `priority_slo` is set)."""
        if self.mapper is None:
            return
        p = request.priority
        t = view.table
        n = t.n
        # pending: held at the gateway, or routed and not prefilled yet (B_wait)
        higher = any(r.priority < p for r in queue.items()) or any(
            self._priority.get(rid, p) < p
            for rid, state in zip(t.ids[:n], t.state[:n], strict=True)
            if state == PENDING
        )
        request.ttft_s, request.tpot_s = self.mapper.assign(p, higher)
        if len(self._priority) > PRIORITY_MEMORY:  # failed requests never complete: forget them
            self._priority = {rid: q for rid, q in self._priority.items() if rid in t}
        self._priority[request.id] = p

    def observe_completion(self, request: Request, ttft_s: float, tpot_s: float, queue_s: float) -> None:
        self._priority.pop(request.id, None)
        if self.mapper is not None:
            self.mapper.observe(request.priority, ttft_s, tpot_s, queue_s)

    def model(self, view: ClusterView) -> LatencyModel:
        """The latency model fitted for the view's profile (refitted if the profile changes)."""
        if self._model is None or self._model_for != id(view.profile):
            self._model = LatencyModel.from_profile(view.profile, self.params.fit_noise, self.params.seed)
            self._model_for = id(view.profile)
        return self._model

    def assess(self, request: Request, view: ClusterView) -> PrefillAssessment:
        """Where the prefill goes (earliest finish) and whether the TTFT admission test passes there."""
        p, finish = least_queued_prefill(request, view)
        m = self.model(view)
        e_p = m.prefill(request.prompt_tokens)
        ttft = request.ttft_s if request.ttft_s is not None else view.slo["default"].ttft_s
        one_step = float(m.decode_step(request.prompt_tokens, 1))
        t_rem = request.arrival + ttft - (finish + view.profile.kv_transfer_time(request.prompt_tokens) + one_step)
        backlog = max(float(view.prefill_free_at[p]) - view.now, 0.0)
        util = min(backlog / ttft, 1.0)
        spread = (0.1 + 0.3 * util) * e_p
        prob = normal_cdf(t_rem / spread) if spread > 0 else float(t_rem >= 0)
        # Eq. 5 on a prefill worker (no decoding there: E_d = 0), against the TTFT left after the
        # KV transfer and one decode step: the prompt tokens queued on it plus this one must fit.
        ttft_left = ttft - view.profile.kv_transfer_time(request.prompt_tokens) - one_step
        queued = backlog / m.b if m.b > 0 else 0.0
        fits = queued + request.prompt_tokens <= m.token_budget(ttft_left, math.inf, 0.0)
        return PrefillAssessment(p, finish, t_rem, prob, prob >= self.params.theta and fits)

    def route(self, request: Request, view: ClusterView) -> Assignment:
        a = self.assess(request, view)
        return Assignment(view.instance_ids[a.instance], None, projected_handoff(request, a.finish_s, view))

    def decode_steps(self, request: Request, view: ClusterView) -> tuple[np.ndarray, np.ndarray]:
        """Per instance index: the predicted decode step with this request added, and whether the
        request is admissible there (KV fits with the growth reserve, step within the TPOT bound)."""
        m = self.model(view)
        t = view.table
        n = t.n
        tokens = view.decode_tokens()
        batch = (view.running_n + view.pending_n).astype(float)
        l_cur = float(request.prompt_tokens)
        steps = m.decode_step(tokens + l_cur, batch + 1)
        tightest = np.full(view.n_instances, np.inf)
        bound = t.inst[:n] >= 0
        known = np.where(t.tpot_slo[:n] > 0, t.tpot_slo[:n], np.inf)  # rows placed without a target: none
        np.minimum.at(tightest, t.inst[:n][bound], known[bound])
        own = request.tpot_s if request.tpot_s is not None else view.slo["default"].tpot_s
        tightest = np.minimum(tightest, own)
        reserve = self.params.growth_reserve_tokens
        free = view.profile.kv_capacity_tokens - tokens - reserve * batch
        ok = (free >= l_cur + reserve) & (steps <= (1.0 - self.params.tpot_margin) * tightest)
        return steps, ok

    def choose_decode(self, request: Request, view: ClusterView) -> int:
        mask = decode_candidates(view)
        steps, ok = self.decode_steps(request, view)
        admissible = mask & ok
        pool = admissible if admissible.any() else mask
        d = int(np.argmin(np.where(pool, steps, np.inf)))
        note(view, "decode", self.name, "decode_step_s", steps, pool, d, admissible=admissible)
        return d

    def display_load(self, view: ClusterView) -> np.ndarray:
        """Predicted decode step per instance (seconds), the Migrator's measure of load."""
        batch = (view.running_n + view.pending_n).astype(float)
        out: np.ndarray = np.where(batch > 0, self.model(view).decode_step(view.decode_tokens(), batch), 0.0)
        return out


class SloQueueParams(QueueParams):
    pass


@register(
    PolicyKind.QUEUE,
    "hyperflexis",
    SloQueueParams,
    "central SLO queue: tightest TPOT target first, then arrival; past-deadline requests in a second pass",
)
class SloQueue(QueuePolicyBase):
    """HyperFlexis' Q_R: feasible requests by (TPOT target, arrival); hopeless ones (TTFT deadline
    already passed when they come up) after them, oldest first. Removal is lazy."""

    def __init__(self, params: QueueParams) -> None:
        super().__init__(params)
        self._feasible: list[tuple[float, float, int, str | int]] = []
        self._hopeless: list[tuple[float, int, str | int]] = []
        self._held: dict[str | int, Request] = {}
        self._seq = itertools.count()

    def push(self, request: Request, now: float) -> None:
        self._held[request.id] = request
        tpot = request.tpot_s if request.tpot_s is not None else math.inf
        heapq.heappush(self._feasible, (tpot, request.arrival, next(self._seq), request.id))

    def pop(self, now: float) -> Request | None:
        while self._feasible:
            _, arrival, seq, rid = heapq.heappop(self._feasible)
            r = self._held.get(rid)
            if r is None:
                continue
            deadline = arrival + (r.ttft_s if r.ttft_s is not None else math.inf)
            if now > deadline:
                heapq.heappush(self._hopeless, (arrival, seq, rid))
                continue
            del self._held[rid]
            return r
        while self._hopeless:
            _, _, rid = heapq.heappop(self._hopeless)
            r = self._held.pop(rid, None)
            if r is not None:
                return r
        return None

    def remove(self, request_id: str | int) -> Request | None:
        return self._held.pop(request_id, None)

    def order_key(self, request: Request) -> dict[str, float]:
        """What orders a held request (decision records): its TPOT target, tightest first, then arrival."""
        return {"tpot_target_s": request.tpot_s if request.tpot_s is not None else math.inf}

    def __len__(self) -> int:
        return len(self._held)

    def items(self) -> list[Request]:
        return sorted(self._held.values(), key=lambda r: (r.tpot_s if r.tpot_s is not None else math.inf, r.arrival))

    def depth_by_class(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self._held.values():
            out[r.slo_class] = out.get(r.slo_class, 0) + 1
        return out

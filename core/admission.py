"""Admission control: route now, hold in the active queue policy while saturated, or shed; SLO-protecting limits.

The held-request bookkeeping (`AdmissionControl`, core/admission_queue.py) and the SLO's settings
(`SloAdmission`, core/admission_settings.py) are re-exported here; this module holds the saturation
model behind them (`SloGate`), which decides on that bookkeeping.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from core.admission_first_token import FirstTokenProjection
from core.admission_local import LocalPrefill
from core.admission_queue import AdmissionControl as AdmissionControl
from core.admission_settings import SloAdmission as SloAdmission
from core.admission_signals import DecodeSlots, RefusalCause, Refusals, StepJoiners, TtftDrifts, TtftMargin
from core.policies.base import QueuePolicy
from core.prefill import StepTerms
from core.types import Admission, Request, Role

if TYPE_CHECKING:
    from core.perf import PerfProfile
    from core.slo import SLOClass
    from core.view import ClusterView


def tpot_slots(profile: PerfProfile, tpot_s: float, context_tokens: float) -> int:
    """The most sequences (≤ max_num_seqs) whose decode step on `profile` stays within `tpot_s`."""
    n = profile.max_num_seqs
    while n > 1 and profile.step_time(n, n * context_tokens) > tpot_s:
        n -= 1
    return n


def pool_drained_s(first: np.ndarray, work: float) -> float:
    """When a prompt whose first token would come out of instance p at `first[p]` (alone behind
    what p holds now) gets it, once the pool has also served `work` seconds of held prefills
    ahead of it: the prefill instances take held work as each frees up (water-filling), so it is
    the least t with Σ_p max(t − first[p], 0) ≥ work (min(first) when nothing is held)."""
    if not len(first):
        return 0.0
    b = np.sort(first)
    if work <= 0:
        return float(b[0])
    k = np.arange(1, len(b) + 1)
    t = (np.cumsum(b) + work) / k  # the level if the first k instances share the work
    fits = np.append(b[1:], np.inf) >= t
    return float(t[int(np.argmax(fits))])


class SloGate(FirstTokenProjection):
    """The saturation model behind SloAdmission: decode slots, the projected first tokens, predicted start.

    The prefill side is the dispatcher's batching-aware projection (core/prefill.py: prompts share
    steps within the token budget, each step paying its fixed cost once), against what the engine
    itself reports waiting, corrected per instance by the measured TTFT of recent requests
    (`TtftDrifts`: a prompt's own service and the queue ahead, apart). The decode slots follow
    the engines' reports and the measured TPOT (`DecodeSlots`). A request is refused only if it
    is projected to start past its budget, and at once only when the engines report the saturation
    (waiting requests, KV) or enough was measured to back the projection; otherwise it is held up
    to `evidence_hold_s` first. Each refusal is counted by the limit it hit (`refusals_by_cause`).
    """

    def __init__(self, settings: SloAdmission, profile: PerfProfile, slo: dict[str, SLOClass]) -> None:
        self.settings = settings
        self.profile = profile
        self.slo = slo
        tightest = min(c.tpot_s for c in slo.values())
        start = settings.decode_slots or tpot_slots(profile, settings.headroom * tightest, profile.ps_context_tokens)
        self.slots = DecodeSlots(
            start, profile.max_num_seqs, fixed=settings.decode_slots is not None, grow_below=settings.headroom
        )
        """Requests in flight per decode instance (`decode_slots`), moved by what the engines report."""
        self.typical_prompt = 256.0
        """Running mean of the prompts seen (sizes the engines' own waiting queues)."""
        self.typical_output = 256.0
        """Running mean of max_tokens seen (sizes the decode completion rate)."""
        self.held_work_s = 0.0
        """Prefill seconds the requests held now add to the backlog, batched (StepTerms.marginal_s)."""
        self.shed = 0
        """Requests refused at arrival because they could not start within their wait bound."""
        self.refused: dict[Role, int] = {Role.PREFILL: 0, Role.DECODE: 0}
        """Those refusals, the sheds of a full queue and every expiry (wait bound or ttl_s) by the pool
        that was short: decode when no decode slot was (or would be) free, else prefill (the scaling
        signals' refusal rates: demand the engines never see); and, as prefill's, the requests a
        decode instance prefilled because the prefill pool was short (`local_prefill`)."""
        self.expired = 0
        """Held requests answered 503 because they could no longer start within their wait bound."""
        self.refusals: dict[RefusalCause, Refusals] = {c: Refusals() for c in RefusalCause}
        self.drift = TtftDrifts()
        """Measured over projected TTFT per prefill instance: a prompt's own service and the queue ahead."""
        self.margin = TtftMargin(settings.headroom, settings.ttft_attainment_goal)
        """The share of what a request's own service leaves of its TTFT target that the queue ahead may take."""
        self.joiners = StepJoiners()
        """The rate prompts are routed to each prefill instance: those expected to join a request's step."""
        self.unverified: dict[Hashable, tuple[float, RefusalCause]] = {}
        """Held requests refused by the prior's projection alone: id → (until when they are held
        before being judged again, the limit they would have hit)."""
        self._terms: StepTerms = StepTerms.of(profile)
        self.local = LocalPrefill(profile) if settings.local_prefill else None
        """Where a request the prefill pool would start too late goes alone, if anywhere (`local_prefill`)."""

    @property
    def decode_slots(self) -> int:
        """Requests in flight per decode instance now."""
        return int(self.slots)

    def describe(self) -> dict[str, float | int]:
        """The limits in force and the refusals by cause (for `status`)."""
        ttft = self.slo["default"].ttft_s
        out: dict[str, float | int] = {
            "decode_slots": self.decode_slots,
            "headroom": self.settings.headroom,
            "margin": round(self.margin.value, 3),
            "ttft_attainment_goal": self.settings.ttft_attainment_goal,
            "extra_wait_s": self.settings.extra_wait_s,
            "wait_bound_s": ttft + self.settings.extra_wait_s,
            "prefill_s_per_request": round(self._terms.marginal_s(self.typical_prompt), 4),
            "prefill_alone_s": round(self._terms.alone_s(self.typical_prompt), 4),
            "kv_high": self.settings.kv_high,
            "waiting_high": self.settings.waiting_high,
            "shed": self.shed,
            "expired": self.expired,
            **self.drift.extremes(),
            "tpot_measured_s": round(self.slots.tpot_s, 4) if self.slots.samples else 0.0,
            "evidence_hold_s": self.settings.evidence_hold_s,
            "held_unverified": len(self.unverified),
            "local_prefill": int(self.local is not None),
            "served_on_decode": self.local.routed if self.local is not None else 0,
        }
        for cause, r in self.refusals.items():
            out[f"refused_{cause.value}"] = r.count
        return out

    def refusals_by_cause(self) -> dict[str, dict[str, float | int]]:
        """cause → {count, last_projected_s, bound_s} (every cause, counted or not)."""
        return {
            c.value: {"count": r.count, "last_projected_s": r.last_projected_s, "bound_s": r.bound_s}
            for c, r in self.refusals.items()
        }

    def count_refusal(self, cause: RefusalCause, projected_s: float, bound_s: float) -> None:
        """Count one refusal of `cause` (the gateway counts its tenant limits here too)."""
        r = self.refusals[cause]
        r.count += 1
        r.last_projected_s = projected_s
        r.bound_s = bound_s

    def observe(self, request: Request) -> None:
        self.typical_prompt += 0.05 * (request.prompt_tokens - self.typical_prompt)
        self.typical_output += 0.05 * (request.max_tokens - self.typical_output)

    def observe_ttft(
        self, p: int, projected_s: float, measured_s: float, own_s: float | None = None, alone: bool = True
    ) -> None:
        """A request routed to prefill instance p was projected to get its first token `projected_s`
        after it was routed, `own_s` of that its own service (None: all of it), and got it after
        `measured_s`; `alone`: no other prefill was in flight there when it was routed (`TtftDrifts.observe`)."""
        self.drift.observe(p, projected_s, measured_s, own_s, alone)

    def observe_attainment(self, ttft_s: float, target_s: float) -> None:
        """An admitted request got its first token `ttft_s` after arrival, against its TTFT target
        (`TtftMargin.observe`)."""
        self.margin.observe(ttft_s, target_s)

    def observe_output(self, output_tokens: int) -> None:
        """A request finished after `output_tokens` tokens (how many the running ones may make)."""
        if self.local is not None:
            self.local.finished(output_tokens)

    def observe_tpot(self, tpot_s: float, target_s: float, v: ClusterView, now: float) -> None:
        """A request finished with measured TPOT `tpot_s` (its target `target_s`): the decode slots
        follow it and what the decode engines report now."""
        self.slots.observe(tpot_s, target_s, self._decode_engines_saturated(v), now)

    def _ttft(self, r: Request) -> float:
        return r.ttft_s if r.ttft_s is not None else (self.slo.get(r.slo_class) or self.slo["default"]).ttft_s

    def wait_bound_s(self, r: Request) -> float:
        """How long after arrival `r` must have started or been answered."""
        return self._ttft(r) + self.settings.extra_wait_s

    def target_s(self, r: Request, own_s: float) -> float:
        """How long after arrival `r` may be projected to start and be routed, its own service
        (its prefill alone and the hand-off) taking `own_s`: that service and the margin × what it
        leaves of the TTFT target (`TtftMargin`: between headroom and 1). The margin is on the queue
        ahead of it, which the projection sees worst: how many prompts will join its step is a count
        no projection at routing knows (± 0.16 s a request at 1.2·C around `StepJoiners`' expectation,
        `benchmarks/admission.py`); the own service of a prompt on an idle instance it sees within
        ~20 ms. A prompt whose own service alone exceeds the target gets the target."""
        ttft = self._ttft(r)
        margin = self.margin.value
        return margin * ttft + (1 - margin) * min(own_s, ttft)

    def _budget(self, r: Request, own_s: float) -> float:
        return self.target_s(r, own_s) + self.settings.extra_wait_s

    def _after_prefill_s(self, prompt_tokens: float) -> float:
        """From the prefill's first token to the client's: the KV transfer and one decode step."""
        p = self.profile
        return p.kv_transfer_time(prompt_tokens) + p.step_time(1, prompt_tokens)

    def handoff_s(self, prompt_tokens: float, v: ClusterView, d: int = -1) -> float:
        """`ClusterView.handoff_s` with the decode step the decode engines measured (the recent TPOT)
        once enough was measured, else the profile's."""
        slots = self.slots
        return v.handoff_s(prompt_tokens, d, slots.tpot_s if slots.measured else None)

    def service_s(self, prompt_tokens: float) -> float:
        """Prefill (its steps on an idle instance), KV transfer and one decode step of a prompt on an idle cluster."""
        return self._terms.alone_s(prompt_tokens) + self._after_prefill_s(prompt_tokens)

    def _full(self, v: ClusterView) -> np.ndarray:
        """Per instance: its engine reports KV usage or waiting requests past the limits (an unpolled
        NaN compares False: not full by its own account)."""
        s = self.settings
        out: np.ndarray = (v.kv_usage >= s.kv_high) | (v.waiting_obs >= s.waiting_high)
        return out

    def decode_room(self, v: ClusterView) -> int:
        """Slots left on routable decode instances that are not saturated by their own account."""
        room = self.decode_slots * int(np.count_nonzero(v.decode_mask() & ~self._full(v))) - v.table.n
        self.slots.limited = room <= 0
        return room

    def _decode_engines_saturated(self, v: ClusterView) -> bool:
        """A routable decode engine reports waiting requests or KV usage past the limits."""
        return bool((v.decode_mask() & self._full(v)).any())

    def _confirmed(self, cause: RefusalCause, v: ClusterView) -> bool:
        """Whether the engines or the measurements back a refusal for `cause` (else only the prior does).

        Prefill backlog: every routable prefill instance either reports waiting prompts of its own
        or has a settled TTFT correction. Decode slots: the operator fixed them, a decode engine
        reports a queue or KV past its limit, or the measured TPOT is past its target. KV: reported."""
        if cause == RefusalCause.PREFILL_BACKLOG:
            where = np.flatnonzero(v.prefill_mask())
            return all(v.waiting_obs[p] > 0 or self.drift.settled(int(p)) for p in where)
        if cause == RefusalCause.DECODE_SLOTS:
            return self.slots.fixed or self._decode_engines_saturated(v) or self.slots.past_target()
        return True

    def _kv_full(self, v: ClusterView) -> bool:
        return bool((v.decode_mask() & (v.kv_usage >= self.settings.kv_high)).any())

    def backlogs(self, v: ClusterView, now: float) -> np.ndarray:
        """Seconds until each routable prefill instance has drained what is queued on it: the
        projection's, or what its engine reports waiting (typical prompts, batched, less what has
        drained since the report) if more."""
        q = v.queues
        self._terms = q.terms
        mask = v.prefill_mask()
        projected = np.maximum(v.prefill_free_at[mask] - now, 0.0)
        engine = np.array([self.engine_backlog_s(v, int(p), q.terms_of(int(p)), now) for p in np.flatnonzero(mask)])
        out: np.ndarray = np.maximum(projected, engine) if len(engine) else projected
        return out

    def routed(self, p: int, tokens: float, step_start: float, now: float) -> float:
        """A prompt of `tokens` uncached tokens was routed to prefill instance p at `now`, into a step
        projected to start at `step_start`: count it, and return what the prompts expected to join
        that step add to its first token (part of what admission projected for it)."""
        joining = self.joiners.expected_one(p, step_start - now, now, self._terms, self.typical_prompt, tokens)
        self.joiners.routed(p, now)  # after: the rate it was admitted on
        return joining

    def fits_now(self, r: Request, v: ClusterView, now: float) -> bool:
        """`r` routed now is expected to start within its target (`target_s`: its own service and
        the margin × what that leaves of its TTFT target) on the prefill instance that gives it its
        first token soonest (the bounded wait, if any, is spent in the gateway's queue, not in an
        engine's)."""
        first = self.first_token_s(r, v, now)
        if not len(first):
            return False
        k = int(first.argmin())
        handoff = self.handoff_s(r.prompt_tokens, v)
        start = now - r.arrival + float(first[k]) + handoff
        ttft = self._ttft(r)
        if start <= self.margin.value * ttft:  # within the target whatever its own service
            return True
        if start > ttft:
            return False
        own = self._own_s(r, v, int(np.flatnonzero(v.prefill_mask())[k])) + handoff
        return start <= self.target_s(r, own)

    def _completion_rate(self, v: ClusterView) -> float:
        """Requests per second the decode pool finishes at full slots (from the profile)."""
        n = max(v.routable_count(Role.DECODE), 1)
        step = (
            self.slots.tpot_s
            if self.slots.measured and self.slots.tpot_s > 0
            else self.profile.step_time(self.decode_slots, self.decode_slots * self.profile.ps_context_tokens)
        )
        return n * self.decode_slots / (max(self.typical_output, 1.0) * step)

    def predicted_start(
        self, r: Request, v: ClusterView, now: float, held: float, share: float = 1.0, first: np.ndarray | None = None
    ) -> float:
        """Seconds after its arrival `r` is expected to start if held behind `held` requests (`share` of
        the held prefill work: less than all when held requests are released fairly between tenants);
        `first`: `first_token_s` of it now, if already computed."""
        if first is None:
            first = self.first_token_s(r, v, now)
        drift = self.drift.ratios(v.n_instances)[1][v.prefill_mask()]
        held_work = share * self.held_work_s * (float(drift.mean()) if len(drift) else 1.0)
        prefill = pool_drained_s(first, held_work)
        room = self.decode_room(v) - held
        decode_wait = 0.0 if room > 0 else (1 - room) / self._completion_rate(v)
        alone = self._terms.alone_s(r.prompt_tokens)
        return now - r.arrival + max(prefill, decode_wait + alone) + self.handoff_s(r.prompt_tokens, v)

    def own_service_s(self, r: Request, v: ClusterView, now: float, first: np.ndarray | None = None) -> float:
        """`r`'s own service where its first token would come soonest: its prefill alone there and the
        hand-off (`first`: `first_token_s` of it now, if already computed)."""
        where = np.flatnonzero(v.prefill_mask())
        if not len(where):
            return self.service_s(r.prompt_tokens)
        k = int(np.argmin(self.first_token_s(r, v, now) if first is None else first))
        return self._own_s(r, v, int(where[k])) + self.handoff_s(r.prompt_tokens, v)

    def _cause(self, v: ClusterView, held: float) -> RefusalCause:
        if self.decode_room(v) - held > 0:
            return RefusalCause.PREFILL_BACKLOG
        return RefusalCause.KV if self._kv_full(v) else RefusalCause.DECODE_SLOTS

    def _count_unmet(self, cause: RefusalCause, n: int = 1) -> None:
        """`n` requests turned away for want of the pool `cause` names (the scaling signals' demand)."""
        self.refused[Role.PREFILL if cause == RefusalCause.PREFILL_BACKLOG else Role.DECODE] += n

    def shortfall(
        self, r: Request, v: ClusterView, now: float, held: float, share: float = 1.0
    ) -> tuple[float, RefusalCause, float] | None:
        """`r` held behind `held` requests is expected to start after its budget (its target plus
        the bounded wait): when, the limit that keeps it and the budget (None: it is expected in time)."""
        first = self.first_token_s(r, v, now)
        start = self.predicted_start(r, v, now, held, share, first)
        budget = self._budget(r, self.own_service_s(r, v, now, first))
        return None if start <= budget else (start, self._cause(v, held), budget)

    def refusal(self, r: Request, v: ClusterView, now: float, held: float, share: float = 1.0) -> str | None:
        """Why `r` cannot be held (expected to start after its wait bound), or None."""
        short = self.shortfall(r, v, now, held, share)
        return None if short is None else self._refuse(r, *short)

    def _refuse(self, r: Request, start: float, cause: RefusalCause, budget: float) -> str:
        """Count `r`'s refusal by `cause` (projected to start at `start`, past `budget`) and say why."""
        self._count_unmet(cause)
        self.count_refusal(cause, start, budget)
        return (
            f"the cluster is saturated ({cause.value}): this request would start about {start:.1f} s after arrival, "
            f"past its class's TTFT target {self._ttft(r):g} s + bounded wait {self.settings.extra_wait_s:g} s; "
            "retry later"
        )

    def prefill_on_decode(self, r: Request, v: ClusterView, now: float) -> bool:
        """Whether `r`, which the prefill pool would start past its budget, goes to a decode instance
        alone instead (`LocalPrefill`, with `local_prefill` on); the choice is kept for `take_local`."""
        local = self.local
        if local is None:
            return False
        cost = local.chunk_s(r.prompt_tokens)
        deadline = r.arrival + self._budget(r, local.terms.base + cost)
        tpot = self.slots.tpot_s if self.slots.measured else 0.0
        s = self.settings
        choice = local.choose(v, r.prompt_tokens, cost, deadline, self.decode_slots, tpot, s.headroom, now)
        if choice is None:
            return False
        local.chosen[r.id] = choice
        return True

    def take_local(self, r: Request, v: ClusterView, now: float) -> tuple[int, float] | None:
        """The decode instance `r` was admitted to alone (`prefill_on_decode`), now routed there, and
        when its first token is projected; None if it was not."""
        if self.local is None or (chosen := self.local.chosen.pop(r.id, None)) is None:
            return None
        self._count_unmet(RefusalCause.PREFILL_BACKLOG)  # served, but the prefill pool was short: demand
        return chosen.decode, self.local.route(v, chosen)

    def hopeless(self, r: Request, now: float) -> bool:
        """Held so long that even an idle cluster would start it past its wait bound."""
        return now - r.arrival + self.service_s(r.prompt_tokens) > self.wait_bound_s(r)

    # --- the decisions, on the dispatcher's AdmissionControl and queue policy ----------------------
    def hold_or_shed(
        self, adm: AdmissionControl, queue: QueuePolicy, r: Request, v: ClusterView, now: float
    ) -> tuple[Admission, str | None]:
        """`r` cannot be routed now: hold it if it is expected to start within its wait bound,
        else refuse it (SHED, with why); a full queue sheds too (why None)."""
        unverified: RefusalCause | None = None
        if len(queue) < queue.params.max_queued:
            ahead = adm.ahead_of(queue, r)
            short = self.shortfall(r, v, now, ahead, ahead / len(adm) if adm else 1.0)
            if short is not None and short[1] == RefusalCause.PREFILL_BACKLOG and self.prefill_on_decode(r, v, now):
                adm.arrivals += 1
                return Admission.ROUTE, None  # `route` sends it to the decode instance chosen
            if short is not None and self.settings.evidence_hold_s > 0 and not self._confirmed(short[1], v):
                unverified = short[1]  # only the prior says so: hold it, judge it again with what is measured
            elif short is not None:
                adm.arrivals += 1
                self.shed += 1
                return Admission.SHED, self._refuse(r, *short)
        decision = adm.admit(queue, r, now, 0)
        if decision == Admission.QUEUED:
            if unverified is not None:
                self.unverified[r.id] = (now + self.settings.evidence_hold_s, unverified)
            self.held_work_s += self._terms.marginal_s(r.prompt_tokens)
        else:
            self._count_unmet(self._cause(v, 0))  # what keeps the held ones from release
            self.count_refusal(RefusalCause.QUEUE_FULL, self.predicted_start(r, v, now, len(adm)), self.wait_bound_s(r))
        return decision, None

    def clear_held(self) -> None:
        """Nothing is held any more."""
        self.held_work_s = 0.0
        self.unverified.clear()

    def release(
        self, adm: AdmissionControl, queue: QueuePolicy, v: ClusterView, now: float, room: int
    ) -> list[Request]:
        """Held requests to route now, one at a time in the queue policy's order, while a decode slot
        is free (`room`) and the prefill instance where the head's first token comes soonest,
        counting the ones released here, gives it that token within its budget counted from its
        arrival (its target + bounded wait: the wait it has had counts), or is idle
        (then nothing held longer starts sooner; `expire` answers the head once even an idle
        cluster would start it past its bound). Counted from now instead, a request held 1.1 s
        of a burst was released into a prefill step that gave its first token 3.15 s after arrival,
        past its 2 s target. A head the prefill pool would give its token too late may go to a
        decode instance alone (`prefill_on_decode`, as an arrival may), one a call: the next choice
        must see it routed there (before, it waited until it expired)."""
        out: list[Request] = []
        if room <= 0 or not v.routable_count(Role.PREFILL):
            return out
        where = np.flatnonzero(v.prefill_mask())
        extra = np.zeros(len(where))
        own_r, wait_r, own_a = self.drift.ratios(v.n_instances)
        drift = wait_r[where]
        while (r := adm.head(queue)) is not None and room > 0:
            first = self.first_token_s(r, v, now) + extra
            k = int(np.argmin(first))
            p = int(where[k])
            own = np.broadcast_to(np.asarray(self._uncached(r, v), dtype=float), v.prefill_mask().shape)
            alone = v.queues.terms_of(p).alone_s(float(own[p]))
            local = False
            if first[k] - alone > 1e-9:  # it waits there: released only within its budget
                handoff = self.handoff_s(r.prompt_tokens, v)
                budget = self._budget(r, alone * float(own_r[p]) + float(own_a[p]) + handoff)  # `_own_s` there
                if now - r.arrival + first[k] + handoff > budget:
                    local = self.prefill_on_decode(r, v, now)
                    if not local:
                        break
            popped = adm.release(queue, now, 1)
            if not popped:
                if local and self.local is not None:
                    self.local.chosen.pop(r.id, None)
                break
            self.unverified.pop(popped[0].id, None)
            work = self._terms.marginal_s(popped[0].prompt_tokens)
            if not local:
                extra[k] += work * drift[k]
            self.held_work_s = max(self.held_work_s - work, 0.0) if adm else 0.0
            out.append(popped[0])
            room -= 1
            if local:
                break
        return out

    def expire(
        self, adm: AdmissionControl, queue: QueuePolicy, v: ClusterView, now: float, expired: list[Request]
    ) -> list[Request]:
        """`expired` (past the queue policy's ttl_s) plus the held requests that can no longer start
        within their wait bound, all removed from the queue (each counted by the limit that held it)."""
        if expired:  # past ttl_s: held by the same shortage
            self._count_unmet(self._cause(v, 0), len(expired))
        for r in expired:
            self.unverified.pop(r.id, None)
        if adm:
            late = [r for r in queue.items() if self.hopeless(r, now)]
            for r in late:
                adm.cancel(queue, r.id)
                self.unverified.pop(r.id, None)
            self.expired += len(late)
            cause = self._cause(v, 0)
            self._count_unmet(cause, len(late))
            for r in late:
                self.count_refusal(cause, now - r.arrival + self.service_s(r.prompt_tokens), self.wait_bound_s(r))
            expired = [*expired, *late, *self._judge_unverified(adm, queue, v, now)]
        work = sum(self._terms.marginal_s(r.prompt_tokens) for r in expired)
        self.held_work_s = max(self.held_work_s - work, 0.0) if adm else 0.0
        return expired

    def next_judgement_at(self) -> float:
        """When the first request held on the prior's word alone is judged again (inf: none is)."""
        return min((until for until, _ in self.unverified.values()), default=float("inf"))

    def _judge_unverified(self, adm: AdmissionControl, queue: QueuePolicy, v: ClusterView, now: float) -> list[Request]:
        """The requests held on the prior's word alone, judged again once their hold is over or the
        engines or measurements back the limit they hit: the ones still expected past their wait
        bound are removed (answered as expired, counted by cause); the others stay held as any."""
        if not self.unverified:
            return []
        out: list[Request] = []
        order = queue.items()
        n = max(len(order), 1)
        for k, r in enumerate(order):
            entry = self.unverified.get(r.id)
            if entry is None:
                continue
            until, cause = entry
            if now < until and not self._confirmed(cause, v):
                continue
            del self.unverified[r.id]
            short = self.shortfall(r, v, now, k, k / n)
            if short is None:
                continue
            adm.cancel(queue, r.id)
            self.expired += 1
            self._refuse(r, *short)
            out.append(r)
        return out

    def retry_after_s(self, v: ClusterView, now: float, held: int) -> float:
        """When a new request would likely be admitted: the prefill backlog and the held work
        drained to the budget, or decode slots free; at least 1 s, at most 60 s."""
        b = self.backlogs(v, now)
        budget = self.margin.value * (self.slo["default"].ttft_s - self.service_s(self.typical_prompt))
        prefill = (float(b.sum()) + self.held_work_s) / max(len(b), 1) - max(budget, 0.0)
        room = self.decode_room(v) - held
        decode = 0.0 if room > 0 else (1 - room) / self._completion_rate(v)
        return min(max(1.0, prefill, decode), 60.0)

"""What SLO admission counts and learns: refusals by the limit they hit, the measured TTFT drift, the decode slots."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from core.step_terms import StepTerms


class RefusalCause(StrEnum):
    """Which limit a refused request hit (an arrival answered 429, a held one answered 503)."""

    PREFILL_BACKLOG = "prefill_backlog"
    """Its first token would come out of every prefill instance too late."""
    DECODE_SLOTS = "decode_slots"
    """No decode slot would free up in time (slots from max_num_seqs and the TPOT target, or the
    engines' own waiting queues)."""
    KV = "kv"
    """No decode slot in time, and a decode engine reports its KV cache full (kv_high)."""
    QUEUE_FULL = "queue_full"
    """The gateway's queue already holds max_queued requests."""
    TENANT_LIMIT = "tenant_limit"
    """The tenant's own limit (counted by the gateway's tenant table through `count_refusal`)."""


@dataclass
class Refusals:
    """Refusals of one cause: how many, and the last one's projected start against its bound."""

    count: int = 0
    last_projected_s: float = 0.0
    """Seconds after its arrival the last refused request was projected to start."""
    bound_s: float = 0.0
    """The bound it was held to: at arrival headroom × its class's TTFT target + the bounded wait,
    when held its wait bound (TTFT target + bounded wait)."""


class TtftDrift:
    """Measured over projected TTFT per prefill instance: the feedback that corrects the projection.

    Fitted in log space (the mean of log(measured / projected) over the first 1/`alpha` requests
    finished there, an exponentially weighted one after), so a prior 100× too slow is corrected
    as surely as one 2× too slow, and one outlier moves it by a factor, not to it. The correction
    follows the evidence as far as the evidence goes: n samples back a factor of at most
    2^(n / `doubling_samples`) either way (at most `limit`), so a single odd request moves it
    little and a few dozen agreeing ones move it as far as they say. An instance is `settled` once
    `min_samples` requests back its ratio and that bound no longer clips it: until then admission
    does not refuse on its projection alone (core/admission.py `SloGate`)."""

    def __init__(
        self, alpha: float = 0.05, min_samples: int = 8, doubling_samples: float = 2.0, limit: float = 1000.0
    ) -> None:
        self.alpha = alpha
        self.min_samples = min_samples
        self.doubling_samples = doubling_samples
        self.limit = limit
        self.log_ratio = np.zeros(0)
        """The fitted log(measured / projected), before the bound its samples allow."""
        self.samples = np.zeros(0, dtype=np.int64)
        self.ratio = np.ones(0)
        """The correction applied: exp(log_ratio) within the bound its samples allow."""

    def _grow(self, n: int) -> None:
        k = n - len(self.ratio)
        if k > 0:
            self.log_ratio = np.append(self.log_ratio, np.zeros(k))
            self.samples = np.append(self.samples, np.zeros(k, dtype=np.int64))
            self.ratio = np.append(self.ratio, np.ones(k))

    def bound(self, samples: int) -> float:
        """The largest |log ratio| `samples` requests back."""
        return float(min(samples / self.doubling_samples * math.log(2.0), math.log(self.limit)))

    def observe(self, p: int, projected_s: float, measured_s: float) -> None:
        if projected_s <= 0 or measured_s <= 0:
            return
        self._grow(p + 1)
        self.samples[p] += 1
        n = int(self.samples[p])
        self.log_ratio[p] += max(self.alpha, 1.0 / n) * (math.log(measured_s / projected_s) - self.log_ratio[p])
        b = self.bound(n)
        self.ratio[p] = math.exp(min(max(float(self.log_ratio[p]), -b), b))

    def settled(self, p: int) -> bool:
        """Enough requests back instance p's correction, and the bound on it no longer clips it."""
        if p >= len(self.samples):
            return False
        n = int(self.samples[p])
        return n >= self.min_samples and abs(float(self.log_ratio[p])) <= self.bound(n)

    def of(self, n: int) -> np.ndarray:
        """The ratio per instance index (1 where nothing is known)."""
        self._grow(n)
        return self.ratio[:n]


class OwnServiceLine:
    """A prompt's own service, measured against projected, per prefill instance: measured ≈ a + r ×
    projected, fitted by least squares over recency-weighted moments (the plain mean of the first
    1/`alpha` requests, an exponentially weighted one after).

    Measured on emulated 1P1D (requests routed to an idle instance, three runs of
    `benchmarks/admission.py`): the own service's error is a constant, not a share. It came out 6–9
    ms past its projection whatever the prompt (a = 9 ms, r = 0.99), so a ratio fitted on it (1.03,
    mostly short prompts) put a 1.8 s prompt 50–110 ms past what it took. A line is used once
    `min_samples` requests back it and their projections spread by at least `min_spread` of their
    mean (else the slope is not identified and the ratio stands)."""

    def __init__(self, alpha: float = 0.05, min_samples: int = 8, min_spread: float = 0.25) -> None:
        self.alpha = alpha
        self.min_samples = min_samples
        self.min_spread = min_spread
        self.samples: list[int] = []
        self.moments: list[list[float]] = []
        """Per instance: the weighted means of x, y, x² and x·y (x projected, y measured)."""
        self.a = np.zeros(0)
        self.r = np.ones(0)
        self.known = np.zeros(0, dtype=bool)
        """Per instance: the line (refitted on each of its observations) and whether it is identified."""
        self.mean = np.zeros(0)
        """Per instance: the weighted mean projection (x)."""

    def _grow(self, n: int) -> None:
        k = n - len(self.samples)
        if k > 0:
            self.samples += [0] * k
            self.moments += [[0.0, 0.0, 0.0, 0.0] for _ in range(k)]
            self.a = np.append(self.a, np.zeros(k))
            self.r = np.append(self.r, np.ones(k))
            self.known = np.append(self.known, np.zeros(k, dtype=bool))
            self.mean = np.append(self.mean, np.zeros(k))

    def observe(self, p: int, projected_s: float, measured_s: float) -> None:
        self._grow(p + 1)
        n = self.samples[p] = self.samples[p] + 1
        w = max(self.alpha, 1.0 / n)
        m = self.moments[p]
        x, y = projected_s, measured_s
        for j, value in enumerate((x, y, x * x, x * y)):
            m[j] += w * (value - m[j])
        mx, my, mxx, mxy = m
        var = mxx - mx * mx
        known = n >= self.min_samples and var > (self.min_spread * mx) ** 2
        r = (mxy - mx * my) / var if known else 1.0
        self.known[p], self.r[p], self.a[p], self.mean[p] = known, r, my - r * mx if known else 0.0, mx

    def lines(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per instance index up to n (read-only views): a, r, and whether the requests seen identify them."""
        self._grow(n)
        return self.a[:n], self.r[:n], self.known[:n]


IDLE_SHARE = 0.1
"""A request whose projected queue ahead was at most this share of its own service counts as routed
to an idle instance (it teaches the own-service drift)."""


class TtftDrifts:
    """The measured TTFT's two corrections per prefill instance: of a prompt's own service (its
    prefill alone and the hand-off) and of the queue projected ahead of it.

    Requests routed to an idle instance (the queue ahead under `IDLE_SHARE` of their own service)
    teach `own`; the others teach `wait`, as the measured time past their own service (corrected
    by `own`) over the queue's projected part (at least a tenth of it: a queue measured as nothing
    says "much shorter", not "free"). Kept apart because the two err differently: on emulated 1P1D
    near capacity a prompt's own service came out within ~3% of its projection, while the queue
    ahead ran 1.1–1.5× its projection (later prompts join a waiting prompt's step before it starts,
    as vLLM's scheduler batches them; `benchmarks/admission.py`; expected since by `StepJoiners`, and
    the queue's part then measured 0.93–1.00). One ratio fitted on both scaled a
    long prompt's own service by the queue's error. A part nothing was measured for on an instance
    follows the other part there. Where the own service's requests identify a line (`OwnServiceLine`:
    a constant plus a slope), its slope replaces the own ratio and its constant is added: the
    own-service error measured was a constant, which a ratio stretches over a long prompt."""

    def __init__(self) -> None:
        self.own = TtftDrift()
        self.wait = TtftDrift()
        self.own_line = OwnServiceLine()
        self._ratios: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        """`ratios` as last computed (dropped by each observation): read on every arrival."""

    def observe(
        self, p: int, projected_s: float, measured_s: float, own_s: float | None = None, alone: bool = True
    ) -> None:
        """A request projected `projected_s` to its first token on instance p, `own_s` of that its
        own service (None: all of it), measured `measured_s`; `alone`: no other prefill was in flight
        on p when it was routed. One projected to find p idle while another prefill was still in
        flight there teaches neither part: what it waited was not projected, so no ratio says how far
        off that was, and counted as its own service it would inflate the own part, which then takes
        the queue's error out of every queued request's measurement. (Once in a run at 3·C the own
        part reached 2.45 and the queue's fell to 0.92, and 81% of the admitted met their target; two
        more runs of that build, and two with this rule, stayed at 1.02–1.07 and 99.5–100%.)"""
        if own_s is None or projected_s - own_s <= IDLE_SHARE * own_s:
            if not alone:
                return
            self._ratios = None
            self.own.observe(p, projected_s, measured_s)
            self.own_line.observe(p, projected_s, measured_s)
            return
        own_r, own_a = self.own_terms(p)
        own = own_s * own_r + own_a
        wait = projected_s - own_s
        self._ratios = None
        self.wait.observe(p, wait, max(measured_s - own, 0.1 * wait))

    def own_terms(self, p: int) -> tuple[float, float]:
        """`ratios`' own part on instance p alone: (its drift, its constant), without the arrays."""
        own, wait, line = self.own, self.wait, self.own_line
        self._grow(p + 1)
        r = float(own.ratio[p] if own.samples[p] > 0 else wait.ratio[p])
        slope, a = float(line.r[p]), float(line.a[p])
        if line.known[p] and 0.5 * r <= slope <= 2.0 * r and abs(a) <= 0.5 * float(line.mean[p]):
            return slope, a
        return r, 0.0

    def wait_ratio(self, p: int) -> float:
        """`ratios`' queue part on instance p alone, without the arrays."""
        own, wait = self.own, self.wait
        self._grow(p + 1)
        return float(wait.ratio[p] if wait.samples[p] > 0 else own.ratio[p])

    def _grow(self, n: int) -> None:
        """Every part's arrays cover n instances."""
        if n > len(self.own.ratio) or n > len(self.wait.ratio) or n > len(self.own_line.samples):
            self.own.of(n), self.wait.of(n), self.own_line.lines(n)

    def ratios(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per instance index (read-only): the drift of a prompt's own service and of the queue ahead
        of it, and the constant added to the own service (s): a projected own service x is taken as
        x × the first + the third (admission scales a prompt's prefill alone by the first and adds the
        hand-off as projected: the same but for (first − 1) × the hand-off, ~0.3 ms at the 0.99 measured)."""
        cached = self._ratios
        if cached is not None and len(cached[0]) == n:
            return cached
        own, wait = self.own.of(n), self.wait.of(n)
        own_n, wait_n = self.own.samples[:n], self.wait.samples[:n]
        own_r = np.where(own_n > 0, own, wait)
        a, r, known = self.own_line.lines(n)
        if known.any():  # a slope far from the ratio, or a constant past half the mean projection: an outlier's doing
            use = known & (r >= 0.5 * own_r) & (r <= 2.0 * own_r) & (np.abs(a) <= 0.5 * self.own_line.mean[:n])
            own_r, offset = np.where(use, r, own_r), np.where(use, a, 0.0)
        else:
            offset = np.zeros(n)
        self._ratios = (own_r, np.where(wait_n > 0, wait, own), offset)
        return self._ratios

    def settled(self, p: int) -> bool:
        """Enough measured requests back either correction on instance p."""
        return self.own.settled(p) or self.wait.settled(p)

    def extremes(self) -> dict[str, float]:
        """The least and greatest ratio of each part over the instances (1 where nothing is known), and
        the largest constant the own-service line adds (0 where no line is identified)."""
        out: dict[str, float] = {}
        for name, d in (("ttft_drift", self.own), ("ttft_wait_drift", self.wait)):
            out[f"{name}_max"] = round(float(d.ratio.max()), 3) if len(d.ratio) else 1.0
            out[f"{name}_min"] = round(float(d.ratio.min()), 3) if len(d.ratio) else 1.0
        constant = self.ratios(len(self.own.ratio))[2]
        out["ttft_own_constant_max_s"] = round(float(np.abs(constant).max()), 4) if len(constant) else 0.0
        return out


class StepJoiners:
    """The prompts that will join a request's prefill step before it starts, expected.

    vLLM's scheduler forms a step from every prompt waiting when it starts (within
    max_num_batched_tokens and max_num_seqs), so a prompt routed to a busy prefill instance shares
    its step with those routed there after it and before that step starts, and its first token
    waits for their chunks too. The projection at routing time cannot see them. On emulated 1P1D
    at 1.2·C (109 requests, `benchmarks/admission.py`'s setting) the queue's projection came out
    exact for a request whose step started at once and one or more typical prompts' prefill late
    for the rest, bimodal, averaging +0.10 s; the rate of prompts routed there × the time until
    its step starts × one typical prompt's share of a step predicted +0.10 s, bucket by bucket
    (+0.08 against +0.08 s, +0.14 against +0.17 s, +0.33 against +0.32 s). Admission adds that
    expectation to each projected first token, and to what the queue's drift compares.

    The rate is per instance, of the prompts routed there (refused ones never reach an engine),
    exponentially weighted over `tau_s`. Until `tau_s` has passed since the first, the weights cover
    less than the window they are divided by: they are divided by the part they cover, counted from
    the first prompt (which opens it, so it is not counted in it). Read as covering all of it, the
    rate started from nothing and reached 0.27–0.77/s in the first 4 s of a 1.55/s stream (emulated
    1P1D, `benchmarks/admission.py`, seed 37 at 0.8·C); the queue's drift learned the joiners that
    went unexpected (1.3–1.6 over its first samples), and a 559-token prompt that admission off
    served in 1.79 s was projected at 2.08 s and refused 19 s into the run."""

    SMALL_POOL = 8
    """Up to this many routable prefill instances, admission asks one instance at a time, in floats."""
    REBASE_S = 600.0
    """The weights are kept relative to an origin moved forward this often (so their exponentials stay finite)."""
    MIN_SPAN_S = 1.0
    """The span a rate is counted over is at least this long (a second prompt just after the first is no rate)."""

    def __init__(self, tau_s: float = 10.0) -> None:
        self.tau_s = tau_s
        self.origin = 0.0
        self.weights = np.zeros(0)
        """Per instance index: Σ exp((t − origin) / tau_s) over the times t prompts were routed there."""
        self.first = np.zeros(0)
        """Per instance index: when the first prompt was routed there (NaN: none yet)."""

    def _grow(self, n: int) -> None:
        k = n - len(self.weights)
        if k > 0:
            self.weights = np.append(self.weights, np.zeros(k))
            self.first = np.append(self.first, np.full(k, np.nan))

    def routed(self, p: int, now: float) -> None:
        """A prompt was routed to prefill instance p at `now`."""
        if now - self.origin > self.REBASE_S:
            self.weights *= math.exp(-(now - self.origin) / self.tau_s)
            self.origin = now
        self._grow(p + 1)
        self.weights[p] += math.exp((now - self.origin) / self.tau_s)
        if math.isnan(self.first[p]):
            self.first[p] = now

    def _scale(self, now: float) -> float:
        """weights × this = Σ exp(−(now − t) / tau_s) / tau_s over the prompts routed at t."""
        return math.exp(-(now - self.origin) / self.tau_s) / self.tau_s

    def rate(self, p: int, now: float) -> float:
        """Prompts routed per second to instance p, recently."""
        if p >= len(self.weights) or self.weights[p] <= 0.0:
            return 0.0
        tau, first = self.tau_s, float(self.first[p])
        opened = math.exp(-(now - first) / tau) / tau
        covered = 1.0 - math.exp(-max(now - first, self.MIN_SPAN_S) / tau)
        return max(float(self.weights[p]) * self._scale(now) - opened, 0.0) / covered

    def rates(self, where: np.ndarray, now: float) -> np.ndarray:
        """`rate` of each instance index in `where`, in arrays."""
        tau = self.tau_s
        first = self.first[where]
        since = np.where(np.isnan(first), np.inf, now - first)
        opened = np.exp(-since / tau) / tau
        covered = 1.0 - np.exp(-np.maximum(since, self.MIN_SPAN_S) / tau)
        out: np.ndarray = np.maximum(self.weights[where] * self._scale(now) - opened, 0.0) / covered
        return out

    @staticmethod
    def each_s(terms: StepTerms, typical: float) -> float:
        """What one `typical` prompt joining a step adds to it: its sequence, intake and chunk."""
        n = max(typical, 1.0)
        return terms.per_seq + terms.host + (terms.per_kv + terms.per_token) * n + terms.per_token2 * n * n

    def expected_s(self, where: np.ndarray, until_start_s: np.ndarray, now: float, terms: StepTerms,
                   typical: float, tokens: float | np.ndarray) -> np.ndarray:
        """Per instance index in `where`: seconds the prompts expected to join a step starting
        `until_start_s` from now add to it, the rate × that time (at most what the step's budget and
        slots leave beside `tokens` of the request's own), each `each_s`; 0 where it has started."""
        self._grow(int(where.max()) + 1 if len(where) else 0)
        room = np.minimum(np.maximum(terms.budget - np.asarray(tokens, dtype=float), 0.0) / max(typical, 1.0),
                          terms.max_seqs - 1.0)
        n = np.minimum(self.rates(where, now) * np.maximum(until_start_s, 0.0), room)
        joining: np.ndarray = n * self.each_s(terms, typical)
        return joining

    def rate_known(self, p: int) -> bool:
        """Whether any prompt was routed to instance p (else none is expected to join its steps)."""
        return p < len(self.weights) and self.weights[p] > 0.0

    def expected_one(self, p: int, until_start_s: float, now: float, terms: StepTerms, typical: float,
                     tokens: float) -> float:
        """`expected_s` for instance p alone, in plain floats."""
        if until_start_s <= 0.0:
            return 0.0
        room = min(max(terms.budget - tokens, 0.0) / max(typical, 1.0), terms.max_seqs - 1.0)
        return min(self.rate(p, now) * until_start_s, room) * self.each_s(terms, typical)


class TtftMargin:
    """The share of what a request's own service leaves of its TTFT target that the queue projected
    ahead of it may take, held to the admitted requests' measured TTFT attainment.

    Each admitted request's first token moves it, a stochastic approximation of the margin at which
    a share `goal` of the admitted meet their target: one that met it loosens the margin by `step` ×
    (1 − `goal`), one that missed tightens it by `step` × `goal`, so it settles where the admitted
    miss at rate 1 − `goal`, within [`floor`, 1]. It starts at 1 (refuse only what is projected to
    miss) and tightens where the projection proves optimistic; it is in force once `min_judged`
    admitted requests were judged, and `floor` before (a cold burst admitted at 1 lands on its
    target: `make test-slow`'s 600 burst had 7 of 8 answered at 2.0 s against 2 s, all admitted on
    the whole target before any was judged). A miss is heard once it is certain,
    not at the first token: the dispatcher asks `overdue` at each arrival and each release for the
    admitted requests past their deadline (`watch`), and one whose decode has not begun has missed. In a burst the
    hand-offs come after the burst's arrivals were admitted. A `goal` of 1 keeps it at `floor` (and
    keeps no deadlines). The console's goal, 0.95, and a goal of 1 are measured side by side at
    0.8–3·C in docs/admission.md."""

    def __init__(self, floor: float, goal: float, step: float = 0.1, min_judged: int = 8) -> None:
        self.floor = floor
        self.goal = goal
        self.step = step
        self.min_judged = min_judged
        self.learned = floor if goal >= 1.0 else 1.0
        """Where the stochastic approximation stands (in force once `min_judged` requests were judged)."""
        self.met = 0
        self.missed = 0
        self._deadlines: list[tuple[float, int, Hashable]] = []
        """(TTFT deadline, order, request id) of the admitted requests, a heap (kept while the margin moves)."""
        self._order = itertools.count()

    def watch(self, rid: Hashable, deadline: float) -> None:
        """Admitted request `rid` must have its first token by `deadline` (remembered only while the margin moves)."""
        if self.goal < 1.0 and math.isfinite(deadline):
            heapq.heappush(self._deadlines, (deadline, next(self._order), rid))

    def overdue(self, now: float) -> list[Hashable]:
        """The watched requests whose deadline passed before `now`, each once (finished or not: the caller knows)."""
        out: list[Hashable] = []
        heap = self._deadlines
        while heap and heap[0][0] < now:
            out.append(heapq.heappop(heap)[2])
        return out

    @property
    def value(self) -> float:
        """The margin in force: `floor` until `min_judged` admitted requests were judged, then `learned`."""
        return self.learned if self.met + self.missed >= self.min_judged else self.floor

    def observe(self, ttft_s: float, target_s: float) -> None:
        """An admitted request got its first token `ttft_s` after arrival against its target."""
        if self.goal >= 1.0 or not math.isfinite(target_s):
            return
        if ttft_s <= target_s:
            self.met += 1
            self.learned = min(self.learned + self.step * (1.0 - self.goal), 1.0)
        else:
            self.missed += 1
            self.learned = max(self.learned - self.step * self.goal, self.floor)


class DecodeSlots:
    """Requests in flight per decode instance, moved by what the engines report (additive increase,
    multiplicative decrease).

    It starts from the prior's estimate (vLLM's max_num_seqs cut to the TPOT target on the
    profile's step model) and is only that: each finished request whose measured TPOT keeps the
    recent mean within `grow_below` × its target, while the estimate is what held arrivals back
    (`limited`) and no decode engine reports a queue or KV past its limit, adds one slot (up to
    max_num_seqs, vLLM's own cap); a decode engine reporting a queue or KV past its limit, or the
    recent mean TPOT past its target, takes the estimate down by `decrease` (once per `calm_s`).
    An operator's fixed `decode_slots` never moves."""

    def __init__(
        self,
        start: int,
        most: int,
        fixed: bool,
        grow_below: float,
        min_samples: int = 8,
        alpha: float = 0.1,
        decrease: float = 0.8,
        calm_s: float = 1.0,
    ) -> None:
        self.value = float(start)
        self.most = max(most, start)
        self.fixed = fixed
        self.grow_below = grow_below
        self.min_samples = min_samples
        self.alpha = alpha
        self.decrease = decrease
        self.calm_s = calm_s
        self.samples = 0
        self.tpot_s = 0.0
        """Recent measured TPOT (exponentially weighted; the plain mean of the first 1/alpha)."""
        self.target_s = 0.0
        """Their TPOT targets, weighted alike."""
        self.limited = False
        """The latest admission decision found no slot left by this estimate."""
        self._cut_at = -math.inf

    def __int__(self) -> int:
        return max(int(self.value), 1)

    @property
    def measured(self) -> bool:
        return self.samples >= self.min_samples

    def past_target(self) -> bool:
        """The recent mean measured TPOT is past its target."""
        return self.measured and self.tpot_s > self.target_s

    def observe(self, tpot_s: float, target_s: float, engines_saturated: bool, now: float) -> None:
        """A request finished with measured TPOT `tpot_s` against its target; `engines_saturated`:
        a routable decode engine reports waiting requests or KV usage past the limits."""
        if tpot_s < 0 or target_s <= 0 or not math.isfinite(target_s):
            return
        self.samples += 1
        w = max(self.alpha, 1.0 / self.samples)
        self.tpot_s += w * (tpot_s - self.tpot_s)
        self.target_s += w * (target_s - self.target_s)
        if self.fixed:
            return
        if engines_saturated or self.past_target():
            if now - self._cut_at >= self.calm_s:
                self.value = max(self.value * self.decrease, 1.0)
                self._cut_at = now
            return
        if self.limited and self.measured and self.tpot_s <= self.grow_below * self.target_s:
            self.value = min(self.value + 1.0, float(self.most))

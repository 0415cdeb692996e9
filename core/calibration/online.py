"""The per-instance online fitter: a profile's step and KV terms refitted from what one engine reports.

The profile an instance starts with (shipped, named or calibrated) is only the prior. Each scrape
interval of the engine's `/metrics` (histogram and counter deltas, `EngineInterval`) gives rows of
one linear step model, STYLE item 27: an engine step carrying B sequences that hold K KV tokens
and prefill chunks of p tokens lasts

    decode_step_base + decode_step_per_seq·B + decode_step_per_kv_token·K
        + (prefill_base + prefill_per_token·p + prefill_per_token2·Σ chunk² when it carries a chunk)

as the emulator runs it (adapters/emulator/engine.py). Two rows per interval:

* prefill row: vLLM's `request_prefill_time` (from first scheduling to first token: the engine's own split,
  which never counts the wait in its queue; that is `request_queue_time`) averaged over the requests that
  finished in the interval, against the prefill tokens of the step they ran in. Prompts admitted together share
  a step and each waits for the whole step: the step's tokens are the interval's computed prompt tokens over its
  prefill steps (`iteration_tokens_total`'s steps above the decode batch), scaled by the spread of the prompt
  counts in those steps (a step carrying more is seen by more: `_prefill_steps`); without it, k prompts' worth,
  k the mean number of requests in their prefill phase (Little's law: Σ prefill time / interval, at least 1). A
  prompt larger than a step's share (`max_num_batched_tokens`) spans several steps, each paying the fixed costs.
  Skipped when most prompt tokens came from another instance's KV (a decode instance's "prefill" is the KV
  pull).
* decode row: the mean of `request_time_per_output_token` against the batch a step carries (sampled tokens /
  steps, from `generation_tokens` and `iteration_tokens`' count; else the running gauge) and its resident KV
  (that batch times the mean prompt plus half the mean output of the requests that finished; else the KV-usage
  gauge), plus the prefill chunks mixed into those steps (the prefill steps' share, times the share of their
  batch that was decoding).

The gateway's timings are used only where the engine's own split is unavailable (an upstream without vLLM's
histograms) and only for uncontended legs (`TimedLeg.in_flight == 0`): a gateway duration includes every wait
behind other requests, so under concurrency it would count waiting as work. A prefill leg is the intake's host
work (the prior's) + step(1, l) + prefill(l), a decode leg's TPOT one step(1, l + n/2); KV hand-offs (decode
start → first token on an idle decode instance) fit the KV transfer terms, t − step(1, l) = kv_transfer_base +
kv_transfer_per_token·l.

The fit is `fit_linear`'s (shared with `calibrate`): robust least squares with each row weighted by its age
(exponential forgetting, `half_life_s`) and its request count, the prior added as `prior_weight` pseudo-samples
(ridge toward it), and a term that the rows in the window do not identify (its regressor hardly varies, moves
with another one, or is too noisy) kept at its prior with the reason. Terms come back with their value, prior,
source, the regression's relative RMS residual, their sample count and the age of their newest sample."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from core.calibration.fit import LinearFit, Term, fit_linear
from core.perf import PerfProfile

STEP_TERMS = (
    "decode_step_base_s",
    "prefill_per_token_s",
    "decode_step_per_seq_s",
    "prefill_base_s",
    "decode_step_per_kv_token_s",
    "prefill_per_token2_s",
)
"""The step model's terms, in `fit_linear`'s order of precedence (a later one yields to an earlier)."""
STEP_LABELS = (
    "the steps",
    "prompt tokens in a step",
    "batch size",
    "prefill steps",
    "resident KV tokens",
    "prompt tokens²",
)
KV_TERMS = ("kv_transfer_base_s", "kv_transfer_per_token_s")
KV_LABELS = ("the constant", "prompt tokens")
FITTED_TERMS = STEP_TERMS + KV_TERMS
"""Every term the online fitter keeps fitting; the others (capacities) stay at the prior."""

HALF_LIFE_S = 120.0
PRIOR_WEIGHT = 0.25
"""The prior counts as this many fresh scrape intervals: enough to hold a term the rows barely
move, little enough that a prior 10× off is forgotten after a few dozen intervals (its pull on an
identified term is about 9·PRIOR_WEIGHT / n of the error with n rows)."""
IDENTIFIED_ONLINE = 0.10
"""Largest 1σ uncertainty of a term's contribution, relative to a typical interval's time, that
counts as fitted online (`calibrate` asks 5%): a row is an interval's mean, whose batch and
step tokens come from counters and bucket midpoints, so the model itself misses by ~5-10% a row;
forgetting keeps refitting it."""
MIN_ROWS = 6
REFIT_EVERY_S = 5.0
MIN_WEIGHT = 1e-3
"""Rows weighing less than this (about ten half-lives old) are dropped."""
MAX_ROWS = 2000


@dataclass(frozen=True)
class HistogramDelta:
    """A Prometheus histogram between two scrapes: observations, their sum, and per bucket the
    observations at or below its upper bound (cumulative, as `le` buckets are; +inf last)."""

    count: float = 0.0
    total: float = 0.0
    buckets: tuple[tuple[float, float], ...] = ()

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def second_moment(self) -> float | None:
        """E[x²], estimated from the buckets (each observation at its bucket's midpoint, the +inf
        bucket's at its lower bound, scaled so the midpoints' mean is the exact mean); the squared
        mean when there are no buckets."""
        mean = self.mean
        if mean is None:
            return None
        below, prev_bound, first, second, n = 0.0, 0.0, 0.0, 0.0, 0.0
        for bound, cumulative in self.buckets:
            k = max(cumulative - below, 0.0)
            below = max(below, cumulative)
            mid = prev_bound if math.isinf(bound) else (prev_bound + bound) / 2
            first, second, n = first + k * mid, second + k * mid * mid, n + k
            prev_bound = bound if not math.isinf(bound) else prev_bound
        if n <= 0 or first <= 0:
            return mean * mean
        ratio = mean / (first / n)
        return max(second / n * ratio * ratio, mean * mean)


EMPTY = HistogramDelta()


def _prefill_steps(
    iteration_tokens: HistogramDelta | None, batch: float, computed: float, variance: float = 0.0, prompts: float = 0.0
) -> tuple[float, float] | None:
    """Steps that carried prefill tokens, from `iteration_tokens_total`'s buckets: those above the first bound
    at or over twice the decode batch (a decode-only step computes one token per sequence); and how much
    larger the step a request sees is than the mean such step. A step holds k prompts of i.i.d. sizes (mean
    `computed`, variance `variance`): Var T = E[k]·variance + computed²·Var k, and a request, seeing its step
    with weight k, sees computed·E[k²]/E[k] = the mean step × (1 + Var k / E[k]²); E[k] is `prompts` over
    those steps (else E[T] / computed), at least 1; E[T], Var T at the buckets' midpoints. So 1 where each
    prompt ran alone whatever their sizes, E[T²]/E[T]² where equal prompts batch. None when that bound does
    not sit well below a prompt's computed tokens (short prompts in a large batch cannot be told from decode
    steps) or no step was above it."""
    if iteration_tokens is None or computed <= 0:
        return None
    buckets = iteration_tokens.buckets
    for i, (bound, cumulative) in enumerate(buckets):
        if bound >= 2 * batch:
            if math.isinf(bound) or bound > computed / 2:
                return None
            if (above := iteration_tokens.count - cumulative) < 1:
                return None
            n, first, second, below, low = 0.0, 0.0, 0.0, cumulative, bound
            for upper, cum in buckets[i + 1 :]:
                k = max(cum - below, 0.0)
                mid = low if math.isinf(upper) else (low + upper) / 2
                n, first, second = n + k, first + k * mid, second + k * mid * mid
                below, low = max(below, cum), upper
            if first <= 0:
                return above, 1.0
            mean = first / n
            each = max(1.0, prompts / above if prompts > 0 else mean / computed)  # E[k]
            each_var = max(second / n - mean * mean - each * max(variance, 0.0), 0.0) / (computed * computed)
            return above, 1.0 + each_var / (each * each)
    return None


@dataclass(frozen=True)
class EngineInterval:
    """What one instance's engine reported between two consecutive scrapes (vLLM 0.32's names)."""

    at: float
    """Time of the later scrape (seconds, the caller's monotonic clock)."""
    seconds: float
    """Since the earlier scrape."""
    prefill_time: HistogramDelta
    """vllm:request_prefill_time_seconds (first scheduling → first token)."""
    tpot: HistogramDelta
    """vllm:request_time_per_output_token_seconds."""
    prompt_tokens: HistogramDelta
    """vllm:request_prompt_tokens (full prompts, cached and pulled tokens included)."""
    generation_tokens: HistogramDelta = EMPTY
    """vllm:request_generation_tokens."""
    computed_tokens: HistogramDelta | None = None
    """vllm:request_prefill_kv_computed_tokens, where the engine reports it."""
    iteration_tokens: HistogramDelta | None = None
    """vllm:iteration_tokens_total (its count is the steps taken)."""
    queue_time: HistogramDelta | None = None
    """vllm:request_queue_time_seconds: reported, never fitted as work."""
    sampled_tokens: float | None = None
    """vllm:generation_tokens_total's increase (one per sequence per step that samples)."""
    local_share: float | None = None
    """Share of prompt tokens computed locally (vllm:prompt_tokens_by_source), when reported."""
    running: float = 0.0
    """vllm:num_requests_running, the mean of the two scrapes."""
    kv_tokens: float | None = None
    """vllm:kv_cache_usage_perc × the KV capacity in tokens, the mean of the two scrapes."""


@dataclass(frozen=True)
class TimedLeg:
    """A leg the gateway timed on this instance.

    prefill: the prefill leg (request sent → reply); decode: first token → last token of the
    decode leg; handoff: decode leg sent → first token (the KV transfer and the first step)."""

    kind: Literal["prefill", "decode", "handoff"]
    at: float
    seconds: float
    prompt_tokens: float
    computed_tokens: float | None = None
    """Prompt tokens the prefill computed (the prompt minus its cache hits); default the prompt."""
    output_tokens: float = 0.0
    in_flight: int = 0
    """Other legs in flight on the instance while this one ran: only uncontended legs (0) count."""


@dataclass(frozen=True)
class OnlineTerm:
    """One fitted term as the console shows it."""

    value: float
    prior: float
    source: str
    """"fit", "fit: clipped at 0 …" or "prior: <why it is not identified>"."""
    residual: float | None
    """Relative RMS residual of the regression it belongs to (None before any fit)."""
    samples: int
    """Rows in the window whose regressor for this term is non-zero."""
    age_s: float | None
    """Seconds since the newest of them (None: none yet)."""

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {
            "value": self.value,
            "prior": self.prior,
            "source": self.source,
            "residual": self.residual,
            "samples": self.samples,
            "age_s": self.age_s,
        }


@dataclass
class _Rows:
    """Rows of one regression: time, kind, regressors, target, requests behind it."""

    at: list[float] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)
    x: list[np.ndarray] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    count: list[float] = field(default_factory=list)

    def add(self, at: float, kind: str, x: np.ndarray, y: float, count: float) -> None:
        self.at.append(at)
        self.kind.append(kind)
        self.x.append(x)
        self.y.append(y)
        self.count.append(count)

    def keep(self, mask: list[bool]) -> None:
        for name in ("at", "kind", "x", "y", "count"):
            setattr(self, name, [v for v, k in zip(getattr(self, name), mask, strict=True) if k])

    def __len__(self) -> int:
        return len(self.y)


class OnlineFitter:
    """Fits one instance's step and KV terms from its engine's scrape intervals and the gateway's
    uncontended legs (see the module docstring); the prior keeps every term the data do not identify.

    Feed it with `observe` / `observe_leg` in time order; `terms(now)` and `profile(now)` refit
    when new rows arrived and the last fit is `refit_every_s` old (`fit(now)` refits at once)."""

    def __init__(
        self,
        prior: PerfProfile,
        *,
        half_life_s: float = HALF_LIFE_S,
        prior_weight: float = PRIOR_WEIGHT,
        min_rows: int = MIN_ROWS,
        refit_every_s: float = REFIT_EVERY_S,
    ) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be at least 0, got {prior_weight}")
        self.prior = prior
        self.half_life_s = half_life_s
        self.prior_weight = prior_weight
        self.min_rows = min_rows
        self.refit_every_s = refit_every_s
        self._step = _Rows()
        self._kv = _Rows()
        self._handoffs: list[tuple[float, float, float]] = []
        """(at, seconds, prompt tokens) of the uncontended hand-offs; targets depend on the step fit."""
        self._terms: dict[str, OnlineTerm] = {
            k: OnlineTerm(float(getattr(prior, k)), float(getattr(prior, k)), "prior: no samples yet", None, 0, None)
            for k in FITTED_TERMS
        }
        self._fitted_at: float | None = None
        self._dirty = False
        self.queue_s: float | None = None
        """Mean engine queue time (vllm:request_queue_time_seconds) of the latest interval that had
        requests: the engine's own waiting, which the fit never counts as work."""

    # --- rows ---------------------------------------------------------------------------------
    def observe(self, iv: EngineInterval) -> None:
        """Add one scrape interval's rows (none when nothing finished in it)."""
        if iv.queue_time is not None and iv.queue_time.mean is not None:
            self.queue_s = iv.queue_time.mean
        if iv.seconds <= 0:
            return
        full = iv.prompt_tokens.mean
        share = 1.0 if iv.local_share is None else min(max(iv.local_share, 0.0), 1.0)
        if iv.computed_tokens is not None and iv.computed_tokens.mean is not None:
            computed, square = iv.computed_tokens.mean, iv.computed_tokens.second_moment() or 0.0
        elif full is not None:
            computed, square = full * share, (iv.prompt_tokens.second_moment() or 0.0) * share * share
        else:
            computed, square = 0.0, 0.0
        steps = iv.iteration_tokens.count if iv.iteration_tokens is not None else 0.0
        if steps > 0 and iv.sampled_tokens is not None and iv.sampled_tokens > 0:
            batch = iv.sampled_tokens / steps
        else:
            batch = iv.running
        batch = max(batch, 1.0)
        if full is not None and iv.generation_tokens.mean is not None:
            kv = batch * (full + iv.generation_tokens.mean / 2)
        elif full is not None:
            kv = batch * full
        else:
            kv = iv.kv_tokens or 0.0
        prefills = iv.prefill_time.count
        local = full is not None and share >= 0.5 and computed >= 1.0
        if prefills <= 0 or not local:
            prefills, computed, square = 0.0, 0.0, 0.0
        budget = float(self.prior.max_num_batched_tokens)
        found = _prefill_steps(iv.iteration_tokens, max(batch, iv.running), computed, square - computed**2, prefills)
        prefill_steps, spread = found if found else (None, 1.0)
        if prefill_steps:
            per_step = min(prefills * computed / prefill_steps, budget)
        else:  # Little's law: the mean number of requests in their prefill phase, at least 1
            per_step = min(max(1.0, iv.prefill_time.total / iv.seconds) * computed, budget)
        if prefills > 0 and iv.prefill_time.mean is not None:
            seen = min(per_step * spread, budget)  # the prefill step a request sees, on average
            spans = max(1.0, computed / seen)  # a prompt larger than a step's share is chunked
            together = max(1.0, seen / computed)
            x = np.array([spans, spans * seen, spans * max(batch, together), spans, spans * kv, together * square])
            self._step.add(iv.at, "prefill", x, iv.prefill_time.mean, prefills)
        if iv.tpot.count > 0 and iv.tpot.mean is not None:
            mix = np.zeros(3)
            if steps > 0 and prefills > 0:
                # the decode tokens sampled in steps that also carried prefill chunks: those steps'
                # share, times the share of their batch that was decoding (not its own prefill)
                together = max(1.0, per_step / computed)
                with_prefill = min(1.0, (prefill_steps or prefills * computed / per_step) / steps)
                mixed = with_prefill * max(batch - together, 0.0) / batch
                mix = mixed * np.array([1.0, per_step, together * square])
            x = np.array([1.0, mix[1], batch, mix[0], kv, mix[2]])
            self._step.add(iv.at, "tpot", x, iv.tpot.mean, iv.tpot.count)
        self._dirty = True

    def observe_leg(self, leg: TimedLeg) -> None:
        """Add a gateway-timed leg if it ran uncontended (see the module docstring)."""
        if leg.in_flight > 0 or leg.seconds <= 0:
            return
        length = max(leg.prompt_tokens, 0.0)
        computed = length if leg.computed_tokens is None else max(leg.computed_tokens, 0.0)
        if leg.kind == "prefill":  # less its intake's host work, which came before its step
            x = np.array([1.0, computed, 1.0, 1.0, length, computed * computed])
            self._step.add(leg.at, "prefill leg", x, leg.seconds - self.prior.prefill_host_per_request_s, 1.0)
        elif leg.kind == "decode":
            if leg.output_tokens < 2:
                return
            x = np.array([1.0, 0.0, 1.0, 0.0, length + leg.output_tokens / 2, 0.0])
            self._step.add(leg.at, "decode leg", x, leg.seconds / (leg.output_tokens - 1), 1.0)
        else:
            self._handoffs.append((leg.at, leg.seconds, length))
        self._dirty = True

    # --- fitting ------------------------------------------------------------------------------
    def _weights(self, at: list[float], now: float) -> np.ndarray:
        age = np.maximum(now - np.asarray(at, dtype=float), 0.0)
        out: np.ndarray = 0.5 ** (age / self.half_life_s)
        return out

    def _forget(self, now: float) -> None:
        w = self._weights(self._step.at, now)
        keep = [bool(v >= MIN_WEIGHT) for v in w]
        if len(keep) > MAX_ROWS:
            keep = [k and i >= len(keep) - MAX_ROWS for i, k in enumerate(keep)]
        self._step.keep(keep)
        recent = self._handoffs[-MAX_ROWS:]
        weights = self._weights([h[0] for h in recent], now)
        self._handoffs = [h for h, w in zip(recent, weights, strict=True) if w >= MIN_WEIGHT]

    def _step_rows(self) -> list[int]:
        """The rows the step fit uses: gateway legs only where the engine reported no row of that kind."""
        kinds = set(self._step.kind)
        skip = {"prefill leg"} if "prefill" in kinds else set()
        if "tpot" in kinds:
            skip.add("decode leg")
        return [i for i, k in enumerate(self._step.kind) if k not in skip]

    def fit(self, now: float) -> None:
        """Refit every term from the rows in the window."""
        self._forget(now)
        rows = self._step_rows()
        priors = {k: float(getattr(self.prior, k)) for k in FITTED_TERMS}
        terms: dict[str, OnlineTerm] = {}
        x = np.array([self._step.x[i] for i in rows]).reshape(len(rows), len(STEP_TERMS))
        y = np.array([self._step.y[i] for i in rows])
        at = [self._step.at[i] for i in rows]
        count = np.array([self._step.count[i] for i in rows])
        step_fit = self._regress(x, y, at, count, STEP_TERMS, STEP_LABELS, "scrape interval", now)
        terms.update(self._report(step_fit, x, at, STEP_TERMS, STEP_LABELS, priors, now))
        base = max(terms["decode_step_base_s"].value, 1e-6)
        if base != terms["decode_step_base_s"].value:
            t = terms["decode_step_base_s"]
            why = t.source + " (raised to 1e-6 s: a step must take time)"
            terms["decode_step_base_s"] = OnlineTerm(base, t.prior, why, t.residual, t.samples, t.age_s)

        def step(b: float, k: float) -> float:
            return base + terms["decode_step_per_seq_s"].value * b + terms["decode_step_per_kv_token_s"].value * k

        hx = np.array([[1.0, h[2]] for h in self._handoffs]).reshape(len(self._handoffs), 2)
        hy = np.array([h[1] - step(1.0, h[2]) for h in self._handoffs])
        hat = [h[0] for h in self._handoffs]
        kv_fit = self._regress(hx, hy, hat, np.ones(len(hy)), KV_TERMS, KV_LABELS, "KV hand-off", now)
        terms.update(self._report(kv_fit, hx, hat, KV_TERMS, KV_LABELS, priors, now))
        self._terms = terms
        self._fitted_at = now
        self._dirty = False

    def _regress(
        self,
        x: np.ndarray,
        y: np.ndarray,
        at: list[float],
        count: np.ndarray,
        names: tuple[str, ...],
        labels: tuple[str, ...],
        what: str,
        now: float,
    ) -> LinearFit | None:
        """`fit_linear` over the columns that have a sample; None when none has."""
        cols = [j for j in range(len(names)) if len(y) and bool(np.any(x[:, j] != 0))]
        if not cols:
            return None
        priors = [float(getattr(self.prior, names[j])) for j in cols]
        # each row's expected scatter: the prior's prediction (errors are relative) over √requests
        predicted = np.maximum(x[:, cols] @ np.array(priors), 1e-9)
        return fit_linear(
            x[:, cols],
            y,
            [names[j] for j in cols],
            priors,
            [labels[j] for j in cols],
            what,
            "robust",
            min_samples=self.min_rows,
            scatter=predicted / np.sqrt(np.maximum(count, 1.0)),
            weights=self._weights(at, now),
            prior_weight=self.prior_weight,
            identified=IDENTIFIED_ONLINE,
        )

    @staticmethod
    def _report(
        fit: LinearFit | None,
        x: np.ndarray,
        at: list[float],
        names: tuple[str, ...],
        labels: tuple[str, ...],
        priors: dict[str, float],
        now: float,
    ) -> dict[str, OnlineTerm]:
        out = {}
        for j, name in enumerate(names):
            with_sample = [a for a, v in zip(at, x[:, j], strict=True) if v != 0] if len(at) else []
            age = now - max(with_sample) if with_sample else None
            term: Term | None = fit.terms.get(name) if fit is not None else None
            if term is None:
                why = f"prior: no samples of {labels[j]} yet"
                out[name] = OnlineTerm(priors[name], priors[name], why, None, 0, age)
                continue
            residual = None if term.rel_rms is None or not math.isfinite(term.rel_rms) else float(term.rel_rms)
            out[name] = OnlineTerm(float(term.value), priors[name], term.source, residual, len(with_sample), age)
        return out

    # --- reading ------------------------------------------------------------------------------
    def _fresh(self, now: float) -> None:
        if self._dirty and (self._fitted_at is None or now - self._fitted_at >= self.refit_every_s):
            self.fit(now)

    def terms(self, now: float) -> dict[str, OnlineTerm]:
        """Each fitted term (refitted first when due); ages as of `now`."""
        self._fresh(now)
        shift = 0.0 if self._fitted_at is None else now - self._fitted_at
        return {
            k: t if t.age_s is None else OnlineTerm(t.value, t.prior, t.source, t.residual, t.samples, t.age_s + shift)
            for k, t in self._terms.items()
        }

    def profile(self, now: float) -> PerfProfile:
        """The prior with the fitted terms substituted (its `fit` field holds each term's report).
        Once a decode term is fitted the prior's TPS(N) curve is dropped: TPS(N) then derives from
        the fitted step, as after `calibrate`."""
        terms = self.terms(now)
        decode_fitted = any(terms[k].source.startswith("fit") for k in STEP_TERMS if k.startswith("decode"))
        return PerfProfile.model_validate(
            {
                **self.prior.model_dump(),
                **{k: t.value for k, t in terms.items()},
                **({"tps_curve": None} if decode_fitted else {}),
                "fit": {k: t.as_dict() for k, t in terms.items()},
            }
        )

    def requests(self, now: float, window_s: float | None = None) -> dict[str, float]:
        """Per row kind ("prefill", "tpot", "prefill leg", "decode leg"), the requests behind the rows
        the fit weighs (those of the last `window_s` seconds if given): the evidence a fit or a
        correction measured over those rows rests on. A request finishing in an interval gives a row
        of each kind it reports, so kinds are not summed."""
        horizon = self.half_life_s * math.log2(1 / MIN_WEIGHT) if window_s is None else window_s
        out: dict[str, float] = {}
        for at, kind, count in zip(self._step.at, self._step.kind, self._step.count, strict=True):
            if now - at <= horizon:
                out[kind] = out.get(kind, 0.0) + count
        return out

    def measured_vs_projected(self, now: float, window_s: float = 30.0) -> dict[str, tuple[float, float, float]]:
        """Per row kind ("prefill": the engine's mean prefill time, "tpot": its mean time per output
        token; "prefill leg" / "decode leg" where the gateway's legs stand in), over the rows of the
        last `window_s` seconds: (measured, projected by the fitted terms, the part of that projection
        the terms left at their prior contribute), means weighted by requests."""
        terms = self.terms(now)
        theta = np.array([terms[k].value for k in STEP_TERMS])
        prior = np.array([0.0 if terms[k].source.startswith("fit") else terms[k].value for k in STEP_TERMS])
        rows = self._step
        out: dict[str, tuple[float, float, float]] = {}
        for kind in ("prefill", "tpot", "prefill leg", "decode leg"):
            idx = [
                i for i, (a, k) in enumerate(zip(rows.at, rows.kind, strict=True)) if k == kind and now - a <= window_s
            ]
            if idx:
                w = np.array([rows.count[i] for i in idx])
                measured = float(w @ np.array([rows.y[i] for i in idx]) / w.sum())
                projected = float(w @ np.array([rows.x[i] @ theta for i in idx]) / w.sum())
                out[kind] = (measured, projected, float(w @ np.array([rows.x[i] @ prior for i in idx]) / w.sum()))
        return out

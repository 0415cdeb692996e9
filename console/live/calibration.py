"""Online calibration in the live console: each instance's consecutive /metrics scrapes feed its own fitter.

`CalibrationFeed` keeps, per instance, the previous scrape and an `OnlineFitter`
(core/calibration/online.py). Each new scrape is read as deltas since the previous one (vLLM's
request histograms, `iteration_tokens_total`, the generation and prompt-by-source counters; an
engine restart reads as a counter reset, never as a negative delta) plus the mean of the two
scrapes' running and KV-usage gauges, and becomes one `EngineInterval` of the fitter. The
gateway's timed legs go to `observe_leg` (the fitter keeps only uncontended ones, and uses prefill
and decode legs only where the engine reports no histograms).

Wiring (for the controller): call `observe_scrape(instance_id, page_text)` with each /metrics page
the poller reads, `observe_leg` with the legs the gateway times, `forget(instance_id)` when an
instance leaves; read `snapshot()` for status / state / the dashboard, `profile_for(instance_id)`
for the projection and `requests` for the requests it rests on. Fits run at most every
`refit_every_s` per instance, when read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapters.vllm.scrape import (
    Histogram,
    counter_delta,
    histogram_delta,
    parse_metrics,
    read_counters,
    read_histograms,
)
from core.calibration.online import (
    HALF_LIFE_S,
    PRIOR_WEIGHT,
    REFIT_EVERY_S,
    EngineInterval,
    HistogramDelta,
    OnlineFitter,
    TimedLeg,
)
from core.perf import PerfProfile

HISTOGRAMS = {
    "prefill_time": "vllm:request_prefill_time_seconds",
    "queue_time": "vllm:request_queue_time_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "prompt_tokens": "vllm:request_prompt_tokens",
    "generation_tokens": "vllm:request_generation_tokens",
    "computed_tokens": "vllm:request_prefill_kv_computed_tokens",
    "iteration_tokens": "vllm:iteration_tokens_total",
}
"""The histograms read, by the `EngineInterval` field they fill (vLLM 0.32's names)."""
PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source"
GENERATION = "vllm:generation_tokens"


@dataclass(frozen=True)
class _Scrape:
    at: float
    histograms: dict[str, Histogram]
    generated: float | None
    by_source: dict[str, float]
    running: float
    kv_usage: float


class CalibrationFeed:
    """Per-instance online fitters fed from scrapes and timed legs.

    `prior`: the profile every instance starts from, or a function giving it per instance id (a
    pool's or role's profile). `half_life_s`, `prior_weight` and `refit_every_s` go to each
    `OnlineFitter`. Times are `time.monotonic()` unless given."""

    def __init__(
        self,
        prior: PerfProfile | Callable[[str], PerfProfile],
        *,
        half_life_s: float = HALF_LIFE_S,
        prior_weight: float = PRIOR_WEIGHT,
        refit_every_s: float = REFIT_EVERY_S,
    ) -> None:
        self._prior = prior
        self.half_life_s = half_life_s
        self.prior_weight = prior_weight
        self.refit_every_s = refit_every_s
        self._fitters: dict[str, OnlineFitter] = {}
        self._last: dict[str, _Scrape] = {}

    def _fitter(self, instance_id: str) -> OnlineFitter:
        fitter = self._fitters.get(instance_id)
        if fitter is None:
            prior = self._prior(instance_id) if callable(self._prior) else self._prior
            fitter = self._fitters[instance_id] = OnlineFitter(
                prior, half_life_s=self.half_life_s, prior_weight=self.prior_weight, refit_every_s=self.refit_every_s
            )
        return fitter

    def observe_scrape(self, instance_id: str, text: str, at: float | None = None) -> None:
        """One /metrics page of the instance; from its second page on, each adds an interval."""
        now = time.monotonic() if at is None else at
        sample = parse_metrics(text)
        generated = read_counters(text, [GENERATION]).get(GENERATION, {}).get("")
        scrape = _Scrape(
            now,
            read_histograms(text, HISTOGRAMS.values()),
            generated,
            read_counters(text, [PROMPT_BY_SOURCE], by="source").get(PROMPT_BY_SOURCE, {}),
            sample.running,
            sample.kv_usage,
        )
        fitter = self._fitter(instance_id)
        before = self._last.get(instance_id)
        self._last[instance_id] = scrape
        if before is None or now <= before.at:
            return
        fitter.observe(self._interval(before, scrape, fitter.prior))

    @staticmethod
    def _interval(before: _Scrape, after: _Scrape, prior: PerfProfile) -> EngineInterval:
        def delta(field: str) -> HistogramDelta | None:
            h = after.histograms.get(HISTOGRAMS[field])
            return None if h is None else histogram_delta(before.histograms.get(HISTOGRAMS[field]), h)

        def required(field: str) -> HistogramDelta:
            return delta(field) or HistogramDelta()

        sources = {k: counter_delta(before.by_source.get(k), v) for k, v in after.by_source.items()}
        prompt_total = sum(sources.values())
        local_share = sources.get("local_compute", 0.0) / prompt_total if prompt_total > 0 else None
        sampled = None if after.generated is None else counter_delta(before.generated, after.generated)
        return EngineInterval(
            at=after.at,
            seconds=after.at - before.at,
            prefill_time=required("prefill_time"),
            tpot=required("tpot"),
            prompt_tokens=required("prompt_tokens"),
            generation_tokens=required("generation_tokens"),
            computed_tokens=delta("computed_tokens"),
            iteration_tokens=delta("iteration_tokens"),
            queue_time=delta("queue_time"),
            sampled_tokens=sampled,
            local_share=local_share,
            running=(before.running + after.running) / 2,
            kv_tokens=(before.kv_usage + after.kv_usage) / 2 * prior.kv_capacity_tokens,
        )

    def observe_leg(self, instance_id: str, leg: TimedLeg) -> None:
        """A leg the gateway timed on the instance (see `TimedLeg`; contended legs are ignored)."""
        self._fitter(instance_id).observe_leg(leg)

    def forget(self, instance_id: str) -> None:
        """The instance left: drop its fitter and last scrape."""
        self._fitters.pop(instance_id, None)
        self._last.pop(instance_id, None)

    def snapshot(self, now: float | None = None) -> dict[str, dict[str, dict[str, Any]]]:
        """Per instance, per fitted term: value, prior, source ("fit…" or "prior: why"), residual
        (relative RMS of its regression), samples and age_s (of its newest sample)."""
        t = time.monotonic() if now is None else now
        return {i: {k: v.as_dict() for k, v in f.terms(t).items()} for i, f in self._fitters.items()}

    def profile_for(self, instance_id: str, now: float | None = None) -> PerfProfile:
        """The instance's prior with its fitted terms substituted (the prior alone before any scrape)."""
        return self._fitter(instance_id).profile(time.monotonic() if now is None else now)

    def queue_time_s(self, instance_id: str) -> float | None:
        """The engine's own mean queue time over the latest interval with requests (not work)."""
        fitter = self._fitters.get(instance_id)
        return None if fitter is None else fitter.queue_s

    def requests(self, instance_id: str, now: float | None = None, window_s: float | None = None) -> dict[str, float]:
        """Per kind of interval, the requests behind the instance's rows (`OnlineFitter.requests`: all
        the fit weighs, or those of the last `window_s` seconds; empty before any data)."""
        fitter = self._fitters.get(instance_id)
        t = time.monotonic() if now is None else now
        return {} if fitter is None else fitter.requests(t, window_s)

    def check(
        self, instance_id: str, now: float | None = None, window_s: float = 30.0
    ) -> dict[str, tuple[float, float, float]]:
        """What the engine measured against what the fitted terms project (and the part of it the
        terms left at their prior contribute), per kind of interval, over the last `window_s` seconds
        (`OnlineFitter.measured_vs_projected`; empty before any data)."""
        fitter = self._fitters.get(instance_id)
        t = time.monotonic() if now is None else now
        return {} if fitter is None else fitter.measured_vs_projected(t, window_s)

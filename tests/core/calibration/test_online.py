"""The online fitter on constructed scrape intervals: a wrong prior converges, an unidentified term
keeps its prior and says why, forgetting follows a changed engine, the fit never goes negative."""

from __future__ import annotations

import numpy as np
import pytest

from adapters.emulator.metrics import buckets_pow2
from core.calibration.online import (
    FITTED_TERMS,
    EngineInterval,
    HistogramDelta,
    OnlineFitter,
    TimedLeg,
    _prefill_steps,
)
from core.perf import PerfProfile

TRUE = PerfProfile(
    name="true",
    prefill_base_s=0.003,
    prefill_per_token_s=2e-5,
    decode_step_base_s=0.004,
    decode_step_per_seq_s=2e-4,
    decode_step_per_kv_token_s=0.0,
    kv_transfer_base_s=0.01,
    kv_transfer_per_token_s=1e-5,
    kv_capacity_tokens=200_000,
    max_model_len=4096,
)
SLOW = ("prefill_base_s", "prefill_per_token_s", "decode_step_base_s", "decode_step_per_seq_s", "kv_transfer_base_s")
PRIOR = TRUE.model_copy(update={"name": "prior", **{k: 10 * getattr(TRUE, k) for k in SLOW}})
BOUNDS = (*buckets_pow2(16384), float("inf"))


def interval(
    p: PerfProfile, at: float, batch: int, prompt: int, output: int, requests: int, rng: np.random.Generator
) -> EngineInterval:
    """An interval of an engine that ran `steps` steps of `batch` sequences, `requests` of them
    prefilling alone (one prompt per step) and finishing; times as the step model gives them, with
    3% scatter. The iteration histogram's buckets hold the decode steps (batch tokens) and the
    prefill steps (prompt + batch tokens)."""
    steps = 200
    kv = batch * (prompt + output / 2)
    step = p.step_time(batch, kv)
    prefill = step + float(p.prefill_time(prompt))
    mixed = requests / steps * (batch - 1) / batch
    tpot = step + mixed * float(p.prefill_time(prompt))
    buckets = tuple(
        (b, float(steps - requests) * (b >= batch) + float(requests) * (b >= prompt + batch)) for b in BOUNDS
    )

    def noisy(v: float) -> float:
        return v * (1 + 0.03 * float(rng.standard_normal()))

    return EngineInterval(
        at=at,
        seconds=steps * step,
        prefill_time=HistogramDelta(requests, requests * noisy(prefill)),
        tpot=HistogramDelta(requests, requests * noisy(tpot)),
        prompt_tokens=HistogramDelta(requests, requests * prompt),
        generation_tokens=HistogramDelta(requests, requests * output),
        iteration_tokens=HistogramDelta(steps, steps * batch + requests * prompt, buckets),
        queue_time=HistogramDelta(requests, requests * 0.5),
        sampled_tokens=float(steps * batch),
        running=float(batch),
    )


def varied(fitter: OnlineFitter, p: PerfProfile, start: float, n: int, seed: int, dt: float = 0.5) -> float:
    rng = np.random.default_rng(seed)
    for i in range(n):
        fitter.observe(
            interval(p, start + i * dt, int(rng.integers(1, 33)), int(rng.integers(32, 2048)), 64, 4, rng)
        )
    return start + n * dt


def test_a_prior_ten_times_too_slow_converges_within_a_few_dozen_intervals() -> None:
    fitter = OnlineFitter(PRIOR)
    now = varied(fitter, TRUE, 0.0, 36, seed=1)
    fitter.fit(now)
    terms = fitter.terms(now)
    for k in ("decode_step_base_s", "decode_step_per_seq_s", "prefill_per_token_s"):
        assert terms[k].source == "fit", (k, terms[k])
        assert terms[k].value == pytest.approx(getattr(TRUE, k), rel=0.2), k
        assert terms[k].prior == getattr(PRIOR, k)
    prof = fitter.profile(now)
    for tokens in (64, 512, 2000):
        assert float(prof.prefill_time(tokens)) + prof.step_time(1, tokens) == pytest.approx(
            float(TRUE.prefill_time(tokens)) + TRUE.step_time(1, tokens), rel=0.1
        )
    for batch in (1, 8, 32):
        assert prof.step_time(batch, batch * 1000) == pytest.approx(TRUE.step_time(batch, batch * 1000), rel=0.1)
    assert terms["decode_step_base_s"].samples == 72  # a prefill and a TPOT row per interval
    assert terms["decode_step_base_s"].residual is not None and terms["decode_step_base_s"].residual < 0.1
    assert terms["decode_step_base_s"].age_s == pytest.approx(0.5)
    assert fitter.queue_s == 0.5  # reported, never fitted as work
    # no hand-off yet: the KV terms keep their prior and say so
    assert terms["kv_transfer_base_s"].value == PRIOR.kv_transfer_base_s
    assert terms["kv_transfer_base_s"].source.startswith("prior: no samples")


def test_a_term_the_data_cannot_identify_keeps_its_prior_and_says_why() -> None:
    """One prompt length and one output length: resident KV is the batch times a constant, so its
    cost cannot be told from the batch's."""
    prior = PRIOR.model_copy(update={"decode_step_per_kv_token_s": 1e-6})
    fitter = OnlineFitter(prior)
    rng = np.random.default_rng(2)
    for i in range(40):
        fitter.observe(interval(TRUE, i * 0.5, int(rng.integers(1, 33)), 512, 64, 4, rng))
    terms = fitter.terms(20.0)
    kv = terms["decode_step_per_kv_token_s"]
    assert kv.value == kv.prior == 1e-6
    assert kv.source.startswith("prior: ") and "resident KV tokens" in kv.source, kv.source
    # the prompt length never varies either: its cost per token cannot be told from the constant
    assert terms["prefill_per_token_s"].source.startswith("prior: "), terms["prefill_per_token_s"].source
    assert fitter.profile(20.0).decode_step_per_kv_token_s == 1e-6


def test_forgetting_lets_a_changed_engine_reconverge() -> None:
    fitter = OnlineFitter(PRIOR, half_life_s=10.0)
    now = varied(fitter, TRUE, 0.0, 40, seed=3, dt=1.0)
    fitter.fit(now)
    assert fitter.terms(now)["decode_step_base_s"].value == pytest.approx(TRUE.decode_step_base_s, rel=0.2)
    slower = TRUE.model_copy(update={k: 2 * getattr(TRUE, k) for k in SLOW})
    now = varied(fitter, slower, now, 60, seed=4, dt=1.0)
    fitter.fit(now)
    prof = fitter.profile(now)
    for batch in (1, 16):
        assert prof.step_time(batch, batch * 1000) == pytest.approx(slower.step_time(batch, batch * 1000), rel=0.1)
    assert float(prof.prefill_time(1000)) == pytest.approx(float(slower.prefill_time(1000)), rel=0.15)


def test_uncontended_gateway_legs_fit_where_the_engine_reports_nothing() -> None:
    """An upstream without vLLM's histograms: prefill legs, decode legs and KV hand-offs the gateway
    timed alone fit the terms; a contended leg (its time includes waiting) is ignored."""
    fitter = OnlineFitter(PRIOR)
    rng = np.random.default_rng(5)
    for i in range(40):
        at = i * 0.5
        length = float(rng.integers(32, 2048))
        alone = TRUE.step_time(1, length)
        fitter.observe_leg(TimedLeg("prefill", at, alone + float(TRUE.prefill_time(length)), length))
        fitter.observe_leg(TimedLeg("decode", at, 63 * alone, length, output_tokens=64))
        fitter.observe_leg(TimedLeg("handoff", at, alone + TRUE.kv_transfer_time(length), length))
        fitter.observe_leg(TimedLeg("prefill", at, 50.0, length, in_flight=3))  # waited: never fitted
    terms = fitter.terms(20.0)
    assert terms["prefill_per_token_s"].value == pytest.approx(TRUE.prefill_per_token_s, rel=0.1)
    assert terms["kv_transfer_per_token_s"].value == pytest.approx(TRUE.kv_transfer_per_token_s, rel=0.1)
    prof = fitter.profile(20.0)
    assert prof.kv_transfer_time(1000) == pytest.approx(TRUE.kv_transfer_time(1000), rel=0.1)
    assert float(prof.prefill_time(1000)) + prof.step_time(1, 1000) == pytest.approx(
        float(TRUE.prefill_time(1000)) + TRUE.step_time(1, 1000), rel=0.1
    )


def test_a_gateway_prefill_leg_is_fitted_less_its_intake() -> None:
    """An uncontended prefill leg holds the prompt's intake (host work before its step, 5 ms here, the
    prior's `prefill_host_per_request_s`): the fitted prefill and step leave it out (18% of a 1,000-token leg)."""
    h = 0.005
    fitter = OnlineFitter(PRIOR.model_copy(update={"prefill_host_per_request_s": h}))
    rng = np.random.default_rng(5)
    for i in range(40):
        length = float(rng.integers(32, 2048))
        alone = TRUE.step_time(1, length)
        fitter.observe_leg(TimedLeg("prefill", i * 0.5, h + alone + float(TRUE.prefill_time(length)), length))
        fitter.observe_leg(TimedLeg("decode", i * 0.5, 63 * alone, length, output_tokens=64))
    prof = fitter.profile(20.0)
    assert float(prof.prefill_time(1000)) + prof.step_time(1, 1000) == pytest.approx(
        float(TRUE.prefill_time(1000)) + TRUE.step_time(1, 1000), rel=0.1
    )


def test_requests_count_the_requests_behind_each_kind_of_row_in_the_window() -> None:
    """The evidence a fit or a correction rests on: 4 requests an interval give 4 prefill and 4 tpot
    requests each (not 8); a window keeps the recent rows; the prefill legs count apart."""
    fitter = OnlineFitter(PRIOR)
    assert fitter.requests(0.0) == {}
    now = varied(fitter, TRUE, 0.0, 5, seed=2, dt=10.0)  # rows at 0, 10, ..., 40 s (now 50 s), 4 requests each
    fitter.observe_leg(TimedLeg("prefill", 45.0, 0.05, 300.0))
    fitter.observe_leg(TimedLeg("prefill", 46.0, 0.05, 300.0, in_flight=1))  # contended: no row
    assert fitter.requests(now) == {"prefill": 20.0, "tpot": 20.0, "prefill leg": 1.0}
    assert fitter.requests(now, window_s=25.0) == {"prefill": 8.0, "tpot": 8.0, "prefill leg": 1.0}  # 30, 40 s
    assert fitter.requests(now + 3000.0) == {}  # ~25 half-lives later the fit weighs none of them


def test_before_any_fit_the_profile_is_the_prior_and_every_term_says_so() -> None:
    fitter = OnlineFitter(PRIOR)
    terms = fitter.terms(0.0)
    assert {k: t.value for k, t in terms.items()} == {k: getattr(PRIOR, k) for k in FITTED_TERMS}
    assert all(t.source == "prior: no samples yet" and t.samples == 0 and t.age_s is None for t in terms.values())
    prof = fitter.profile(0.0)
    assert all(getattr(prof, k) == getattr(PRIOR, k) for k in FITTED_TERMS)
    with pytest.raises(ValueError):
        OnlineFitter(PRIOR, half_life_s=0)


def test_bucket_second_moment_is_scaled_to_the_exact_mean() -> None:
    h = HistogramDelta(4, 4 * 30.0, ((10.0, 0.0), (50.0, 4.0), (float("inf"), 4.0)))
    assert h.mean == 30.0
    assert h.second_moment() == pytest.approx(900.0)  # all in one bucket: E[x²] = mean²
    assert HistogramDelta().mean is None and HistogramDelta().second_moment() is None


def test_the_step_a_request_sees_is_its_own_when_prompts_ran_alone_and_size_biased_when_steps_batch_many() -> None:
    """Ten prefill steps of 200 tokens and ten of 1,800 (bucket midpoints), no decode batch.
    - Each a prompt of its own, prompts of 200 and 1,800 tokens (mean 1,000, variance 640,000): the
      steps' spread is all the prompts' own, so k = 1 always and a request saw the mean step, spread 1
      (weighing steps by their tokens said E[T²]/E[T]² = 1.64).
    - Equal 100-token prompts, 10 a step on average: the steps held 2 and 18, every request's step
      size-biased, E[k²]/E[k]² = (2² + 18²)/2 / 10² = 1.64.
    - Prompts of mean 100 and variance 10,000, 10 a step: Var k = (Var T − 10·10,000)/100² = 54,
      spread 1 + 54/10² = 1.54."""
    bounds = ((0.0, 0.0), (100.0, 0.0), (300.0, 10.0), (1700.0, 10.0), (1900.0, 20.0), (float("inf"), 20.0))
    steps = HistogramDelta(20, 10 * 200 + 10 * 1800, bounds)
    alone = _prefill_steps(steps, 0.0, 1000.0, variance=640_000.0, prompts=20)
    assert alone is not None and alone[0] == 20 and alone[1] == pytest.approx(1.0)
    assert _prefill_steps(steps, 0.0, 1000.0, prompts=20) == (20, pytest.approx(1.64))  # sizes unknown: all k's
    equal = _prefill_steps(steps, 0.0, 100.0, prompts=200)
    assert equal is not None and equal[1] == pytest.approx(1.64)
    varied = _prefill_steps(steps, 0.0, 100.0, variance=10_000.0, prompts=200)
    assert varied is not None and varied[1] == pytest.approx(1.54)
    by_tokens = _prefill_steps(steps, 0.0, 100.0)  # no count of prompts: E[k] from the steps' mean tokens
    assert by_tokens is not None and by_tokens[1] == pytest.approx(1.64)

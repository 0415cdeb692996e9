"""What SLO admission learns, on constructed sequences: the TTFT correction follows as far as its samples
back it, in log space; a constant own-service error is fitted as a line; the decode slots grow and
shrink by what is measured and reported."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.admission_signals import DecodeSlots, OwnServiceLine, StepJoiners, TtftDrift, TtftDrifts
from core.step_terms import StepTerms
from tests.helpers import toy_profile


def test_each_sample_backs_a_factor_of_root_two_until_the_correction_is_free() -> None:
    drift = TtftDrift()
    ratios, settled = [], []
    for _ in range(16):
        drift.observe(0, 1.0, 0.01)  # the engine is 100× faster than projected
        ratios.append(float(drift.of(1)[0]))
        settled.append(drift.settled(0))
    assert ratios[:3] == pytest.approx([2**-0.5, 2**-1.0, 2**-1.5])
    assert settled.index(True) == 13  # 13 samples back 2^6.5 ≈ 91× at most, 14 back 128×
    assert ratios[-1] == pytest.approx(0.01)


def test_one_outlier_moves_the_correction_by_a_factor_not_to_it() -> None:
    drift = TtftDrift()
    for _ in range(40):
        drift.observe(0, 0.5, 0.5)
    drift.observe(0, 0.5, 50.0)  # one request 100× late
    assert float(drift.of(1)[0]) == pytest.approx(math.exp(0.05 * math.log(100)))  # ×1.26
    assert drift.settled(0)


def test_an_instance_with_no_samples_is_projected_as_is_and_not_settled() -> None:
    drift = TtftDrift()
    drift.observe(1, 0.0, 0.3)  # nothing projected: ignored
    assert list(drift.of(3)) == [1.0, 1.0, 1.0] and not drift.settled(1) and not drift.settled(7)


def test_decode_slots_grow_only_while_they_hold_arrivals_back_and_tpot_is_within_target() -> None:
    slots = DecodeSlots(10, 256, fixed=False, grow_below=0.8)
    for k in range(8):
        slots.observe(0.05, 0.1, False, float(k))
    assert slots.value == 10  # not what held anything back
    slots.limited = True
    slots.observe(0.05, 0.1, False, 8.0)
    slots.observe(0.45, 0.1, False, 9.0)  # the recent mean (0.09 s) within target, past 0.8 × it: no growth
    assert slots.value == 11 and slots.tpot_s == pytest.approx(0.09) and not slots.past_target()
    slots.observe(0.5, 0.1, False, 10.0)  # the mean past its target: cut
    assert slots.past_target() and slots.value == pytest.approx(0.8 * 11)


def test_decode_slots_stop_at_max_num_seqs_and_never_move_when_fixed() -> None:
    slots = DecodeSlots(250, 256, fixed=False, grow_below=0.8)
    slots.limited = True
    for k in range(30):
        slots.observe(0.01, 0.1, False, float(k))
    assert slots.value == 256
    slots.observe(0.01, 0.1, True, 31.0)  # an engine reports a queue
    assert slots.value == pytest.approx(0.8 * 256)
    fixed = DecodeSlots(4, 256, fixed=True, grow_below=0.8)
    fixed.limited = True
    for k in range(30):
        fixed.observe(0.01 if k < 20 else 1.0, 0.1, k == 25, float(k))
    assert int(fixed) == 4 and fixed.past_target()


def test_a_constant_own_service_error_is_fitted_as_a_constant_not_stretched_over_a_long_prompt() -> None:
    """Idle-routed prompts projected 0.2–1.5 s came out 9 ms late each (as measured on emulated
    1P1D): the line takes a = 9 ms, r = 1, so a 1.8 s prompt is projected 1.809 s; the ratio alone
    (the mean of log(measured / projected), 1.014 here) would have put it 17 ms later."""
    drifts = TtftDrifts()
    xs = np.linspace(0.2, 1.5, 24)
    for x in xs:
        drifts.observe(0, float(x), float(x) + 0.009)
    ratio = float(np.exp(np.mean(np.log((xs + 0.009) / xs))))
    assert float(drifts.own.ratio[0]) == pytest.approx(ratio, rel=0.01)
    own_r, wait_r, own_a = drifts.ratios(1)
    assert float(own_r[0]) == pytest.approx(1.0, abs=1e-6) and float(own_a[0]) == pytest.approx(0.009, abs=1e-6)
    assert 1.8 * float(own_r[0]) + float(own_a[0]) == pytest.approx(1.809)
    assert 1.8 * ratio > 1.809 + 0.015
    assert drifts.extremes()["ttft_own_constant_max_s"] == pytest.approx(0.009, abs=1e-4)
    # the queue's part: 0.5 s projected past the own 0.3 s, measured 1.0 s: (1.0 − 0.309) / 0.5
    drifts.observe(0, 0.8, 1.0, own_s=0.3)
    assert float(drifts.wait.ratio[0]) == pytest.approx((1.0 - 0.309) / 0.5, rel=1e-6)


def test_without_spread_in_the_projections_the_ratio_stands() -> None:
    """Eight prompts of one size identify no slope: the own service keeps its ratio and no constant;
    a prior ten times too slow, over prompts of many sizes, gives the line's slope (0.1)."""
    same = TtftDrifts()
    for _ in range(12):
        same.observe(0, 0.4, 0.44)
    own_r, _, own_a = same.ratios(1)
    assert float(own_r[0]) == pytest.approx(1.1) and float(own_a[0]) == 0.0
    slow_prior = TtftDrifts()
    for x in np.linspace(0.5, 5.0, 30):
        slow_prior.observe(0, float(x), 0.1 * float(x) + 0.005)
    own_r, _, own_a = slow_prior.ratios(1)
    assert float(own_r[0]) == pytest.approx(0.1, rel=1e-6) and float(own_a[0]) == pytest.approx(0.005, abs=1e-6)
    line = OwnServiceLine()
    for _ in range(7):
        line.observe(0, 0.5 + _ * 0.2, 0.6)
    assert not line.lines(2)[2].any()  # fewer than min_samples on instance 0, nothing on 1


def test_the_prompts_expected_to_join_a_step_are_the_routed_rate_times_the_wait_for_it_within_its_room() -> None:
    """Two prompts routed to instance 0 at 0 s and 10 s, none to 1: the rate decays over tau (10 s),
    counted from the first prompt (which opens the span, over the part of the window it covers); a
    step starting 0.5 s from now is expected to take rate × 0.5 s typical prompts, each its sequence,
    host and chunk cost, and no more than the budget and the slots leave beside the request's own."""
    joiners = StepJoiners(tau_s=10.0)
    joiners.routed(0, 0.0)
    joiners.routed(0, 10.0)
    level = math.exp(-1.0) + 1.0
    rate = (level - math.exp(-1.0)) / 10.0 / (1.0 - math.exp(-1.0))  # the second prompt over 10 s of the window
    assert [joiners.rate(0, 10.0), joiners.rate(1, 10.0)] == pytest.approx([rate, 0.0])
    later = (level * math.exp(-1.0) - math.exp(-2.0)) / 10.0 / (1.0 - math.exp(-2.0))
    assert joiners.rate(0, 20.0) == pytest.approx(later)
    terms = StepTerms.of(toy_profile(decode_step_per_seq_s=0.001, prefill_per_token_s=1e-4, prefill_per_token2_s=1e-8,
                                     max_num_batched_tokens=2048, max_num_seqs=8))
    each = 0.001 + terms.host + 1e-4 * 200 + 1e-8 * 200**2
    assert joiners.each_s(terms, 200.0) == pytest.approx(each)
    both = np.array([0, 1])
    at_10 = joiners.expected_s(both, np.array([0.5, 0.5]), 10.0, terms, 200.0, 100.0)
    assert at_10 == pytest.approx([rate * 0.5 * each, 0.0])
    assert joiners.expected_one(0, 0.5, 10.0, terms, 200.0, 100.0) == pytest.approx(rate * 0.5 * each)
    assert joiners.expected_s(both, np.array([-0.3, 0.5]), 10.0, terms, 200.0, 100.0) == pytest.approx([0.0, 0.0])
    assert joiners.expected_one(0, -0.3, 10.0, terms, 200.0, 100.0) == 0.0  # its step has started: nobody joins
    assert joiners.expected_one(0, 100.0, 10.0, terms, 200.0, 100.0) == pytest.approx(7 * each)  # 8 slots, 1 its own
    assert joiners.expected_one(0, 100.0, 10.0, terms, 200.0, 1848.0) == pytest.approx(each)  # 200 tokens left
    joiners.routed(0, 10.0 + StepJoiners.REBASE_S + 1.0)  # the origin moves; the rate is as before
    assert joiners.origin == 10.0 + StepJoiners.REBASE_S + 1.0
    before = level * math.exp(-(StepJoiners.REBASE_S + 1) / 10)
    assert joiners.rate(0, joiners.origin) == pytest.approx(before / 10 + 0.1)


def test_the_rate_of_a_stream_just_begun_is_its_rate_not_a_ramp_from_nothing() -> None:
    """Prompts every 0.5 s from t = 0: at 1, 2 and 4 s the rate reads 2/s within the spacing's error
    (the weights divided by all of a 10 s window read 0.18, 0.36, 0.68/s); a second prompt 0.1 s after
    the first is counted over `MIN_SPAN_S`, not 0.1 s; at 100 s, long past tau, it reads the same."""
    joiners = StepJoiners(tau_s=10.0)
    t = 0.0
    for at in (1.0, 2.0, 4.0, 100.0):
        while t <= at:
            joiners.routed(0, t)
            t += 0.5
        assert joiners.rate(0, at) == pytest.approx(2.0, rel=0.06)
        assert joiners.rates(np.array([0]), at) == pytest.approx([joiners.rate(0, at)])
    fresh = StepJoiners(tau_s=10.0)
    fresh.routed(0, 0.0)
    fresh.routed(0, 0.1)
    assert fresh.rate(0, 0.1) == pytest.approx(1.0 / 10.0 / (1.0 - math.exp(-StepJoiners.MIN_SPAN_S / 10.0)))


def test_many_instances_expect_their_joiners_in_arrays_as_a_few_do_one_by_one() -> None:
    """The expectation over arrays (admission's, past SMALL_POOL instances) is the same as one at a time."""
    joiners = StepJoiners(tau_s=10.0)
    rng = np.random.default_rng(5)
    for t in np.sort(rng.uniform(0.0, 20.0, 200)):
        joiners.routed(int(rng.integers(0, 12)), float(t))
    terms = StepTerms.of(
        toy_profile(decode_step_per_seq_s=0.001, prefill_per_token_s=1e-4, max_num_batched_tokens=4096)
    )
    where = np.arange(12)
    until = rng.uniform(-0.2, 1.0, 12)
    tokens = rng.uniform(50.0, 3000.0, 12)
    many = joiners.expected_s(where, until, 20.0, terms, 300.0, tokens)
    assert len(where) > StepJoiners.SMALL_POOL
    one = [joiners.expected_one(p, float(until[p]), 20.0, terms, 300.0, float(tokens[p])) for p in range(12)]
    assert many == pytest.approx(one) and (many[until <= 0] == 0).all() and (many > 0).sum() >= 4

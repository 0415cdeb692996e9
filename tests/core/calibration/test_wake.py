"""The wake-up cost of an idle instance, fitted from constructed request records."""

from __future__ import annotations

import math
from typing import Any

import pytest

from core.calibration.wake import MIN_ROWS, fit_wake, idle_residuals
from tests.helpers import toy_profile

PROFILE = toy_profile(
    prefill_base_s=0.01,
    prefill_per_token_s=0.0002,
    decode_step_base_s=0.004,
    decode_step_per_seq_s=0.001,
    kv_transfer_base_s=0.003,
    kv_transfer_per_token_s=1e-5,
    prefill_host_per_request_s=0.003,
)
"""The run's fitted legs (no wake-up cost), with an intake of 3 ms per prompt at the prefill instance."""
PRIOR = toy_profile(idle_wake_s=0.005, idle_wake_tau_s=3.0)
"""The terms a run that does not identify the cost keeps."""
RTT = {"p0": 0.0015, "d0": 0.0025}
WAKE = toy_profile(idle_wake_s=0.02, idle_wake_tau_s=1.0)
"""The truth: M = 20 ms, τ = 1 s."""
GAPS = (0.1, 0.2, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 3.0, 4.0, 5.0, 6.0)
"""Idle seconds before each prefill leg, cycled."""


def noise(k: int) -> float:
    """A small deterministic disturbance (±1 ms), different for each request."""
    return 0.001 * math.sin(2.7 * k + 0.4)


def records(n: int, wake: float = WAKE.idle_wake_s, gaps: tuple[float, ...] = GAPS) -> list[dict[str, Any]]:
    """n requests through one prefill and one decode instance, one at a time. Each arrives at the
    prefill instance a gap after the previous prefill ended; its prefill leg is the HTTP round trip,
    its intake, the step it runs in, the prefill of its uncached tokens, 2 ms the fit of the legs
    left over and the wake-up cost of that gap; it reaches the decode instance 1 ms after its prefill, which has
    idled since the previous request finished, and its hand-off (first token − decode start) is
    both round trips, the KV transfer, its first step, 1 ms left over and the decode instance's
    wake-up. Every leg carries `noise`."""
    prof = WAKE.model_copy(update={"idle_wake_s": wake})
    rows: list[dict[str, Any]] = []
    prefill_end, finish = 0.0, 0.0
    for k in range(n):
        prompt, cached = 100 + 37 * (k % 9), 16 * (k % 3)
        start = prefill_end + gaps[k % len(gaps)]
        intake = PROFILE.prefill_host_per_request_s
        leg = RTT["p0"] + intake + PROFILE.step_time(1, prompt) + float(PROFILE.prefill_time(prompt - cached)) + 0.002
        prefill_end = start + leg + (prof.wake_time(start - rows[-1]["prefill_end"]) if rows else 0.0) + noise(k)
        decode_start = prefill_end + 0.001
        handoff = RTT["d0"] + RTT["p0"] + PROFILE.kv_transfer_time(prompt) + PROFILE.step_time(1, prompt) + 0.001
        first = decode_start + handoff + (prof.wake_time(decode_start - finish) if rows else 0.0) - noise(k + 50)
        finish = first + 0.05
        rows.append(
            {
                "request_id": str(k),
                "prefill_instance": "p0",
                "decode_instance": "d0",
                "prefill_start": start,
                "prefill_end": prefill_end,
                "decode_start": decode_start,
                "first_token": first,
                "finish": finish,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "status": "ok",
            }
        )
    return rows


def test_the_idle_legs_give_their_idle_time_and_what_the_legs_leave_unexplained() -> None:
    rows = records(5)
    gaps, resid, legs = idle_residuals(rows, PROFILE, RTT)
    assert legs.tolist() == [0] * 4 + [1] * 4  # the first request found nothing before it
    assert gaps[:4] == pytest.approx(list(GAPS[1:5]), abs=1e-12)
    for k in range(1, 5):
        assert resid[k - 1] == pytest.approx(0.002 + WAKE.wake_time(GAPS[k]) + noise(k), abs=1e-12)
        idle_d = rows[k]["decode_start"] - rows[k - 1]["finish"]
        assert gaps[3 + k] == pytest.approx(idle_d, abs=1e-12)
        assert resid[3 + k] == pytest.approx(0.001 + WAKE.wake_time(idle_d) - noise(k + 50), abs=1e-12)


def test_a_leg_that_overlapped_another_on_its_instance_is_not_an_idle_one() -> None:
    """The third request reaches the prefill instance before the second's prefill ended: neither the
    second (not alone there) nor the third (the instance was busy) found it idle; the fourth and
    fifth did, each idle since the previous end. The decode instance saw no overlap: all four of its
    legs count."""
    rows = records(5)
    rows[2]["prefill_start"] = rows[1]["prefill_end"] - 0.001
    gaps, _, legs = idle_residuals(rows, PROFILE, RTT)
    assert legs.tolist() == [0, 0] + [1] * 4
    assert gaps[:2] == pytest.approx(
        [rows[3]["prefill_start"] - rows[2]["prefill_end"], rows[4]["prefill_start"] - rows[3]["prefill_end"]]
    )
    assert gaps[:2] == pytest.approx(list(GAPS[3:5]))
    # a request that had not finished when the next reached the decode instance: the next is skipped
    rows = records(5)
    rows[1]["finish"] = rows[2]["decode_start"] + 0.01
    _, _, legs = idle_residuals(rows, PROFILE, RTT)
    assert legs.tolist() == [0] * 4 + [1] * 3


def test_the_wake_up_cost_and_its_time_constant_are_recovered() -> None:
    fit = fit_wake(records(60), PROFILE, RTT, PRIOR)
    cost, tau = fit.terms["idle_wake_s"], fit.terms["idle_wake_tau_s"]
    assert cost.source.startswith("fit: ") and tau.source == cost.source, cost.source
    assert cost.value == pytest.approx(0.02, rel=0.15)
    assert tau.value == 1.0
    assert cost.prior == PRIOR.idle_wake_s and tau.prior == PRIOR.idle_wake_tau_s
    assert fit.samples == 118 and cost.rel_se is not None and cost.rel_se < 0.1


def test_a_run_without_a_wake_up_cost_rejects_a_prior_that_has_one() -> None:
    """No wake-up in the run: the cost cannot be told from zero, but the prior's 5 ms lies many
    standard errors above what the run allows, so the run's small estimate replaces it (idle times
    up to 10 s, and up to 6 s, where the noise picks the time constant)."""
    for gaps in ((*GAPS, 10.0), GAPS):
        fit = fit_wake(records(60, wake=0.0, gaps=gaps), PROFILE, RTT, PRIOR)
        cost = fit.terms["idle_wake_s"]
        assert 0.0 <= cost.value < 0.0005, cost
        assert cost.source.startswith("fit: small, ") and "standard errors from the prior 5.0 ms" in cost.source
        assert cost.prior == PRIOR.idle_wake_s


def test_a_run_that_cannot_tell_a_small_prior_from_zero_keeps_the_prior_and_says_why() -> None:
    """No wake-up in the run and a prior of 0.3 ms, within the run's uncertainty: not identified, the prior stays."""
    prior = PRIOR.model_copy(update={"idle_wake_s": 0.0003})
    fit = fit_wake(records(60, wake=0.0, gaps=(*GAPS, 10.0)), PROFILE, RTT, prior)
    for name in ("idle_wake_s", "idle_wake_tau_s"):
        term = fit.terms[name]
        assert term.value == getattr(prior, name) and term.source.startswith("prior: not identified: "), term.source
    assert "over 118 idle legs (a fit needs 3 standard errors above 0)" in fit.terms["idle_wake_s"].source


def test_too_few_idle_legs_keep_the_prior() -> None:
    rows = records(MIN_ROWS // 2)  # one fewer prefill and hand-off leg each than requests: MIN_ROWS − 2
    assert len(idle_residuals(rows, PROFILE, RTT)[0]) == MIN_ROWS - 2
    fit = fit_wake(rows, PROFILE, RTT, PRIOR)
    term = fit.terms["idle_wake_s"]
    assert term.value == PRIOR.idle_wake_s and fit.terms["idle_wake_tau_s"].value == PRIOR.idle_wake_tau_s
    assert term.source == f"prior: {MIN_ROWS - 2} requests found their instance idle (a fit needs {MIN_ROWS})"


def test_idle_times_that_do_not_span_the_time_constant_keep_the_prior() -> None:
    """Every gap 3-6 s: the cost has saturated in all of them, so it cannot be told from the legs'
    own leftover (the intercepts)."""
    fit = fit_wake(records(60, gaps=(3.0, 4.0, 5.0, 6.0)), PROFILE, RTT, PRIOR)
    term = fit.terms["idle_wake_s"]
    assert term.value == PRIOR.idle_wake_s and term.source.startswith("prior: idle times"), term.source
    assert "do not span the best time constant" in term.source

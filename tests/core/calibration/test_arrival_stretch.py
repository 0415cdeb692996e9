"""What a prompt arriving during a step adds to it, fitted from constructed burst heads."""

from __future__ import annotations

import math
from typing import Any

import pytest

from core.calibration.arrival_stretch import MIN_HEADS, fit_arrival_stretch, heads
from tests.helpers import toy_profile

PROFILE = toy_profile(
    prefill_base_s=0.01,
    prefill_per_token_s=0.0002,
    decode_step_base_s=0.004,
    decode_step_per_seq_s=0.001,
    prefill_host_per_request_s=0.003,
    idle_wake_s=0.008,
    idle_wake_tau_s=1.0,
)
"""The run's fitted legs and wake-up, with an intake of 3 ms per prompt."""
RTT = {"p0": 0.0015}
STRETCH = 0.004
"""The truth: 4 ms per prompt arriving during a head's step."""


def noise(k: int) -> float:
    """A small deterministic disturbance (±0.5 ms), different for each head."""
    return 0.0005 * math.sin(2.7 * k + 0.4)


def bursts(n: int, stretch: float = STRETCH, followers: tuple[int, ...] = (0, 1, 2, 3, 5)) -> list[dict[str, Any]]:
    """n bursts 2 s apart on one prefill instance. Each head finds the instance idle; its leg is the round
    trip, its intake, its step, its prefill, 2 ms the legs' fit left over, the wake-up after its idle time
    and `stretch` per follower. Its followers (cycled from `followers`) are sent 1 ms apart from 4 ms after
    it (past its 3 ms intake), all during its step, and end 30 ms after it, one batch."""
    rows: list[dict[str, Any]] = []
    last_end = -math.inf
    for b in range(n):
        start = 2.0 * b
        prompt = 100 + 37 * (b % 7)
        f = followers[b % len(followers)]
        model = PROFILE.prefill_host_per_request_s + float(PROFILE.prefill_time(prompt))
        model += PROFILE.step_time(1, prompt) + PROFILE.wake_time(start - last_end)
        end = start + RTT["p0"] + model + 0.002 + stretch * f + noise(b)
        rows.append(row(f"h{b}", start, end, prompt))
        rows += [row(f"f{b}-{k}", start + 0.004 + 0.001 * k, end + 0.03, 64) for k in range(f)]
        last_end = end + (0.03 if f else 0.0)
    return rows


def row(rid: str, start: float, end: float, prompt: int) -> dict[str, Any]:
    return {
        "request_id": rid,
        "prefill_instance": "p0",
        "prefill_start": start,
        "prefill_end": end,
        "prompt_tokens": prompt,
        "cached_tokens": 0,
    }


def test_each_head_counts_the_prompts_sent_during_its_step_and_only_heads_count() -> None:
    rows = bursts(10)
    early = [dict(r, prefill_start=r["prefill_start"] - 0.002) for r in rows if r["request_id"] == "f1-0"]
    head1 = rows[1]  # its answer leaves the instance 0.75 ms before its end
    assert head1["request_id"] == "h1"
    late = [row("late", head1["prefill_end"] - 0.001, head1["prefill_end"] + 0.03, 64)]
    assert heads(rows + early + late, PROFILE, RTT)[0][:2].tolist() == [0, 1]  # during the intake, the return leg
    k, resid = heads(rows, PROFILE, RTT)
    assert k.tolist() == [0, 1, 2, 3, 5] * 2  # followers found the instance busy: not heads
    assert resid == pytest.approx([0.002 + STRETCH * f + noise(b) for b, f in enumerate([0, 1, 2, 3, 5] * 2)])


def test_the_slope_over_the_heads_is_the_stretch() -> None:
    fit = fit_arrival_stretch(bursts(20), PROFILE, RTT, prior=0.001)
    term = fit.terms["prefill_arrival_stretch_s"]
    assert term.source.startswith("fit: ")
    assert term.value == pytest.approx(STRETCH, abs=2e-4)


def test_too_few_heads_with_arrivals_keep_the_prior() -> None:
    rows = bursts(2 * MIN_HEADS, followers=(0, 0, 0, 1))  # a quarter of the heads had arrivals
    term = fit_arrival_stretch(rows, PROFILE, RTT, prior=0.001).terms["prefill_arrival_stretch_s"]
    assert term.value == 0.001 and term.source.startswith("prior: 4 prefill legs")


def test_a_run_without_the_stretch_rules_a_large_prior_out() -> None:
    """No stretch at all in the run: the slope is ~0, many standard errors from a 10 ms prior, which it
    replaces (clipped at 0 where it comes out negative)."""
    term = fit_arrival_stretch(bursts(20, stretch=0.0), PROFILE, RTT, prior=0.01).terms["prefill_arrival_stretch_s"]
    assert term.value == pytest.approx(0.0, abs=3e-4)
    assert term.source.startswith("fit: small")

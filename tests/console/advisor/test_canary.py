"""Policy canaries: the arm split, the comparison of two arms and the stopping rule, on synthetic arms."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from console.advisor.canary import (
    CANARY,
    ArmSample,
    ArmSplit,
    CanaryError,
    compare_attainment,
    parse_share,
    plan_canary,
    read_canary,
)
from core.errors import PolicyError

PLAN = plan_canary("routing", "least_load", {}, "10%", 300)


def arm(rng: np.random.Generator, n: int, scale: float = 1.0, spread: float = 0.5) -> ArmSample:
    """`n` requests: lognormal TTFT (median 0.3 s × scale) and TPOT, SLO 1 s / 100 ms."""
    ttft = rng.lognormal(math.log(0.3), spread, n) * scale
    tpot = rng.lognormal(math.log(0.03), 0.2, n)
    return ArmSample(ttft, tpot, (ttft <= 1.0) & (tpot <= 0.1))


def five_minutes(seed: int, scale: float) -> tuple[ArmSample, ArmSample]:
    """A 10% canary over 5 min at 10 requests/s: 300 canary requests beside 2 700 control ones."""
    rng = np.random.default_rng(seed)
    return arm(rng, 300, scale), arm(rng, 2700)


@pytest.mark.parametrize(("scale", "verdict"), [(1.25, "rollback"), (1 / 1.25, "promote")])
def test_a_20_percent_p99_ttft_difference_gets_the_right_verdict_in_5_of_5_seeds(scale: float, verdict: str) -> None:
    for seed in range(5):
        canary, control = five_minutes(seed, scale)
        assert np.percentile(canary.ttft, 99) / np.percentile(control.ttft, 99) - 1 == pytest.approx(
            scale - 1, abs=0.2
        )
        reading = read_canary(canary, control, PLAN, 300.0)
        assert reading.decision == verdict, (seed, reading.reason)
        ttft = next(f for f in reading.figures if f.figure == "ttft_p99")
        assert ttft.direction == ("worse" if scale > 1 else "better")


def test_identical_arms_end_inconclusive_or_equal_in_19_of_20_seeds() -> None:
    decisions = Counter(read_canary(*five_minutes(100 + seed, 1.0), PLAN, 300.0).decision for seed in range(20))
    assert decisions["inconclusive"] + decisions["equal"] >= 19, decisions


def test_large_identical_arms_are_equal_within_the_margins() -> None:
    rng = np.random.default_rng(7)
    canary, control = arm(rng, 20_000, spread=0.05), arm(rng, 20_000, spread=0.05)
    reading = read_canary(canary, control, PLAN, 300.0)
    assert reading.decision == "equal", reading.reason
    assert all(f.direction == "equal" for f in reading.figures)


def test_the_rule_waits_for_the_end_and_for_enough_requests_but_rolls_back_clear_harm_early() -> None:
    canary, control = five_minutes(1, 1.0)
    assert read_canary(canary, control, PLAN, 120.0).decision == "continue"
    rng = np.random.default_rng(2)
    few = read_canary(arm(rng, 50, 3.0), arm(rng, 450), PLAN, 300.0)
    assert few.decision == "inconclusive" and "too few requests: 50 canary" in few.reason
    harm = read_canary(*five_minutes(3, 3.0), PLAN, 60.0)
    assert harm.decision == "rollback" and "before the end" in harm.reason


def wilson(k: int, n: int, z: float) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def test_attainment_interval_is_newcombes_from_wilson_intervals() -> None:
    canary = np.array([True] * 90 + [False] * 10)
    control = np.array([True] * 80 + [False] * 20)
    got = compare_attainment(canary, control, 0.95, 0.02)
    (l1, u1), (l2, u2) = wilson(90, 100, 1.959964), wilson(80, 100, 1.959964)
    assert got.difference == pytest.approx(0.10)
    assert got.low == pytest.approx(0.10 - math.hypot(0.9 - l1, u2 - 0.8), abs=1e-6)
    assert got.high == pytest.approx(0.10 + math.hypot(u1 - 0.9, 0.8 - l2), abs=1e-6)
    # by hand: Wilson [0.82564, 0.94478] and [0.71118, 0.86664]; 0.1 ∓ √(…) = 0.00015, 0.19947
    assert got.low == pytest.approx(0.00015, abs=2e-5) and got.high == pytest.approx(0.19947, abs=2e-5)
    assert got.direction == "better" and got.p_value is not None and 0.05 < got.p_value < 0.1  # Fisher's is stricter


def test_the_split_keeps_a_conversation_in_one_arm_and_takes_its_share() -> None:
    split = ArmSplit("10%", salt="canary-1")
    arms = {
        s: {split.arm(f"conv-{s}", "default", f"req-{s}-{turn}") for turn in range(5)} for s in range(4000)
    }
    assert all(len(a) == 1 for a in arms.values())
    share = sum(a == {CANARY} for a in arms.values()) / len(arms)
    assert share == pytest.approx(0.10, abs=0.015)
    # no session: a named tenant keeps its requests together; the anonymous default tenant does not
    assert len({split.arm(None, "acme", f"req-{i}") for i in range(50)}) == 1
    assert len({split.arm(None, "default", f"req-{i}") for i in range(200)}) == 2
    assert ArmSplit.key("", "", "r1") == "request:r1" and ArmSplit.key("s", "acme", "r1") == "session:s"
    other = ArmSplit("10%", salt="canary-2")
    moved = sum(split.arm(f"conv-{s}", None, "r") != other.arm(f"conv-{s}", None, "r") for s in range(4000))
    assert moved > 400  # another canary takes another slice


@pytest.mark.parametrize("share", ["0", "0%", "60%", "0.51", "-5%", "abc", "nan"])
def test_a_share_outside_0_to_50_percent_is_a_clear_error(share: str) -> None:
    with pytest.raises(CanaryError, match="canary share"):
        parse_share(share)


def test_shares_parse_as_percentages_or_fractions() -> None:
    assert parse_share("10%") == pytest.approx(0.1) and parse_share("0.5") == 0.5 and parse_share(0.25) == 0.25


@pytest.mark.parametrize("kind", ["queue", "reschedule", "scaling"])
def test_a_kind_that_cannot_be_split_says_why(kind: str) -> None:
    with pytest.raises(CanaryError, match=f"a {kind} policy cannot be canaried: .*both arms"):
        plan_canary(kind, "fcfs", {}, "10%", 300)


def test_a_canary_plan_checks_its_policy() -> None:
    assert plan_canary("rank", "jsq", {}, "5%", 60).share == pytest.approx(0.05)
    with pytest.raises(PolicyError, match="unknown routing policy"):
        plan_canary("routing", "nope", {}, "10%", 300)
    with pytest.raises(PolicyError, match="simulator-only"):
        plan_canary("routing", "clairvoyant", {}, "10%", 300)
    with pytest.raises(CanaryError, match="duration"):
        plan_canary("routing", "sibyl", {}, "10%", 0)
    with pytest.raises(CanaryError, match="unknown policy kind"):
        plan_canary("routes", "sibyl", {}, "10%", 60)

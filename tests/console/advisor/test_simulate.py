"""The advisor's re-simulation: candidates ranked on a constructed window, its error and what a gain must clear."""

from __future__ import annotations

import dataclasses

import pytest

from console.advisor.figures import Figures
from console.advisor.simulate import (
    Candidate,
    Errors,
    Shape,
    advise,
    clears,
    default_candidates,
    error_bound,
    gain_over,
    parse_candidate,
    prediction_error,
)
from console.advisor.window import Window
from core.errors import PolicyError
from core.perf import PerfProfile

PAIR = [Candidate("routing", "prefix_aware"), Candidate("routing", "sibyl")]


def figures(ttft_p99: float | None, attainment: float | None) -> Figures:
    return Figures(100, None, ttft_p99, None, None, attainment, 0, None)


def test_prefix_aware_beats_least_load_where_prefixes_repeat_and_prefill_queues(
    prefix_window: Window, small_cache_profile: PerfProfile
) -> None:
    advice = advise(prefix_window, Shape(2, 2), small_cache_profile, candidates=PAIR)
    by = {r.label: r for r in advice.ranked}
    assert [r.label for r in advice.ranked].index("routing:prefix_aware") < [r.label for r in advice.ranked].index(
        "active"
    )
    aware, active = by["routing:prefix_aware"].predicted, by["active"].predicted
    assert active.prefix_hit_rate is not None and aware.prefix_hit_rate is not None
    assert aware.prefix_hit_rate > active.prefix_hit_rate + 0.2  # the same prefixes land where they are cached
    assert aware.ttft_p99 is not None and active.ttft_p99 is not None and aware.ttft_p99 < 0.8 * active.ttft_p99
    assert by["routing:prefix_aware"].gain.ttft_p99 == pytest.approx(1 - aware.ttft_p99 / active.ttft_p99)
    assert by["active"].routing == ("least_load", {}) and by["active"].queue == ("fcfs", {})
    assert advice.predicted_active == active and advice.observed == prefix_window.observed
    assert advice.shape == "2P2D" and advice.window["requests"] == 300


def test_a_gain_is_shown_only_past_the_advisors_own_error(
    prefix_window: Window, small_cache_profile: PerfProfile
) -> None:
    base = advise(prefix_window, Shape(2, 2), small_cache_profile, candidates=PAIR)
    predicted = base.predicted_active
    assert predicted.ttft_p99 is not None and predicted.attainment is not None
    # observed 10% above the prediction: this window's error is 1/11 on P99 TTFT, 0 on attainment
    observed = dataclasses.replace(predicted, ttft_p99=predicted.ttft_p99 * 1.1)
    window = dataclasses.replace(prefix_window, observed=observed)
    advice = advise(window, Shape(2, 2), small_cache_profile, candidates=PAIR)
    assert advice.error is not None and advice.error.ttft_p99 == pytest.approx(1 / 11)
    assert advice.best is not None and advice.best.label == "routing:prefix_aware"
    # a recent window that missed by 60% raises the bar past the gain
    doubtful = advise(window, Shape(2, 2), small_cache_profile, candidates=PAIR, recent=[Errors(0.6, 0.0)])
    assert doubtful.bound.ttft_p99 == pytest.approx(0.6)
    assert doubtful.best is None and not any(r.shown for r in doubtful.ranked)
    # a window with a swap in it has no error of its own; with none known, nothing is shown
    mixed = advise(dataclasses.replace(window, swapped=True), Shape(2, 2), small_cache_profile, candidates=PAIR)
    assert mixed.error is None and mixed.bound == Errors(None, None) and mixed.best is None


def test_the_advice_is_deterministic(prefix_window: Window, small_cache_profile: PerfProfile) -> None:
    one = advise(prefix_window, Shape(2, 2), small_cache_profile, candidates=PAIR).to_json()
    two = advise(prefix_window, Shape(2, 2), small_cache_profile, candidates=PAIR).to_json()
    one.pop("sim_wall_s"), two.pop("sim_wall_s")
    assert one == two


def test_error_gain_and_bound_against_hand_numbers() -> None:
    err = prediction_error(figures(1.2, 0.855), figures(1.0, 0.90))
    assert err.ttft_p99 == pytest.approx(0.2) and err.attainment == pytest.approx(0.05)
    under = prediction_error(figures(0.75, 0.90), figures(1.0, 0.90))
    assert under.ttft_p99 == pytest.approx(0.25) and under.attainment == 0.0
    assert prediction_error(figures(None, 0.9), figures(1.0, None)) == Errors(None, None)
    gain = gain_over(figures(0.8, 0.99), figures(1.0, 0.90))
    assert gain.ttft_p99 == pytest.approx(0.2) and gain.attainment == pytest.approx(0.1)
    assert error_bound([Errors(0.1, None), Errors(0.3, 0.02), Errors(None, 0.05)]) == Errors(0.3, 0.05)
    assert clears(Errors(0.2, 0.0), Errors(0.15, 0.05))
    assert not clears(Errors(0.2, 0.0), Errors(0.25, 0.05))  # within the error
    assert not clears(Errors(0.2, -0.1), Errors(0.15, 0.05))  # better on TTFT, worse on attainment past the error
    assert not clears(Errors(0.9, 0.9), Errors(None, None))  # no error known: nothing is trusted


def test_default_candidates_say_why_some_policies_are_left_out(prefix_window: Window) -> None:
    chosen, skipped = default_candidates(prefix_window)
    labels = {c.label for c in chosen}
    assert {"routing:least_load", "routing:prefix_aware", "routing:sibyl", "routing:session_affinity"} <= labels
    assert {"queue:fcfs", "queue:priority", "queue:tail_aware"} <= labels
    assert "simulator-only" in skipped["routing:clairvoyant"] and "routing:oracle" in skipped
    assert "LoRA" in skipped["routing:lora_affinity"]
    no_sessions, why = default_candidates(dataclasses.replace(prefix_window, sessions=None))
    assert "routing:session_affinity" not in {c.label for c in no_sessions} and "sessions" in why[
        "routing:session_affinity"
    ]


def test_an_unknown_or_unsplittable_candidate_is_a_clear_error() -> None:
    assert parse_candidate("prefix_aware") == Candidate("routing", "prefix_aware")
    assert parse_candidate("queue:tail_aware") == Candidate("queue", "tail_aware")
    with pytest.raises(PolicyError, match="unknown routing policy 'nope'.*least_load"):
        parse_candidate("nope")
    with pytest.raises(PolicyError, match="routing or queue"):
        parse_candidate("scaling:threshold")
    with pytest.raises(PolicyError, match="simulator-only"):
        parse_candidate("clairvoyant")

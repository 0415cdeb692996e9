"""The advisor's re-simulation: candidates ranked on a constructed window, its error and what a gain must clear."""

from __future__ import annotations

import dataclasses

import pytest

from console.advisor.figures import Figures
from console.advisor.simulate import (
    NOTHING_HELD,
    Candidate,
    Errors,
    Shape,
    advise,
    clears,
    coarse_keys,
    default_candidates,
    error_bound,
    gain_over,
    parse_candidate,
    predict,
    prediction_error,
    replays_active,
    simulate,
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


QUEUES = [Candidate("queue", "priority"), Candidate("queue", "tail_aware")]


def test_a_queue_candidate_is_not_simulated_where_the_active_pair_held_nothing(
    prefix_window: Window, small_cache_profile: PerfProfile
) -> None:
    # 300 requests on 2 decode instances never reach fcfs's 256 in flight per instance: nothing is held
    advice = advise(prefix_window, Shape(2, 2), small_cache_profile, candidates=QUEUES)
    by = {r.label: r for r in advice.ranked}
    for label in ("queue:priority", "queue:tail_aware"):
        assert by[label].note == NOTHING_HELD and by[label].predicted == advice.predicted_active
        assert by[label].gain == Errors(0.0, 0.0) and not by[label].shown
        assert by[label].to_json()["note"] == NOTHING_HELD
    assert by["active"].note == "" and [r.label for r in advice.ranked][0] == "active"  # ties rank the active first
    # the shortcut is exact: simulating the candidate gives the active pair's figures to the last digit
    routing = prefix_window.active["routing"]
    for c in QUEUES:
        alone = predict(prefix_window, Shape(2, 2), small_cache_profile, routing, (c.name, {}))
        assert alone == advice.predicted_active
    held = simulate(prefix_window, Shape(2, 2), small_cache_profile, routing, ("fcfs", {}))
    assert held.queued == 0


def test_a_queue_candidate_is_simulated_where_requests_were_held_or_its_limits_differ(
    prefix_window: Window, small_cache_profile: PerfProfile
) -> None:
    tight = {"max_in_flight_per_instance": 4}
    window = dataclasses.replace(prefix_window, active={**prefix_window.active, "queue": ("fcfs", tight)})
    assert simulate(window, Shape(2, 2), small_cache_profile, window.active["routing"], ("fcfs", tight)).queued > 0
    advice = advise(window, Shape(2, 2), small_cache_profile, candidates=QUEUES)
    by = {r.label: r for r in advice.ranked}
    assert by["queue:priority"].note == "" and by["queue:priority"].queue == ("priority", tight)  # limits inherited
    routing, fcfs = prefix_window.active["routing"], prefix_window.active["queue"]
    assert not replays_active((routing, ("fcfs", {"max_in_flight_per_instance": 4})), (routing, fcfs), held=0)
    assert not replays_active((("sibyl", {}), fcfs), (routing, fcfs), held=0)  # a routing change always runs
    assert not replays_active((routing, ("priority", {})), (routing, fcfs), held=3)
    assert replays_active((routing, ("priority", {})), (routing, fcfs), held=0)


def test_coarse_keys_keep_every_nth_key_of_the_chain_and_drop_a_partial_block() -> None:
    assert coarse_keys([(1, 2, 3, 4, 5, 6, 7), (9,), ()], 3) == [(3, 6), (), ()]
    assert coarse_keys([(1, 2)], 1) == [(1, 2)]
    with pytest.raises(ValueError, match="key_blocks"):
        coarse_keys([(1,)], 0)


def test_coarser_cache_blocks_keep_the_prefix_structure(
    prefix_window: Window, small_cache_profile: PerfProfile
) -> None:
    # 2 048-token shared prefixes are whole 128-token blocks: an 8-fold coarser cache finds the same hits
    exact = advise(prefix_window, Shape(2, 2), small_cache_profile, candidates=PAIR)
    coarse = advise(prefix_window, Shape(2, 2), small_cache_profile, candidates=PAIR, key_blocks=8)
    for e, c in zip(sorted(exact.ranked, key=lambda r: r.label), sorted(coarse.ranked, key=lambda r: r.label),
                    strict=True):
        assert e.predicted.prefix_hit_rate is not None and c.predicted.prefix_hit_rate is not None
        assert c.predicted.prefix_hit_rate == pytest.approx(e.predicted.prefix_hit_rate, abs=0.05)
    assert [r.label for r in coarse.ranked].index("routing:prefix_aware") < [r.label for r in coarse.ranked].index(
        "active"
    )

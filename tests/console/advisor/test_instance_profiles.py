"""The advisor's re-simulation with each instance's own profile, against the averaged profile it used alone before."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import numpy as np
import pytest

from console.advisor.simulate import Shape, advise, simulate
from console.advisor.window import Window, window_from_rows
from console.live.advisor import cluster_profile
from core.perf import PerfProfile, get_profile
from core.prefill import StepTerms
from core.slo import SLOClass

PROMPT, OUTPUT, EVERY_S = 2000, 32, 0.5
PREFILL_TERMS = ("prefill_base_s", "prefill_per_token_s", "prefill_per_token2_s")
PRIOR = get_profile("roofline-h100-qwen2.5-7b")
FAST = PRIOR.model_copy(update={"name": "p0 calibrated"})
SLOW = PRIOR.model_copy(update={"name": "p1 calibrated", **{k: 3 * getattr(PRIOR, k) for k in PREFILL_TERMS}})


def fit_terms(profile: PerfProfile) -> dict[str, dict[str, Any]]:
    """An instance's applied terms as the calibrator keeps them: its prefill terms fitted."""
    return {k: {"value": getattr(profile, k), "source": "fit (12 rows)"} for k in PREFILL_TERMS}


@pytest.fixture(scope="module")
def even_window() -> Window:
    """40 prompts of 2 000 tokens, one every 0.5 s: a prefill instance is always idle when the next one comes."""
    rows = []
    for i in range(40):
        t = EVERY_S * i
        rows.append(
            {
                "request_id": f"r{i}", "arrival": t, "prompt_tokens": PROMPT, "output_tokens": OUTPUT,
                "max_tokens": OUTPUT, "status": "ok", "prefill_start": t, "first_token": t + 0.1, "finish": t + 0.4,
                "ttft": 0.1, "tpot": 0.01, "slo_met": True, "cached_tokens": None, "slo_class": "default",
                "tenant": "default", "priority": 0,
            }
        )  # fmt: skip
    return window_from_rows(
        rows,
        run_id="r-even",
        end=rows[-1]["arrival"],
        window_s=rows[-1]["arrival"] + 1.0,
        active={"routing": ("least_load", {}), "queue": ("fcfs", {})},
        slos={"default": SLOClass(ttft_s=0.5, tpot_s=0.1)},
        cluster="2P2D",
    )


def test_per_instance_profiles_route_to_the_fast_instance_the_average_hid(even_window: Window) -> None:
    """p0 calibrated at the prior's prefill speed, p1 at a third of it. The averaged profile (what the advisor
    simulated with alone) gives both 2× the prior's prefill terms, so each prompt (both instances idle) takes
    2×'s alone time wherever it goes. With each instance's own profile the dispatcher projects p0 faster and
    sends every prompt there, where it takes 1×'s: each prefill is exactly its profile's alone time, and the
    predicted TTFT drops by the difference (the decode side, on the main profile in both, is the same)."""
    averaged = cluster_profile(PRIOR, [fit_terms(FAST), fit_terms(SLOW)])
    assert averaged.prefill_per_token_s == pytest.approx(2 * PRIOR.prefill_per_token_s)
    routing, queue = even_window.active["routing"], even_window.active["queue"]
    flat = simulate(even_window, Shape(2, 2), averaged, routing, queue)
    own = simulate(even_window, Shape(2, 2, {"p0": FAST, "p1": SLOW}, 2), averaged, routing, queue)
    assert own.prefill_instance.tolist() == [0] * 40  # never the slow one: p0 is idle at every arrival
    t_avg, t_fast = StepTerms.of(averaged).alone_s(PROMPT), StepTerms.of(FAST).alone_s(PROMPT)
    assert t_fast < 0.6 * t_avg
    assert flat.prefill_end - flat.arrival == pytest.approx(np.full(40, t_avg), rel=1e-9)
    assert own.prefill_end - own.arrival == pytest.approx(np.full(40, t_fast), rel=1e-9)
    ttft_flat, ttft_own = flat.first_token - flat.arrival, own.first_token - own.arrival
    assert ttft_flat - ttft_own == pytest.approx(np.full(40, t_avg - t_fast), rel=1e-6)


def test_a_slow_instance_the_average_hid_is_where_a_lone_prompt_waits(even_window: Window) -> None:
    """The other direction: a 1P2D shape whose one prefill instance is the slow one (3×). The averaged profile
    (2×) under-predicts every prefill by a third; its own profile gives it exactly, and the first tokens later
    by the difference."""
    averaged = cluster_profile(PRIOR, [fit_terms(FAST), fit_terms(SLOW)])
    routing, queue = even_window.active["routing"], even_window.active["queue"]
    flat = simulate(even_window, Shape(1, 2), averaged, routing, queue)
    own = simulate(even_window, Shape(1, 2, {"p0": SLOW}, 1), averaged, routing, queue)
    t_avg, t_slow = StepTerms.of(averaged).alone_s(PROMPT), StepTerms.of(SLOW).alone_s(PROMPT)
    assert t_slow > 1.4 * t_avg
    assert own.prefill_end - own.arrival == pytest.approx(np.full(40, t_slow), rel=1e-9)
    assert (own.first_token - own.arrival) - (flat.first_token - flat.arrival) == pytest.approx(
        np.full(40, t_slow - t_avg), rel=1e-6
    )


def test_the_advice_notes_the_per_instance_profiles(even_window: Window) -> None:
    averaged = cluster_profile(PRIOR, [fit_terms(FAST), fit_terms(SLOW)])
    plain = advise(even_window, Shape(2, 2), averaged, candidates=[])
    assert not any("per-instance" in n for n in plain.window["notes"])
    shape = Shape(2, 2, {"p0": FAST, "p1": SLOW}, 1)
    advice = advise(even_window, shape, averaged, candidates=[])
    others = f"2 other instances on {PRIOR.name}"
    note = f"per-instance profiles (1 calibrated, 1 on their calibrated peers' terms; {others})"
    assert advice.window["notes"] == [note] and advice.to_json()["window"]["notes"] == [note]
    assert even_window.notes == []  # the window itself is left as it was
    assert advice.predicted_active.ttft_p99 is not None and plain.predicted_active.ttft_p99 is not None
    assert advice.predicted_active.ttft_p99 < plain.predicted_active.ttft_p99
    assert str(shape) == "2P2D" and shape.profiles_note(averaged) == note


def test_a_shape_with_its_profiles_travels_to_the_worker_process() -> None:
    shape = Shape(2, 2, {"p0": FAST, "p1": SLOW}, 2)
    back = pickle.loads(pickle.dumps(shape))
    assert back == shape and back.profiles["p1"].prefill_per_token_s == SLOW.prefill_per_token_s
    assert dataclasses.replace(shape, profiles={}) == Shape(2, 2, calibrated=2)

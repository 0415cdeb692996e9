"""The host's work on prefill instances' cores (intake, streaming), fitted from constructed prefill-leg records."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from core.calibration.host import busy_batches, computed_tokens, fit_host_work
from tests.helpers import toy_profile

H = 0.005
"""The profile's intake per prompt (a prior `fit_host_work` takes as known)."""
PROFILE = toy_profile(
    prefill_base_s=0.01,
    prefill_per_token_s=0.001,
    decode_step_base_s=0.002,
    decode_step_per_seq_s=0.0005,
    prefill_host_per_request_s=H,
)
NAME = "host_per_streamed_token_s"


def compute(lens: list[int]) -> float:
    return 0.01 + 0.001 * sum(lens) + PROFILE.step_time(len(lens), sum(lens))


def records(
    g: float, *, back_to_back: bool, batches: int = 40, seed: int = 3, stall: float = 0.0, split: bool = False
) -> list[dict[str, Any]]:
    """Prefill legs of one instance in batches of 1-4, with an intake of H per prompt, each batch's step
    run while the cluster streams 0, 50, 100 or 200 tokens/s (a decoding request streaming through the
    step alone), which takes g per token of the instance's core: the step lasts its compute / (1 − g·R).
    Each batch's prompts arrive 20 ms before the previous batch ends (back to back: during its step, so
    each adds H after it) or 0.5 s after it ended (idle gaps). Every fifth batch runs `stall` seconds
    longer (a host busy elsewhere). A batch's legs end 1 ms apart, or with `split` 6 ms apart in every
    fifth batch (read as several batches)."""
    rng = random.Random(seed)
    rows, end = [], 0.0
    for b in range(batches):
        lens = [rng.randint(50, 400) for _ in range(rng.randint(1, 4))]
        arrive = end - 0.02 if back_to_back else end + 0.5
        begin = max(end, arrive) + H * len(lens)
        rate = rng.choice([0.0, 50.0, 100.0, 200.0])
        end = begin + compute(lens) / (1 - g * rate) + rng.uniform(0, 0.002) + (stall if b % 5 == 4 else 0.0)
        rows += [
            {
                "prefill_instance": "p0",
                "prefill_start": arrive,
                "prefill_end": end + k * (0.006 if split and b % 5 == 2 else 0.001),
                "prompt_tokens": n,
                "request_id": f"{b}-{k}",
            }
            for k, n in enumerate(lens)
        ]
        if rate:
            rows.append(stream(f"s{b}", begin, end, rate))
    return rows


def stream(request: str, first: float, finish: float, rate: float) -> dict[str, Any]:
    """A decoding request (no prefill leg of this instance) streaming `rate` tokens/s from `first` to `finish`."""
    tokens = rate * (finish - first) + 1
    return {
        "prefill_instance": None,
        "prefill_start": None,
        "prefill_end": None,
        "prompt_tokens": 10,
        "request_id": request,
        "first_token": first,
        "finish": finish,
        "output_tokens": tokens,
    }


def leg(request: str, arrive: float, end: float) -> dict[str, Any]:
    """A prefill leg of 100 prompt tokens on the instance."""
    return {
        "prefill_instance": "p0",
        "prefill_start": arrive,
        "prefill_end": end,
        "prompt_tokens": 100,
        "request_id": request,
    }


def test_the_intake_follows_the_prompts_that_arrived_and_streaming_the_tokens_streamed() -> None:
    """By hand, on the instance's clock, h = 10 ms, at most two prompts a step, 100 tokens each (a step
    of one: 112.5 ms, of two: 213 ms). A arrives at an idle instance at 0 and runs at 0.01 (its intake
    first), ending at 0.1225; D, B and C arrive during it and F during the 30 ms of their intake after
    it, so B+C start at 0.1625 and end at 0.3755; nothing arrives meanwhile, so D+F start at once and
    end at 0.5885; E arrives during them and runs alone from 0.5985 to 0.711. The batches before them
    held 1, 2, 2 prompts, and they hold 2, 2, 1; the intervals' excess is h times the 4, 0, 1 prompts
    that arrived. A request streaming 100 tokens/s from 0.3 to 0.65 streams 7.55, 28.85 and 6.15 of
    its tokens in the three intervals."""
    rows = [
        leg("A", 0.0, 0.1225),
        *(leg(r, t, 0.3755) for r, t in (("B", 0.05), ("C", 0.06))),
        *(leg(r, t, 0.5885) for r, t in (("D", 0.0105), ("F", 0.13))),
        leg("E", 0.4, 0.711),
        stream("S", 0.3, 0.65, 100.0),
    ]
    assert compute([100]) == pytest.approx(0.1125) and compute([100, 100]) == pytest.approx(0.213)
    arrivals, streamed, intervals, excess, periods, _ = busy_batches(rows, PROFILE)
    assert arrivals.tolist() == [4.0, 0.0, 1.0] and periods.tolist() == [0, 0, 0]
    assert streamed == pytest.approx([7.55, 21.3, 6.15])
    assert intervals == pytest.approx([0.253, 0.213, 0.1225])
    assert excess == pytest.approx([0.04, 0.0, 0.01], abs=1e-12)
    # the gateway sees each prompt sent 1 ms before it reached the instance, and each end 1 ms after:
    # its round trip of 2 ms puts the sends back on the ends' clock; without it, D (sent 0.5 ms before
    # A's step started, as the gateway saw the start) counts in no interval
    seen = [
        {**r, "prefill_start": r["prefill_start"] - 0.001, "prefill_end": r["prefill_end"] + 0.001} for r in rows[:-1]
    ]
    assert busy_batches(seen, PROFILE, {"p0": 0.002}).arrivals.tolist() == [4.0, 0.0, 1.0]
    assert busy_batches(seen, PROFILE).arrivals.tolist() == [3.0, 0.0, 1.0]


def test_back_to_back_batches_give_the_host_work_per_streamed_token() -> None:
    rows = records(0.002, back_to_back=True)
    term = fit_host_work(rows, PROFILE, prior=0.0).terms[NAME]
    assert term.source == "fit" and term.value == pytest.approx(0.002, rel=0.05)
    arrivals, streamed, intervals, excess, periods, _ = busy_batches(rows, PROFILE)
    assert len(arrivals) == 39 and set(periods.tolist()) == {0}  # one busy period
    assert set(arrivals.tolist()) <= {1.0, 2.0, 3.0, 4.0}  # each batch's prompts arrived during the one before
    # the excess is the intake of the prompts that arrived and the streaming's share of the step
    assert np.all(np.abs(excess - H * arrivals - 0.002 * streamed) < 0.006)  # jitter, legs answered 1 ms apart
    assert np.all(intervals > excess)
    # an intake left out (a prior of 0) would be put on the streamed tokens
    no_intake = PROFILE.model_copy(update={"prefill_host_per_request_s": 0.0})
    taken = fit_host_work(rows, no_intake, prior=0.0).terms[NAME].value
    assert taken == pytest.approx(term.value + H * np.sum(arrivals) / np.sum(streamed))


def test_no_streaming_work_fits_zero_and_idle_instances_keep_the_prior() -> None:
    none = fit_host_work(records(0.0, back_to_back=True), PROFILE, prior=0.001).terms[NAME]
    # fitted (the steps' jitter, ~1 ms each, lands on the tokens), or clipped at 0
    assert none.source.startswith("fit") and none.value == pytest.approx(0.0, abs=5e-5)
    idle = fit_host_work(records(0.002, back_to_back=False), PROFILE, prior=0.001).terms[NAME]
    assert busy_batches(records(0.002, back_to_back=False), PROFILE).arrivals.size == 0
    assert idle.value == 0.001 and idle.source.startswith("prior: ") and "back-to-back prefill batches" in idle.source
    silent = [r for r in records(0.002, back_to_back=True) if r["prefill_instance"]]  # nothing streamed
    quiet = fit_host_work(silent, PROFILE, prior=0.001).terms[NAME]
    assert quiet.value == 0.001 and quiet.source.startswith("prior: no token was streamed")


def test_slow_batches_count_so_the_model_keeps_the_measured_busy_time() -> None:
    """Queueing follows the mean service time: batches a busy host slowed are not outliers to drop."""
    rows = records(0.001, back_to_back=True, stall=0.08)
    term = fit_host_work(rows, PROFILE, prior=0.0).terms[NAME]
    arrivals, streamed, intervals, excess, *_ = busy_batches(rows, PROFILE)
    modelled = np.sum(intervals - excess) + H * np.sum(arrivals) + term.value * np.sum(streamed)
    assert term.source == "fit" and modelled == pytest.approx(np.sum(intervals), rel=1e-9)
    assert term.value > 0.0011  # the 8 stalled batches' time is in g, not dropped


def test_a_batch_split_by_the_gap_rule_leaves_the_fit_identified() -> None:
    """Legs of one batch that end more than 5 ms apart read as two batches, one long and one ~empty;
    the scatter is judged over blocks of consecutive batches, where the two cancel."""
    rows = records(0.002, back_to_back=True, split=True)
    assert len(busy_batches(rows, PROFILE).arrivals) > 45  # the multi-request batches among every fifth came apart
    term = fit_host_work(rows, PROFILE, prior=0.0).terms[NAME]
    assert term.source == "fit" and term.rel_se is not None and term.rel_se < 0.05
    assert term.value == pytest.approx(0.002, rel=0.1)


def test_cached_prompt_tokens_are_not_counted_as_prefill_work() -> None:
    """A prefill computes only what its engine did not find cached: rows reporting cached tokens fit
    the same host work as rows whose prompts hold only the computed part."""
    plain = records(0.002, back_to_back=True)
    cached = [{**r, "prompt_tokens": r["prompt_tokens"] + 256, "cached_tokens": 256} for r in plain]
    assert computed_tokens(cached[0]) == plain[0]["prompt_tokens"]
    a = fit_host_work(plain, PROFILE, prior=0.0).terms[NAME].value
    b = fit_host_work(cached, PROFILE, prior=0.0).terms[NAME].value
    assert b == pytest.approx(a, rel=0.02)
    ignoring = [
        {k: v for k, v in r.items() if k != "cached_tokens"} for r in cached
    ]  # the same rows read as computed in full
    assert fit_host_work(ignoring, PROFILE, prior=0.0).terms[NAME].value < a * 0.8


def test_an_uncertain_estimate_replaces_a_prior_it_rules_out_and_keeps_one_it_allows() -> None:
    """Stalls of 1 s in every fifth batch leave the estimate too uncertain to count as fitted: a prior
    of 10 ms per token, many standard errors away, gives way to it; a prior within one stays."""
    rows = records(0.0002, back_to_back=True, stall=1.0, batches=20)
    arrivals, streamed, _, excess, *_ = busy_batches(rows, PROFILE)
    estimate = float(np.sum(excess - H * arrivals) / np.sum(streamed))  # the ratio of totals
    far = fit_host_work(rows, PROFILE, prior=0.01).terms[NAME]
    assert far.rel_se is not None and far.rel_se > 0.05
    assert far.source.startswith("fit: uncertain") and "standard errors from the prior 10000.0 µs" in far.source
    assert far.value == pytest.approx(estimate) and estimate > 0.0002  # the stalls' share is in it
    near = fit_host_work(rows, PROFILE, prior=estimate * 1.2).terms[NAME]
    assert near.value == estimate * 1.2 and near.source.startswith("prior: too uncertain")

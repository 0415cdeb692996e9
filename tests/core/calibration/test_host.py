"""The per-request host work of prefill instances, fitted from constructed prefill-leg records."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from core.calibration.host import busy_batches, computed_tokens, fit_host_work
from tests.helpers import toy_profile

PROFILE = toy_profile(
    prefill_base_s=0.01, prefill_per_token_s=0.001, decode_step_base_s=0.002, decode_step_per_seq_s=0.0005
)


def compute(lens: list[int]) -> float:
    return 0.01 + 0.001 * sum(lens) + PROFILE.step_time(len(lens), sum(lens))


def records(
    h: float, *, back_to_back: bool, batches: int = 40, seed: int = 3, stall: float = 0.0, split: bool = False
) -> list[dict[str, Any]]:
    """Prefill legs of one instance in batches of 1-4, with an intake of h per prompt: each batch's
    prompts arrive 20 ms before the previous batch ends (back to back: during its step, so each adds
    h after it) or 0.5 s after it ended (idle gaps: the instance takes them in, then runs them); the
    batch starts h times its size after the later of the previous end and its arrival. Every fifth
    batch runs `stall` seconds longer (a host busy elsewhere). A batch's legs end 1 ms apart, or with
    `split` 6 ms apart in every fifth batch (read as several batches)."""
    rng = random.Random(seed)
    rows, end = [], 0.0
    for b in range(batches):
        lens = [rng.randint(50, 400) for _ in range(rng.randint(1, 4))]
        arrive = end - 0.02 if back_to_back else end + 0.5
        begin = max(end, arrive) + h * len(lens)
        end = begin + compute(lens) + rng.uniform(0, 0.002) + (stall if b % 5 == 4 else 0.0)
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
    return rows


def leg(request: str, arrive: float, end: float) -> dict[str, Any]:
    """A prefill leg of 100 prompt tokens on the instance."""
    return {
        "prefill_instance": "p0",
        "prefill_start": arrive,
        "prefill_end": end,
        "prompt_tokens": 100,
        "request_id": request,
    }


def test_the_host_work_follows_the_prompts_that_arrived_not_the_batch_sizes() -> None:
    """By hand, on the instance's clock, h = 10 ms, at most two prompts a step, 100 tokens each (a step
    of one: 112.5 ms, of two: 213 ms). A arrives at an idle instance at 0 and runs at 0.01 (its intake
    first), ending at 0.1225; D, B and C arrive during it and F during the 30 ms of their intake after
    it, so B+C start at 0.1625 and end at 0.3755; nothing arrives meanwhile, so D+F start at once and
    end at 0.5885; E arrives during them and runs alone from 0.5985 to 0.711. The batches before them
    held 1, 2, 2 prompts, and they hold 2, 2, 1; the intervals' excess is h times the 4, 0, 1 prompts
    that arrived."""
    rows = [
        leg("A", 0.0, 0.1225),
        *(leg(r, t, 0.3755) for r, t in (("B", 0.05), ("C", 0.06))),
        *(leg(r, t, 0.5885) for r, t in (("D", 0.0105), ("F", 0.13))),
        leg("E", 0.4, 0.711),
    ]
    assert compute([100]) == pytest.approx(0.1125) and compute([100, 100]) == pytest.approx(0.213)
    arrivals, intervals, excess, periods = busy_batches(rows, PROFILE)
    assert arrivals.tolist() == [4.0, 0.0, 1.0] and periods.tolist() == [0, 0, 0]
    assert intervals == pytest.approx([0.253, 0.213, 0.1225])
    assert excess == pytest.approx([0.04, 0.0, 0.01], abs=1e-12)
    # the gateway sees each prompt sent 1 ms before it reached the instance, and each end 1 ms after:
    # its round trip of 2 ms puts the sends back on the ends' clock; without it, D (sent 0.5 ms before
    # A's step started, as the gateway saw the start) counts in no interval
    seen = [{**r, "prefill_start": r["prefill_start"] - 0.001, "prefill_end": r["prefill_end"] + 0.001} for r in rows]
    assert busy_batches(seen, PROFILE, {"p0": 0.002}).arrivals.tolist() == [4.0, 0.0, 1.0]
    assert busy_batches(seen, PROFILE).arrivals.tolist() == [3.0, 0.0, 1.0]


def test_back_to_back_batches_give_the_host_work_per_request() -> None:
    fit = fit_host_work(records(0.05, back_to_back=True), PROFILE, prior=0.0)
    term = fit.terms["prefill_host_per_request_s"]
    assert term.source == "fit" and term.value == pytest.approx(0.05, abs=0.002)
    arrivals, intervals, excess, periods = busy_batches(records(0.05, back_to_back=True), PROFILE)
    assert len(arrivals) == 39 and set(periods.tolist()) == {0}  # one busy period
    assert set(arrivals.tolist()) <= {1.0, 2.0, 3.0, 4.0}  # each batch's prompts arrived during the one before
    assert np.all(np.abs(excess - 0.05 * arrivals) < 0.006)  # jitter and the legs answered 1 ms apart
    assert np.all(intervals > excess)


def test_no_host_work_fits_zero_and_idle_instances_keep_the_prior() -> None:
    none = fit_host_work(records(0.0, back_to_back=True), PROFILE, prior=0.03).terms["prefill_host_per_request_s"]
    assert none.source.startswith("fit") and none.value == pytest.approx(0.0, abs=0.002)  # fitted, or clipped at 0
    idle = fit_host_work(records(0.05, back_to_back=False), PROFILE, prior=0.03).terms["prefill_host_per_request_s"]
    assert busy_batches(records(0.05, back_to_back=False), PROFILE)[0].size == 0
    assert idle.value == 0.03 and idle.source.startswith("prior: ") and "back-to-back prefill batches" in idle.source


def test_slow_batches_count_so_the_model_keeps_the_measured_busy_time() -> None:
    """Queueing follows the mean service time: batches a busy host slowed are not outliers to drop."""
    rows = records(0.02, back_to_back=True, stall=0.08)
    term = fit_host_work(rows, PROFILE, prior=0.0).terms["prefill_host_per_request_s"]
    arrivals, intervals, excess, _ = busy_batches(rows, PROFILE)
    modelled = np.sum(intervals - excess) + term.value * np.sum(arrivals)
    assert term.source == "fit" and modelled == pytest.approx(np.sum(intervals), rel=1e-9)
    assert term.value > 0.02 + 0.5 * 0.08 * 8 / np.sum(arrivals)  # the 8 stalled batches' time is in h, not dropped


def test_a_batch_split_by_the_gap_rule_leaves_the_fit_identified() -> None:
    """Legs of one batch that end more than 5 ms apart read as two batches, one long and one ~empty;
    the scatter is judged over blocks of consecutive batches, where the two cancel."""
    rows = records(0.05, back_to_back=True, split=True)
    arrivals, _, _, _ = busy_batches(rows, PROFILE)
    assert len(arrivals) > 45  # the multi-request batches among every fifth came apart
    term = fit_host_work(rows, PROFILE, prior=0.0).terms["prefill_host_per_request_s"]
    assert term.source == "fit" and term.rel_se is not None and term.rel_se < 0.05
    # each extra piece is charged the fixed cost of a batch (10 ms + a 2.5 ms step) it did not take
    assert term.value == pytest.approx(0.05, abs=0.01)


def test_cached_prompt_tokens_are_not_counted_as_prefill_work() -> None:
    """A prefill computes only what its engine did not find cached: rows reporting cached tokens fit
    the same host work as rows whose prompts hold only the computed part."""
    plain = records(0.05, back_to_back=True)
    cached = [{**r, "prompt_tokens": r["prompt_tokens"] + 256, "cached_tokens": 256} for r in plain]
    assert computed_tokens(cached[0]) == plain[0]["prompt_tokens"]
    a = fit_host_work(plain, PROFILE, prior=0.0).terms["prefill_host_per_request_s"].value
    b = fit_host_work(cached, PROFILE, prior=0.0).terms["prefill_host_per_request_s"].value
    assert b == pytest.approx(a, abs=0.003)
    ignoring = [
        {k: v for k, v in r.items() if k != "cached_tokens"} for r in cached
    ]  # the same rows read as computed in full
    assert fit_host_work(ignoring, PROFILE, prior=0.0).terms["prefill_host_per_request_s"].value < a - 0.005


def test_an_uncertain_estimate_replaces_a_prior_it_rules_out_and_keeps_one_it_allows() -> None:
    """Stalls of 1 s in every fifth batch leave the estimate too uncertain to count as fitted (±7% of
    the busy time): a prior of 300 ms, nine standard errors away, gives way to it; a prior of 60 ms,
    within one, stays."""
    rows = records(0.002, back_to_back=True, stall=1.0, batches=20)
    arrivals = busy_batches(rows, PROFILE).arrivals
    far = fit_host_work(rows, PROFILE, prior=0.3).terms["prefill_host_per_request_s"]
    near = fit_host_work(rows, PROFILE, prior=0.06).terms["prefill_host_per_request_s"]
    assert far.rel_se is not None and far.rel_se > 0.05
    assert far.source.startswith("fit: uncertain") and "standard errors from the prior 300.00 ms" in far.source
    # the ratio of totals: 2 ms + the four stalls' share (the jitter adds ~0.5 ms)
    assert arrivals.sum() == 52 and far.value == pytest.approx(0.002 + 4 * 1.0 / 52, abs=0.001)
    assert near.value == 0.06 and near.source.startswith("prior: too uncertain")

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
    """Prefill legs of one instance in batches of 1-4: each batch's requests arrive while the
    previous one runs (back to back) or after it ended (idle gaps); its end is its compute plus h
    times the previous batch's size (the previous batch's host work) after the previous end. Every
    fifth batch runs `stall` seconds longer (a host busy elsewhere). A batch's legs end 1 ms apart,
    or with `split` 6 ms apart in every fifth batch (read as several batches)."""
    rng = random.Random(seed)
    rows, end, prev_n = [], 0.0, 0
    for b in range(batches):
        lens = [rng.randint(50, 400) for _ in range(rng.randint(1, 4))]
        if back_to_back:
            arrive, begin = end - 0.02, end + h * prev_n
        else:
            arrive = begin = end + h * prev_n + 0.5
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
        prev_n = len(lens)
    return rows


def test_back_to_back_batches_give_the_host_work_per_request() -> None:
    fit = fit_host_work(records(0.05, back_to_back=True), PROFILE, prior=0.0)
    term = fit.terms["prefill_host_per_request_s"]
    assert term.source == "fit" and term.value == pytest.approx(0.05, abs=0.002)
    sizes, intervals, excess, periods = busy_batches(records(0.05, back_to_back=True), PROFILE)
    assert len(sizes) == 39 and set(periods.tolist()) == {
        0
    }  # one busy period and set(sizes.tolist()) <= {1.0, 2.0, 3.0, 4.0}
    assert np.all(
        np.abs(excess - 0.05 * sizes) < 0.006
    )  # jitter and the legs answered 1 ms apart and np.all(intervals > excess)


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
    sizes, intervals, excess, _ = busy_batches(rows, PROFILE)
    modelled = np.sum(intervals - excess) + term.value * np.sum(sizes)
    assert term.source == "fit" and modelled == pytest.approx(np.sum(intervals), rel=1e-9)
    assert term.value > 0.02 + 0.5 * 0.08 * 7 / np.sum(sizes)  # the 7 stalled batches' time is in h, not dropped


def test_a_batch_split_by_the_gap_rule_leaves_the_fit_identified() -> None:
    """Legs of one batch that end more than 5 ms apart read as two batches, one long and one ~empty;
    the scatter is judged over blocks of consecutive batches, where the two cancel."""
    rows = records(0.05, back_to_back=True, split=True)
    sizes, _, _, _ = busy_batches(rows, PROFILE)
    assert len(sizes) > 45  # the multi-request batches among every fifth came apart
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
    the busy time): a prior of 300 ms, ten standard errors away, gives way to it; a prior of 60 ms,
    within one, stays."""
    rows = records(0.002, back_to_back=True, stall=1.0, batches=20)
    far = fit_host_work(rows, PROFILE, prior=0.3).terms["prefill_host_per_request_s"]
    near = fit_host_work(rows, PROFILE, prior=0.06).terms["prefill_host_per_request_s"]
    assert far.rel_se is not None and far.rel_se > 0.05
    assert far.source.startswith("fit: uncertain") and "standard errors from the prior 300.00 ms" in far.source
    assert far.value == pytest.approx(0.0825, abs=0.001)  # the ratio of totals: 2 ms + the stalls' share
    assert near.value == 0.06 and near.source.startswith("prior: too uncertain")

"""Per-request host work of prefill instances, fitted from the back-to-back prefill batches of a run.

A prefill instance spends time per request outside its engine steps: its API server takes the
request in and answers it, and on CPU hosts the same cores serve the decode instance's read of the
prompt's KV (NIXL). Alone, that work overlaps idle time and no request waits for it; under load it
delays the next engine step. The profile's `prefill_host_per_request_s` (h) models it: after a
prefill batch of n requests ends, the instance's next batch cannot start for h·n seconds.

It shows only in busy periods. The prefill legs that end together (within BATCH_GAP_S) on one
instance are one batch; a batch whose every request was already waiting when the previous batch
ended ran right after it, so the time between the two ends is its compute, as the profile gives
it for the batch, plus h times the previous batch's size. The fit regresses that excess on the
previous batch's size through the origin; with too few back-to-back batches, or too uncertain a
slope, h keeps its prior.

The slope is the ratio of the totals, Σ excess / Σ size: the h with which the modelled busy time
equals the measured one. Queueing at a prefill instance follows the mean service time, and on a
shared host the slow batches are real (the instance's API server, the NIXL reads it serves and the
console's gateway all run on the same two cores). A robust fit that drops them as outliers fits a
typical batch instead: on the stage's real runs it gave h ≈ 8 ms against ≈ 19 ms
for the totals, and the emulator then queued prefills ~40% less than real vLLM at the queueing
load. Batches the 5 ms rule splits or merges wrongly also cancel in the totals.

An estimate too uncertain to count as fitted (its 1σ above IDENTIFIED of the busy time) keeps the
prior only while the prior lies within REJECT_SE standard errors of it; a prior the run rules out
(a slower day's host work) gives way to the estimate.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np

from core.calibration.fit import IDENTIFIED, LinearFit, Term
from core.perf import PerfProfile

BATCH_GAP_S = 0.005
"""Prefill legs whose ends lie this close were answered from one engine step."""
MIN_BATCHES = 8
REJECT_SE = 3.0
"""An estimate too uncertain to count as fitted still replaces a prior this many standard errors away."""
BLOCK = 4
"""Consecutive batches of a busy period whose residuals are summed before judging the fit's scatter."""


class BusyBatches(NamedTuple):
    """One entry per batch that ran right after the previous one on its prefill instance."""

    sizes: np.ndarray
    """The previous batch's size."""
    intervals: np.ndarray
    """The time between the two batches' ends."""
    excess: np.ndarray
    """That time less the batch's modelled compute (what h should explain)."""
    periods: np.ndarray
    """Which busy period (a chain of back-to-back batches on one instance) the batch belongs to."""


def computed_tokens(row: dict[str, Any]) -> float:
    """Prompt tokens a request's prefill computed: all of them, less what its engine reported cached."""
    return float(row["prompt_tokens"]) - float(row.get("cached_tokens") or 0)


def busy_batches(rows: list[dict[str, Any]], profile: PerfProfile) -> BusyBatches:
    """Every back-to-back prefill batch of a run, with its busy period (see BusyBatches)."""
    by_instance: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if (
            r["prefill_instance"]
            and r["prefill_start"] is not None
            and r["prefill_end"] is not None
            and r["prompt_tokens"]
        ):
            by_instance[r["prefill_instance"]].append(r)
    sizes: list[float] = []
    intervals: list[float] = []
    excess: list[float] = []
    periods: list[int] = []
    period = -1
    for mine in by_instance.values():
        mine.sort(key=lambda r: r["prefill_end"])
        batches: list[list[dict[str, Any]]] = []
        for r in mine:
            if batches and r["prefill_end"] - batches[-1][-1]["prefill_end"] <= BATCH_GAP_S:
                batches[-1].append(r)
            else:
                batches.append([r])
        chained = False
        for prev, cur in zip(batches, batches[1:], strict=False):
            if max(r["prefill_start"] for r in cur) >= min(r["prefill_end"] for r in prev):
                chained = False
                continue  # a request of this batch arrived after the previous one ended: not back to back
            period += 0 if chained else 1
            chained = True
            lens = np.array([float(r["prompt_tokens"]) for r in cur])
            computed = np.array([computed_tokens(r) for r in cur])  # what the prefill computed: the uncached rest
            compute = profile.prefill_batch_time(computed) + profile.step_time(len(cur), float(lens.sum()))
            interval = max(r["prefill_end"] for r in cur) - max(r["prefill_end"] for r in prev)
            sizes.append(float(len(prev)))
            intervals.append(interval)
            excess.append(interval - compute)
            periods.append(period)
    return BusyBatches(np.array(sizes), np.array(intervals), np.array(excess), np.array(periods, dtype=int))


def fit_host_work(rows: list[dict[str, Any]], profile: PerfProfile, prior: float) -> LinearFit:
    """`prefill_host_per_request_s` from a run's back-to-back prefill batches: Σ excess / Σ size of
    the previous batches (see the module docstring). Fitted when the 1σ uncertainty of the busy time
    it accounts for (h·Σ size) is within IDENTIFIED of the measured busy time (Σ interval)."""
    name = "prefill_host_per_request_s"
    sizes, intervals, excess, periods = busy_batches(rows, profile)
    n = len(sizes)
    if n < MIN_BATCHES:
        why = f"prior: only {n} back-to-back prefill batches (a fit needs {MIN_BATCHES}; they happen under load)"
        return LinearFit({name: Term(name, prior, prior, why, samples=n)}, n, 0, math.nan, math.nan)
    h = float(np.sum(excess) / np.sum(sizes))
    r = excess - sizes * h
    # The scatter is taken over blocks of up to BLOCK consecutive batches of one busy period: a batch
    # the 5 ms rule splits in two leaves one long and one short interval, which cancel in a block.
    blocks = _blocks(periods)
    by_block = np.bincount(blocks, weights=r)
    m = len(by_block)
    se = math.sqrt(float(np.sum(by_block**2)) * m / (m - 1)) / float(np.sum(sizes))  # of a ratio of totals
    rel_se = se * float(np.sum(sizes)) / (float(np.sum(intervals)) or 1.0)
    rel_rms = math.sqrt(float(np.mean(by_block**2))) / (float(np.mean(np.bincount(blocks, weights=intervals))) or 1.0)
    if rel_se > IDENTIFIED and abs(h - prior) > REJECT_SE * se:
        # too uncertain to count as fitted, but far enough from the prior to reject it: the run's
        # estimate (at least 0) is nearer the truth than a prior it rules out
        term = Term(
            name,
            max(h, 0.0),
            prior,
            f"fit: uncertain (±{rel_se:.0%} of the busy time of back-to-back prefill batches), "
            f"{h * 1e3:.2f} ± {se * 1e3:.2f} ms, {abs(h - prior) / max(se, 1e-12):.0f} standard errors from the prior "
            f"{prior * 1e3:.2f} ms" + (" (clipped at 0)" if h < 0 else ""),
            rel_rms,
            n,
            n,
            rel_se,
        )
    elif rel_se > IDENTIFIED:
        term = Term(
            name,
            prior,
            prior,
            f"prior: too uncertain: ±{rel_se:.0%} of the busy time of back-to-back "
            f"prefill batches (±{IDENTIFIED:.0%} or less counts as fitted)",
            rel_rms,
            n,
            n,
            rel_se,
        )
    elif h < 0:
        term = Term(name, 0.0, prior, f"fit: clipped at 0 (estimate {h:.3g} ± {se:.2g})", rel_rms, n, n, rel_se)
    else:
        term = Term(name, h, prior, "fit", rel_rms, n, n, rel_se)
    return LinearFit({name: term}, n, n, rel_rms, 1.0)


def _blocks(periods: np.ndarray) -> np.ndarray:
    """Block index of each batch: runs of up to BLOCK consecutive batches within one busy period."""
    blocks = np.zeros(len(periods), dtype=int)
    block, count = 0, 0
    for i in range(len(periods)):
        if i and (periods[i] != periods[i - 1] or count == BLOCK):
            block, count = block + 1, 0
        blocks[i] = block
        count += 1
    return blocks

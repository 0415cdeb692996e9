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
previous batch's size (robust least squares through the origin); with too few back-to-back
batches, or too uncertain a slope, h keeps its prior.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from console.calibration_fit import IDENTIFIED, LinearFit, Term, estimate
from core.perf import PerfProfile

BATCH_GAP_S = 0.005
"""Prefill legs whose ends lie this close were answered from one engine step."""
MIN_BATCHES = 8


def busy_batches(rows: list[dict[str, Any]], profile: PerfProfile) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every batch that ran right after the previous one on its prefill instance: the previous
    batch's size, the time between the two batches' ends, and that time less the batch's modelled
    compute (the excess h should explain)."""
    by_instance: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["prefill_instance"] and r["prefill_start"] is not None and r["prefill_end"] is not None and r["prompt_tokens"]:
            by_instance[r["prefill_instance"]].append(r)
    sizes: list[float] = []
    intervals: list[float] = []
    excess: list[float] = []
    for mine in by_instance.values():
        mine.sort(key=lambda r: r["prefill_end"])
        batches: list[list[dict[str, Any]]] = []
        for r in mine:
            if batches and r["prefill_end"] - batches[-1][-1]["prefill_end"] <= BATCH_GAP_S:
                batches[-1].append(r)
            else:
                batches.append([r])
        for prev, cur in zip(batches, batches[1:], strict=False):
            if max(r["prefill_start"] for r in cur) >= min(r["prefill_end"] for r in prev):
                continue  # a request of this batch arrived after the previous one ended: not back to back
            lens = np.array([float(r["prompt_tokens"]) for r in cur])
            compute = profile.prefill_batch_time(lens) + profile.step_time(len(cur), float(lens.sum()))
            interval = max(r["prefill_end"] for r in cur) - max(r["prefill_end"] for r in prev)
            sizes.append(float(len(prev)))
            intervals.append(interval)
            excess.append(interval - compute)
    return np.array(sizes), np.array(intervals), np.array(excess)


def fit_host_work(rows: list[dict[str, Any]], profile: PerfProfile, prior: float) -> LinearFit:
    """`prefill_host_per_request_s` from a run's back-to-back prefill batches: robust least squares
    of the excess on the previous batch's size, through the origin. Fitted when its 1σ uncertainty,
    times a typical previous batch, is within IDENTIFIED of a typical interval between batch ends."""
    name = "prefill_host_per_request_s"
    sizes, intervals, excess = busy_batches(rows, profile)
    n = len(sizes)
    if n < MIN_BATCHES:
        why = f"prior: only {n} back-to-back prefill batches (a fit needs {MIN_BATCHES}; they happen under load)"
        return LinearFit({name: Term(name, prior, prior, why, samples=n)}, n, 0, math.nan, math.nan)
    coef, used = estimate(sizes[:, None], excess, "robust")
    h = float(coef[0])
    x, r = sizes[used], (excess - sizes * h)[used]
    se = math.sqrt(float(np.sum(r**2)) / max(len(r) - 1, 1) / float(np.sum(x**2)))
    typical = float(np.median(intervals)) or 1.0
    rel_se = se * float(np.median(sizes)) / typical
    rel_rms = math.sqrt(float(np.mean(r**2))) / (float(np.mean(intervals[used])) or 1.0)
    if rel_se > IDENTIFIED:
        term = Term(name, prior, prior, f"prior: too uncertain: ±{rel_se:.0%} of a typical interval between back-to-back "
                    f"prefill batches (±{IDENTIFIED:.0%} or less counts as fitted)", rel_rms, n, int(used.sum()), rel_se)
    elif h < 0:
        term = Term(name, 0.0, prior, f"fit: clipped at 0 (estimate {h:.3g} ± {se:.2g})", rel_rms, n, int(used.sum()), rel_se)
    else:
        term = Term(name, h, prior, "fit", rel_rms, n, int(used.sum()), rel_se)
    return LinearFit({name: term}, n, int(used.sum()), rel_rms, 1.0)

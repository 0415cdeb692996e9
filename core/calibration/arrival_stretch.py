"""What a prompt reaching a busy prefill instance adds to the step under way there, fitted from a run's burst heads.

On vLLM-cpu the API server takes each arriving prompt in on the engine's core, so the step under way
when prompts arrive runs longer. In the stage's stores of 2026-11-30 a prompt that found its
instance idle ran ~2.7 ms (Mooncake slices, 21 such heads) to ~4.7 ms (Azure rounds, 43 heads)
longer per prompt arriving during its leg, where the intake of a prompt reaching an idle instance
is 1.35 ms (vLLM's step log; docs/fidelity.md). The profile's `prefill_arrival_stretch_s` (a)
models it; the arriving prompts' intake still follows the step (core/calibration/host.py).

A head is a prefill leg that reached its instance idle: every prefill sent there before it had
ended. Its residual is the leg less the HTTP round trip to the instance, its intake, its step, the
prefill of the tokens it computed and the wake-up after its idle time, as the profile just fitted
gives them. k is the number of prompts reaching the instance during its step (`arrivals_in_step`). The residuals are
regressed on k with an intercept (what the lone legs leave on average), by least squares, refitted
after dropping the heads whose residuals lie beyond OUTLIER_MADS (scaled) MADs of the first fit. a
is fitted when at least MIN_HEADS heads had arrivals during their leg and the slope is MIN_T_STAT
standard errors above 0. A slope too small to tell from 0 that still rules the prior out
(`fit.rules_out_prior`) replaces it, clipped at 0. Otherwise the prior stands. The host's streaming
(`host_stretch`) is left out of the residuals: a burst head streams nothing of its own, and the
streaming term's fit subtracts this term first.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from core.calibration.fit import LinearFit, Term, rules_out_prior
from core.calibration.host import computed_tokens
from core.perf import PerfProfile

NAME = "prefill_arrival_stretch_s"
MIN_HEADS = 8
"""Heads with prompts arriving during their leg, at least, for a fit."""
MIN_T_STAT = 3.0
"""The fitted slope must be this many standard errors above zero."""
OUTLIER_MADS = 5.0

Row = dict[str, Any]


def arrivals_in_step(rows: list[Row], legs: list[Row], profile: PerfProfile, rtt: dict[str, float]) -> np.ndarray:
    """For each of `legs` (prefill legs among `rows`): the prompts that reached its instance during its step,
    counted as those sent to the instance after the leg's start plus its intake h and before its end less the
    HTTP round trip (a prompt reaches the instance half a round trip after it is sent, and the leg's answer
    leaves it half a round trip before the gateway sees it)."""
    by_instance: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["prefill_instance"] and r["prefill_start"] is not None:
            by_instance[r["prefill_instance"]].append(float(r["prefill_start"]))
    sent = {inst: np.sort(times) for inst, times in by_instance.items()}
    h = profile.prefill_host_per_request_s
    out = np.zeros(len(legs))
    for i, r in enumerate(legs):
        mine, t0, t1 = sent[r["prefill_instance"]], float(r["prefill_start"]), float(r["prefill_end"])
        last = t1 - rtt.get(r["prefill_instance"], 0.0)
        out[i] = max(int(np.searchsorted(mine, last, "left") - np.searchsorted(mine, t0 + h, "right")), 0)
    return out


def heads(rows: list[Row], profile: PerfProfile, rtt: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
    """Every prefill leg that found its instance idle: the prompts that reached it during its step
    (`arrivals_in_step`) and its residual."""
    by_instance: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        if r["prefill_instance"] and r["prefill_start"] is not None:
            by_instance[r["prefill_instance"]].append(r)
    found: list[Row] = []
    resid: list[float] = []
    for inst, mine in by_instance.items():
        mine.sort(key=lambda r: float(r["prefill_start"]))
        busy_until = -math.inf  # the latest end of the prefills sent there before
        for r in mine:
            t0 = float(r["prefill_start"])
            idle = busy_until < t0
            if r["prefill_end"] is None:
                busy_until = math.inf  # it never ended: nothing after it is known to find the instance idle
                continue
            t1 = float(r["prefill_end"])
            if idle and r["prompt_tokens"]:
                model = (
                    profile.prefill_host_per_request_s
                    + float(profile.prefill_time(computed_tokens(r)))
                    + float(profile.step_time(1, float(r["prompt_tokens"])))
                    + profile.wake_time(t0 - busy_until)
                )
                found.append(r)
                resid.append(t1 - t0 - rtt.get(inst, 0.0) - model)
            busy_until = max(busy_until, t1)
    return arrivals_in_step(rows, found, profile, rtt), np.array(resid)


def fit_arrival_stretch(rows: list[Row], profile: PerfProfile, rtt: dict[str, float], prior: float) -> LinearFit:
    """`prefill_arrival_stretch_s` from a run's requests (see the module docstring); `profile` holds the run's
    fitted legs and wake-up, `prior` the value kept when the run does not identify it."""
    k, y = heads(rows, profile, rtt)
    busy = int(np.sum(k > 0))
    n = len(y)

    def kept(why: str, rel_rms: float = math.nan, rel_se: float | None = None) -> LinearFit:
        return LinearFit({NAME: Term(NAME, prior, prior, f"prior: {why}", rel_rms, n, n, rel_se)}, n, n, rel_rms, 1.0)

    if busy < MIN_HEADS or len(np.unique(k)) < 2:
        return kept(
            f"{busy} prefill legs found their instance idle with prompts arriving during them (a fit needs {MIN_HEADS})"
        )
    x = np.stack([np.ones_like(k), k], axis=1)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    r = y - x @ coef  # outliers judged on the regression's residuals: the raw ones carry the slope
    med = float(np.median(r))
    keep = np.abs(r - med) <= OUTLIER_MADS * (1.4826 * float(np.median(np.abs(r - med))) or 1e-9)
    x, y, n = x[keep], y[keep], int(np.sum(keep))
    busy = int(np.sum(x[:, 1] > 0))
    if busy < MIN_HEADS or len(np.unique(x[:, 1])) < 2:
        return kept(f"{busy} heads with arrivals left after dropping outliers (a fit needs {MIN_HEADS})")
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    r = y - x @ coef
    cov = np.linalg.pinv(x.T @ x) * float(r @ r) / max(n - 2, 1)
    slope, se = float(coef[1]), math.sqrt(max(float(cov[1, 1]), 0.0))
    rel_rms = math.sqrt(float(np.mean(r**2))) / (float(np.mean(np.abs(y))) or 1.0)
    rel_se = se / slope if slope > 0 else math.inf
    estimate = f"{slope * 1e3:.2f} ± {se * 1e3:.2f} ms per prompt arriving, over {n} heads ({busy} with arrivals)"
    if slope > 0 and slope >= MIN_T_STAT * se:
        term = Term(NAME, slope, prior, f"fit: {estimate}", rel_rms, n, n, rel_se)
        return LinearFit({NAME: term}, n, n, rel_rms, 1.0)
    if rules_out_prior(slope, se, prior):
        src = f"fit: small, {estimate}, {abs(slope - prior) / max(se, 1e-12):.0f} standard errors from the prior"
        src += f" {prior * 1e3:.2f} ms" + (" (clipped at 0)" if slope < 0 else "")
        term = Term(NAME, max(slope, 0.0), prior, src, rel_rms, n, n, rel_se)
        return LinearFit({NAME: term}, n, n, rel_rms, 1.0)
    return kept(f"not identified: {estimate} (a fit needs {MIN_T_STAT:g} standard errors above 0)", rel_rms, rel_se)

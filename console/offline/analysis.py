"""Run analysis from the store: per-run metrics, side-by-side comparison, time series for plots."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from adapters.store import RunStore
from core.slo import DEFAULT_SLO, percentile

METRICS = (
    "requests",
    "failed",
    "throughput_tok_s",
    "ttft_p50",
    "ttft_p99",
    "tpot_mean",
    "tpot_p50",
    "tpot_p99",
    "tpot_p999",
    "tpot_unknown",
    "cached_share",
    "slo_attainment",
    "goodput_req_s",
)
LOWER_IS_BETTER = {"failed", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99", "tpot_p999"}
NEUTRAL = {"requests", "tpot_unknown", "cached_share"}
"""Metrics whose difference is neither better nor worse (no colour in `runs compare`)."""


def _col(rows: list[dict[str, Any]], key: str) -> np.ndarray:
    return np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=float)


def run_metrics(rows: list[dict[str, Any]]) -> dict[str, float | int | None]:
    """Metrics of one run from its request records (times in seconds).

    A NULL TPOT (a whole, non-streamed reply) or TTFT was not measured: it is left out of the
    percentiles, counted in `tpot_unknown`, and a row without `slo_met` is judged on what is known."""
    n = len(rows)
    ok = np.array([r["status"] == "ok" for r in rows], dtype=bool)
    ttft, tpot = _col(rows, "ttft")[ok], _col(rows, "tpot")[ok]
    arrival, finish = _col(rows, "arrival"), _col(rows, "finish")
    tokens = float(np.nansum(_col(rows, "output_tokens")[ok]))
    span = float(np.nanmax(finish[ok]) - np.nanmin(arrival)) if ok.any() else 0.0
    met = np.array(
        [
            bool(r["slo_met"])
            if r.get("slo_met") is not None
            else (
                r["status"] == "ok"
                and (r["ttft"] is None or r["ttft"] <= DEFAULT_SLO.ttft_s)
                and (r["tpot"] is None or r["tpot"] <= DEFAULT_SLO.tpot_s)
            )
            for r in rows
        ]
    )

    def pct(values: np.ndarray, q: float) -> float | None:
        v = values[~np.isnan(values)]
        return percentile(v, q) if len(v) else None

    return {
        "requests": n,
        "failed": int(n - ok.sum()),
        "throughput_tok_s": tokens / span if span > 0 else None,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "tpot_mean": float(np.nanmean(tpot)) if len(tpot) and not np.isnan(tpot).all() else None,
        "tpot_p50": pct(tpot, 50),
        "tpot_p99": pct(tpot, 99),
        "tpot_p999": pct(tpot, 99.9),
        "tpot_unknown": int(np.isnan(tpot).sum()),
        "cached_share": _cached_share(rows),
        "slo_attainment": float(met.mean()) if n else None,
        "goodput_req_s": float(met.sum() / span) if span > 0 else None,
    }


def _cached_share(rows: list[dict[str, Any]]) -> float | None:
    """Prompt tokens served from a prefix cache ÷ prompt tokens, over the rows that report it (None: none do)."""
    known = [r for r in rows if r.get("cached_tokens") is not None and r.get("prompt_tokens")]
    total = sum(int(r["prompt_tokens"]) for r in known)
    return sum(int(r["cached_tokens"]) for r in known) / total if total else None


def policy_timeline(store: RunStore, run_id: str) -> list[str]:
    """A run's policy changes, one line each ("12s least_load{...} (cli)")."""
    return [f"{e['t']:.0f}s {e['new']}{e['params'] or ''} ({e['source']})" for e in store.policy_events(run_id)]


def relative_to(base: Mapping[str, Any], metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """Each metric's relative difference to `base` (None where either is unknown or the base is 0)."""
    return {
        k: (metrics[k] / base[k] - 1.0)
        if isinstance(base.get(k), int | float) and base[k] and metrics[k] is not None
        else None
        for k in METRICS
    }


def compare(store: RunStore, run_ids: list[str]) -> list[dict[str, Any]]:
    """One entry per run: info, metrics, policy timeline, and relative differences to the first run."""
    out: list[dict[str, Any]] = []
    for rid in run_ids:
        info = store.get_run(rid)
        m = run_metrics(store.requests(info.run_id))
        out.append({"run": info.to_json(), "metrics": m, "policy_timeline": policy_timeline(store, info.run_id)})
    base = out[0]["metrics"] if out else {}
    for entry in out:
        entry["relative"] = relative_to(base, entry["metrics"])
    return out


def series(
    store: RunStore, run_id: str, metric: str, window_s: float = 10.0
) -> dict[str, tuple[list[float], list[float]]]:
    """Named (x, y) series for `runs plot`: per-request TTFT/TPOT, windowed attainment, or load."""
    if metric == "load":
        by: dict[str, tuple[list[float], list[float]]] = {}
        for s in store.instance_samples(run_id):
            if s["role"] in ("decode", "both"):
                xs, ys = by.setdefault(s["instance_id"], ([], []))
                xs.append(s["t"])
                ys.append(float(s["running"]))
        return by
    rows = [r for r in store.requests(run_id) if r["status"] == "ok" and r.get("finish") is not None]
    rows.sort(key=lambda r: r["finish"])
    if metric in ("ttft", "tpot"):  # requests whose latency was not measured (whole replies' TPOT) are not drawn
        rows = [r for r in rows if r[metric] is not None]
        return {f"{metric} (ms)": ([r["finish"] for r in rows], [r[metric] * 1000 for r in rows])}
    if metric == "attainment":
        all_rows = sorted(
            (r for r in store.requests(run_id) if r.get("finish") is not None or r.get("arrival") is not None),
            key=lambda r: r.get("finish") or r["arrival"],
        )
        if not all_rows:
            return {"attainment (%)": ([], [])}
        end = max((r.get("finish") or r["arrival"]) for r in all_rows)
        xs, ys = [], []
        t = window_s
        while t <= end + window_s:
            win = [r for r in all_rows if t - window_s <= (r.get("finish") or r["arrival"]) < t]
            if win:
                xs.append(t)
                ys.append(100.0 * sum(bool(r.get("slo_met")) for r in win) / len(win))
            t += window_s
        return {"attainment (%)": (xs, ys)}
    raise ValueError(f"unknown metric {metric!r}; metrics: tpot, ttft, attainment, load")

"""The figures the advisor compares: TTFT/TPOT p50/p99, attainment, refusals, prefix hit rate, observed or predicted."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from console.offline.analysis import run_metrics
from core.sim.cluster import ClusterSimResult
from core.slo import DEFAULT_SLO, SLOClass, met, percentile

REFUSED_IN_SIM = ("shed", "expired", "no_capacity", "kv_capacity")
"""Simulated statuses that are refusals (the request never ran): the queue shed or expired it, or no
instance could take it."""


@dataclass(frozen=True, slots=True)
class Figures:
    """One policy's figures over a window (seconds; None: nothing to measure it on)."""

    requests: int
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    attainment: float | None
    """Share of the window's requests that met their SLO class (refused and failed ones miss)."""
    refusals: int
    """Requests turned away before any instance ran them."""
    prefix_hit_rate: float | None
    """Prompt tokens found in a prefix cache ÷ prompt tokens (None: not reported, or no cache modelled)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _known(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else float(x)


def observed_figures(rows: Sequence[Mapping[str, Any]]) -> Figures:
    """A window's figures from its stored request rows (the run store's columns), as `runs show` computes them.

    A refusal is a failed row that never reached a prefill instance (shed, expired, abandoned in the
    queue, no capacity, a tenant's limit)."""
    m = run_metrics([dict(r) for r in rows])
    refused = sum(1 for r in rows if r["status"] != "ok" and r.get("prefill_start") is None)
    return Figures(
        requests=len(rows),
        ttft_p50=_known(m["ttft_p50"]),
        ttft_p99=_known(m["ttft_p99"]),
        tpot_p50=_known(m["tpot_p50"]),
        tpot_p99=_known(m["tpot_p99"]),
        attainment=_known(m["slo_attainment"]),
        refusals=refused,
        prefix_hit_rate=_known(m["cached_share"]),
    )


def predicted_figures(
    result: ClusterSimResult,
    measured: np.ndarray,
    slo_classes: Sequence[str] | None = None,
    slos: dict[str, SLOClass] | None = None,
) -> Figures:
    """A simulation's figures over the rows `measured` selects (the window's own arrivals, not the
    requests in flight at its start that were replayed to load the cluster)."""
    sel = np.asarray(measured, dtype=bool)
    ok = result.ok.astype(bool) & sel
    ttft = np.where(ok, result.first_token - result.arrival, np.nan)
    steps = np.maximum(result.output_tokens - 1, 1)
    tpot = np.where(ok & (result.output_tokens > 1), (result.finish - result.first_token) / steps, np.nan)
    classes = list(slo_classes) if slo_classes is not None else None
    meets = met(ttft, tpot, ok, slos or DEFAULT_SLO, classes)
    n = int(sel.sum())
    prompts = int(result.prompt_tokens[sel].sum())
    cached = int(result.cached_tokens[sel].sum()) if len(result.cached_tokens) else 0
    return Figures(
        requests=n,
        ttft_p50=_known(percentile(ttft[ok], 50)),
        ttft_p99=_known(percentile(ttft[ok], 99)),
        tpot_p50=_known(percentile(tpot[~np.isnan(tpot)], 50)),
        tpot_p99=_known(percentile(tpot[~np.isnan(tpot)], 99)),
        attainment=float(meets[sel].mean()) if n else None,
        refusals=int(np.isin(result.status[sel], REFUSED_IN_SIM).sum()) if len(result.status) else 0,
        prefix_hit_rate=cached / prompts if result.cache_block_size and prompts else None,
    )

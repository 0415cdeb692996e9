"""The policy canary's /metrics series: whether one runs, its share, its arms so far, and the verdicts by outcome."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from console.live.canary import ARMS, LiveCanary, RunningCanary


def _p99(rows: Sequence[Mapping[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in rows if r["status"] == "ok" and r.get(key) is not None]
    return float(np.percentile(values, 99)) if values else math.nan


def arm_figures(rows: Sequence[Mapping[str, Any]]) -> tuple[int, float, float, float]:
    """An arm's finished requests so far: how many, the share that met its SLO (failed ones miss), and P99 TTFT
    and TPOT of the successful ones, as the canary's readings take them (NaN: nothing to measure it on)."""
    n = len(rows)
    attainment = sum(1 for r in rows if r.get("slo_met")) / n if n else math.nan
    return n, attainment, _p99(rows, "ttft"), _p99(rows, "tpot")


class CanaryCollector(Collector):
    """The canary's series at scrape time: whether one runs and its share (labels pool: the running or last
    canary's, kind, candidate), each arm's finished requests, SLO attainment and P99 TTFT/TPOT so far (label arm
    too), and verdicts by outcome."""

    def __init__(self, canary: LiveCanary) -> None:
        self.canary = canary
        self._figures: tuple[tuple[str, int, int], dict[str, tuple[int, float, float, float]]] | None = None
        """The arms' figures and the (canary, rows per arm) they were computed on: recomputed when rows arrive."""

    def describe(self) -> list[Any]:
        return []

    def _arms(self, c: RunningCanary) -> dict[str, tuple[int, float, float, float]]:
        key = (c.id, len(c.arms["canary"]), len(c.arms["control"]))
        if self._figures is None or self._figures[0] != key:
            self._figures = key, {arm: arm_figures(list(c.arms[arm])) for arm in ARMS}
        return self._figures[1]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["pool", "kind", "candidate"]
        running = GaugeMetricFamily(
            "sibyl_canary_running",
            "1 while a policy canary runs; 0 for the last one once it ended (no series before the first)",
            labels=labels,
        )
        share = GaugeMetricFamily(
            "sibyl_canary_share", "the running canary's share of new requests, 0..0.5", labels=labels
        )
        arm = [*labels, "arm"]
        requests = GaugeMetricFamily(
            "sibyl_canary_arm_requests",
            "finished requests of each arm of the running canary (those that arrived after it started)",
            labels=arm,
        )
        attainment = GaugeMetricFamily(
            "sibyl_canary_arm_attainment",
            "SLO attainment of each arm of the running canary so far, 0..1 (failed requests miss; NaN: none yet)",
            labels=arm,
        )
        ttft = GaugeMetricFamily(
            "sibyl_canary_arm_ttft_p99_seconds",
            "P99 TTFT of each arm's successful requests so far (NaN: none yet)",
            labels=arm,
        )
        tpot = GaugeMetricFamily(
            "sibyl_canary_arm_tpot_p99_seconds",
            "P99 TPOT of each arm's successful streamed requests so far (NaN: none yet)",
            labels=arm,
        )
        c, last = self.canary.current, self.canary.last
        if c is not None:
            values = [c.pool.name, c.plan.kind.value, c.plan.name]
            running.add_metric(values, 1)
            share.add_metric(values, c.plan.share)
            for name, (n, met, ttft_p99, tpot_p99) in self._arms(c).items():
                requests.add_metric([*values, name], n)
                attainment.add_metric([*values, name], met)
                ttft.add_metric([*values, name], ttft_p99)
                tpot.add_metric([*values, name], tpot_p99)
        elif last is not None:
            running.add_metric([str(last["pool"]), str(last["plan"]["kind"]), str(last["plan"]["name"])], 0)
        yield from (running, share, requests, attainment, ttft, tpot)
        verdicts = CounterMetricFamily(
            "sibyl_canary_verdicts",
            "policy canaries ended, by outcome: promote, rollback, equal, inconclusive (the stopping rule's "
            "verdicts) or interrupted (stopped by the operator, a swap of its kind or the console stopping)",
            labels=["outcome"],
        )
        for outcome, count in self.canary.verdicts.items():
            verdicts.add_metric([outcome], count)
        yield verdicts

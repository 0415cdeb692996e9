"""The dispatcher's decision log built from [decisions], and decision quality as metrics and in the run summary."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from core.decision_log import DecisionLog, DecisionSettings

if TYPE_CHECKING:
    from core.dispatch import Dispatcher


def decision_log(settings: DecisionSettings, sink: Any) -> DecisionLog:
    """The dispatcher's log; `sink(records)` receives every record (the run store's recorder)."""
    return DecisionLog(settings.sample_rate, settings.max_per_s, settings.keep, sink)


def quality(d: Dispatcher) -> dict[str, Any]:
    """Decision quality so far: the share of decode choices still the least loaded at handoff, and the
    prefix hit the routing achieved against the best it could have had (tokens)."""
    hits = d.prefix_hits
    log = d.decisions
    return {
        "decode_still_best": None if not d.score.total else d.score.hits / d.score.total,
        "decode_scored": d.score.total,
        "prefix_achieved_tokens": hits.achieved_tokens,
        "prefix_achievable_tokens": hits.achievable_tokens,
        "prefix_hit_share": None if math.isnan(hits.share) else hits.share,
        "prefix_decisions": hits.decisions,
        "records": log.counts() if log is not None else None,
    }


class QualityCollector(Collector):
    """Decision quality read from each pool's dispatcher at scrape time (nothing on the hot path), every series
    labelled with its pool's name (`pool`)."""

    def __init__(self, dispatchers: Callable[[], Iterable[tuple[str, Dispatcher]]]) -> None:
        self.dispatchers = dispatchers
        """Each pool's name and its dispatcher."""

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        scored = CounterMetricFamily(
            "sibyl_decode_choices_scored",
            "decode choices scored when decoding began, per pool (router: active, or a shadow policy's label)",
            labels=["pool", "router"],
        )
        best = CounterMetricFamily(
            "sibyl_decode_choices_still_best",
            "decode choices still the least loaded routable instance when decoding began, per pool",
            labels=["pool", "router"],
        )
        achievable = CounterMetricFamily(
            "sibyl_prefix_achievable_tokens",
            "prompt tokens the best routable instance had cached when each request was routed, per pool",
            labels=["pool"],
        )
        achieved = CounterMetricFamily(
            "sibyl_prefix_achieved_tokens",
            "prompt tokens cached on the instance each request's prompt was routed to, per pool",
            labels=["pool"],
        )
        records = CounterMetricFamily(
            "sibyl_decision_records", "decision records made (core/decision_records.py), per pool", labels=["pool"]
        )
        skipped = CounterMetricFamily(
            "sibyl_decision_requests_unsampled",
            "requests whose decisions were not recorded, by reason (rate: the sample rate; bound: max_per_s), per pool",
            labels=["pool", "reason"],
        )
        for pool, d in self.dispatchers():
            scored.add_metric([pool, "active"], d.score.total)
            best.add_metric([pool, "active"], d.score.hits)
            for label, s in d.scores.items():
                scored.add_metric([pool, label], s.total)
                best.add_metric([pool, label], s.hits)
            achievable.add_metric([pool], d.prefix_hits.achievable_tokens)
            achieved.add_metric([pool], d.prefix_hits.achieved_tokens)
            log = d.decisions
            records.add_metric([pool], log.recorded if log is not None else 0)
            skipped.add_metric([pool, "rate"], log.skipped_rate if log is not None else 0)
            skipped.add_metric([pool, "bound"], log.skipped_bound if log is not None else 0)
        yield from (scored, best, achievable, achieved, records, skipped)

"""The dispatcher's decision log built from [decisions], and decision quality as metrics and in the run summary."""

from __future__ import annotations

import math
from collections.abc import Iterator
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
    """Decision quality read from the dispatcher at scrape time (nothing on the hot path)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        d = self.d
        scored = CounterMetricFamily(
            "sibyl_decode_choices_scored",
            "decode choices scored when decoding began (router: active, or a shadow policy's label)",
            labels=["router"],
        )
        best = CounterMetricFamily(
            "sibyl_decode_choices_still_best",
            "decode choices still the least loaded routable instance when decoding began",
            labels=["router"],
        )
        scored.add_metric(["active"], d.score.total)
        best.add_metric(["active"], d.score.hits)
        for label, s in d.scores.items():
            scored.add_metric([label], s.total)
            best.add_metric([label], s.hits)
        yield scored
        yield best
        hits = d.prefix_hits
        yield CounterMetricFamily(
            "sibyl_prefix_achievable_tokens",
            "prompt tokens the best routable instance had cached when each request was routed",
            value=hits.achievable_tokens,
        )
        yield CounterMetricFamily(
            "sibyl_prefix_achieved_tokens",
            "prompt tokens cached on the instance each request's prompt was routed to",
            value=hits.achieved_tokens,
        )
        log = d.decisions
        records = CounterMetricFamily("sibyl_decision_records", "decision records made (core/decision_records.py)")
        records.add_metric([], log.recorded if log is not None else 0)
        yield records
        skipped = CounterMetricFamily(
            "sibyl_decision_requests_unsampled",
            "requests whose decisions were not recorded, by reason (rate: the sample rate; bound: max_per_s)",
            labels=["reason"],
        )
        skipped.add_metric(["rate"], log.skipped_rate if log is not None else 0)
        skipped.add_metric(["bound"], log.skipped_bound if log is not None else 0)
        yield skipped

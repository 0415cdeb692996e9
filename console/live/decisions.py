"""The live console's decision records: sampling settings, the run-store sink, recent requests per
instance, the request inspector's answers, and decision quality as metrics and in the run summary."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from core.decision_log import DecisionLog, DecisionSettings

if TYPE_CHECKING:
    from console.live.record import RequestRecord, RequestRow
    from core.dispatch import Dispatcher

RECENT_REQUESTS = 1000
"""Finished requests the inspector can still list (their stored rows, newest last)."""


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
        records = CounterMetricFamily("sibyl_decision_records", "decision records made (core/decisions.py)")
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


class RecentRequests:
    """A RunLog in front of the run's recorder that keeps the last finished requests' stored rows (the
    inspector lists them); each request's typed row becomes the store's dict here, and only here."""

    def __init__(self, log: Any, keep: int = RECENT_REQUESTS) -> None:
        self._log = log
        self.rows: deque[dict[str, Any]] = deque(maxlen=keep)

    def request(self, row: RequestRow) -> None:
        stored = row.stored()
        self.rows.append(stored)
        self._log.request(stored)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)


def _live_row(live: RequestRecord, rel: Any) -> dict[str, Any]:
    return {
        "request_id": live.id,
        "status": "in_flight",
        "step": live.step.value,
        "arrival": rel(live.request.arrival),
        "prompt_tokens": live.request.prompt_tokens,
        "output_tokens": live.output_tokens,
        "prefill_instance": live.prefill_instance,
        "decode_instance": live.decode_instance,
    }


_ROW_KEYS = ("request_id", "status", "arrival", "prompt_tokens", "output_tokens", "prefill_instance")


def instance_requests(
    instance: str,
    live: Mapping[str, RequestRecord],
    recent: RecentRequests,
    log: DecisionLog | None,
    rel: Any,
    limit: int,
) -> list[dict[str, Any]]:
    """The instance's requests, newest first: those in flight on it, then those that finished there
    (as prefill or decode instance), each marked with whether its decisions are in memory."""
    on = [_live_row(r, rel) for r in live.values() if instance in (r.prefill_instance, r.decode_instance)]
    on.sort(key=lambda r: -(r["arrival"] or 0.0))
    done: list[dict[str, Any]] = []
    for row in reversed(recent.rows):
        if len(on) + len(done) >= limit:
            break
        if instance in (row.get("prefill_instance"), row.get("decode_instance")):
            done.append(
                {
                    **{k: row.get(k) for k in _ROW_KEYS},
                    "step": "finished" if row.get("status") == "ok" else "failed",
                    "decode_instance": row.get("decode_instance"),
                    "ttft": row.get("ttft"),
                    "e2e": row.get("e2e"),
                }
            )
    out = (on + done)[:limit]
    ids = {d.request_id for d in log.ring} if log is not None else set()
    for r in out:
        r["decisions"] = r["request_id"] in ids
    return out


def request_decisions(request_id: str, log: DecisionLog | None, t0: float) -> dict[str, Any]:
    """A request's records still in memory (times relative to the console's start)."""
    records = log.of_request(request_id) if log is not None else []
    out = []
    for d in records:
        js = d.to_json()
        js["t"] = d.t - t0
        out.append(js)
    note = ""
    if not out:
        if log is None:
            note = "decision records are off ([decisions] sample_rate = 0)"
        else:
            note = (
                f"no decisions of {request_id} in memory: not sampled (sample_rate {log.sample_rate}, at most "
                f"{log.max_per_s} requests/s), or older than the {log.ring.maxlen} latest records; "
                "`sibyl-console runs why` reads the run store"
            )
    return {"request_id": request_id, "decisions": out, "note": note}

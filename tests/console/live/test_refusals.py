"""Admission's refusals by cause: one event line per cause per window with its count (not one per
request), the /metrics series, and which refused requests the lines tell instead of failure events."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from console.live.admission import WAIT_BOUND_EXPIRY
from console.live.events import EventBus
from console.live.outcomes import Outcomes
from console.live.record import Outcome, Step
from console.live.refusals import RefusalCollector, RefusalLines, counted_by_admission, refusal_line
from core.admission import SloAdmission, SloGate
from core.admission_signals import RefusalCause
from core.dispatch import Dispatcher
from core.slo import SLOClass
from tests.console.live.fakes import ListLog, record
from tests.helpers import toy_profile


def gate() -> SloGate:
    return Dispatcher(toy_profile()).use_slo_admission(SloAdmission())


def test_repeated_refusals_collapse_into_one_line_per_cause_per_window() -> None:
    g, events = gate(), EventBus()
    lines = RefusalLines(events, lambda: g, window_s=5.0)
    assert lines.tick(0.0) == []
    for _ in range(37):
        g.count_refusal(RefusalCause.PREFILL_BACKLOG, 2.9, 1.6)
    (first,) = lines.tick(10.0)  # the first line goes out at once
    assert first["type"] == "refusals"
    assert (first["cause"], first["count"], first["total"]) == ("prefill_backlog", 37, 37)
    assert first["detail"] == "prefill backlog: 37 refused in the last 5 s, projected 2.9 s against 1.6 s"
    for t in (11.0, 12.0, 13.0, 14.0):  # 10 more within the window: no line until it has passed
        g.count_refusal(RefusalCause.PREFILL_BACKLOG, 3.1, 1.6)
        g.count_refusal(RefusalCause.PREFILL_BACKLOG, 3.2, 1.6)
        assert lines.tick(t) == []
    g.count_refusal(RefusalCause.DECODE_SLOTS, 2.0, 1.6)  # another cause has its own window
    g.count_refusal(RefusalCause.TENANT_LIMIT, 4.0, 0.0)
    by_cause = {e["cause"]: e for e in lines.tick(14.5)}
    assert set(by_cause) == {"decode_slots", "tenant_limit"}
    assert by_cause["tenant_limit"]["detail"] == (
        "tenant limit: 1 refused in the last 5 s, retry after ~4 s (the tenant's own limits)"
    )
    (second,) = lines.tick(15.0)
    assert second["count"] == 8 and second["total"] == 45 and second["window_s"] == 5.0
    assert second["detail"] == "prefill backlog: 8 refused in the last 5 s, projected 3.2 s against 1.6 s"
    assert lines.tick(30.0) == []  # nothing new: no line
    assert [e["type"] for e in events.history] == ["refusals"] * 4
    assert RefusalLines(EventBus(), lambda: None).tick(1.0) == []  # admission off: nothing counted


def test_a_pools_lines_name_the_pool() -> None:
    g, h, events = gate(), gate(), EventBus()
    a, b = RefusalLines(events, lambda: g, pool="A"), RefusalLines(events, lambda: h, pool="B")
    h.count_refusal(RefusalCause.KV, 2.0, 1.5)
    assert a.tick(1.0) == []  # B's refusal is not A's
    (line,) = b.tick(1.0)
    assert (line["pool"], line["cause"], line["count"]) == ("B", "kv", 1)


def test_refusal_line_wording() -> None:
    want = "KV cache full: 3 refused in the last 1 s, projected 2.0 s against 1.5 s"
    assert refusal_line("kv", 3, 0.4, 2.0, 1.5) == want
    assert refusal_line("queue_full", 1, 7.2, None, None) == "queue full: 1 refused in the last 7 s"


def test_metrics_export_refusals_by_pool_and_cause_with_the_projected_wait_and_its_bound() -> None:
    g, h = gate(), gate()
    registry = CollectorRegistry()
    registry.register(RefusalCollector(lambda: [("A", g), ("B", h), ("C", None)]))
    g.count_refusal(RefusalCause.PREFILL_BACKLOG, 2.9, 1.6)
    g.count_refusal(RefusalCause.QUEUE_FULL, 4.0, 3.0)
    h.count_refusal(RefusalCause.KV, 5.0, 2.0)
    text = generate_latest(registry).decode()
    assert 'sibyl_admission_refusals_total{cause="prefill_backlog",pool="A"} 1.0' in text
    assert 'sibyl_admission_refusals_total{cause="decode_slots",pool="A"} 0.0' in text  # every cause, counted or not
    assert 'sibyl_admission_refusal_projected_seconds{cause="prefill_backlog",pool="A"} 2.9' in text
    assert 'sibyl_admission_refusal_bound_seconds{cause="queue_full",pool="A"} 3.0' in text
    assert 'sibyl_admission_refusals_total{cause="kv",pool="B"} 1.0' in text
    assert 'sibyl_admission_refusals_total{cause="kv",pool="A"} 0.0' in text  # B's refusal is not A's
    assert 'sibyl_admission_refusal_projected_seconds{cause="kv",pool="B"} 5.0' in text
    assert 'pool="C"' not in text  # its admission is off
    assert 'sibyl_admission_prefill_on_decode_total{pool="A"} 0.0' in text  # local_prefill off: none
    local = Dispatcher(toy_profile()).use_slo_admission(SloAdmission(local_prefill=True))
    assert local.local is not None
    local.local.routed = 2
    served = CollectorRegistry()
    served.register(RefusalCollector(lambda: [("A", local)]))
    assert 'sibyl_admission_prefill_on_decode_total{pool="A"} 2.0' in generate_latest(served).decode()
    off = CollectorRegistry()
    off.register(RefusalCollector(lambda: [("A", None)]))
    assert "sibyl_admission" not in generate_latest(off).decode()


def test_counted_refusals_are_told_by_their_line_other_failures_by_their_own_event() -> None:
    out = Outcomes(ListLog(), {"default": SLOClass(ttft_s=1.0, tpot_s=0.1)}, t0=90.0)
    out.counted_refusal = counted_by_admission
    cases = [
        ("shed", Outcome.SHED, "the cluster is saturated (prefill_backlog): ...", True),
        ("limited", Outcome.TENANT_LIMIT, "tenant over its limit", True),
        ("late", Outcome.EXPIRED, f"{WAIT_BOUND_EXPIRY}2.1 s while the cluster was saturated: ...", True),
        ("ttl", Outcome.EXPIRED, "queued longer than the queue policy's ttl_s=30 s ...", False),
        ("broken", Outcome.UPSTREAM, "decode d0 stream ended early", False),
    ]
    for rid, outcome, reason, counted in cases:
        live = record(rid)
        live.reason, live.outcome = reason, outcome
        live.enter(Step.FAILED, 101.0)
        assert counted_by_admission(live) is counted
        out.started(live)
        out.left(live)
        out.record(live)
    assert out.failed == 5
    assert [e["request_id"] for e in out.events.history if e["type"] == "failure"] == ["ttl", "broken"]

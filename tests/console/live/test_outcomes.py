"""Outcomes: counts in flight, the SLO window, events on failure and recovery, the stored row, swaps."""

from __future__ import annotations

import pytest

from console.live.outcomes import Outcomes, decisions
from console.live.record import ROW_COLUMNS, Outcome, RequestRecord, Step
from core.slo import SLOClass
from tests.console.live.fakes import ListLog, instances, record


def outcomes() -> tuple[Outcomes, ListLog]:
    log = ListLog()
    return Outcomes(log, {"default": SLOClass(ttft_s=1.0, tpot_s=0.1)}, t0=90.0), log


def test_a_finished_request_is_counted_scored_and_stored() -> None:
    out, log = outcomes()
    live = record("r1", arrival=100.0)
    out.started(live)
    assert (out.in_flight, out.total, out.live, out.idle.is_set()) == (1, 1, {"r1": live}, False)
    live.enter(Step.PREFILL, 100.1)
    live.enter(Step.DECODE_BOUND, 100.2)
    live.enter(Step.DECODING, 100.2)
    live.first_token_at, live.output_tokens, live.outcome = 100.5, 5, Outcome.OK
    live.prefill_instance, live.decode_instance = "p0", "d0"
    live.enter(Step.FINISHED, 100.8)
    out.left(live)
    out.record(live)
    assert (out.in_flight, out.failed, out.live, out.idle.is_set()) == (0, 0, {}, True)
    row = log.requests[0]
    assert row.arrival == 10.0 and abs(row.ttft - 0.5) < 1e-9 and abs(row.tpot - 0.075) < 1e-9
    assert abs(row.prefill_start - 10.1) < 1e-9 and (row.queued, row.status, row.slo_met) == (
        None,
        "ok",
        True,
    )
    assert abs(row.finish - 10.8) < 1e-9 and abs(row.e2e - 0.8) < 1e-9
    stored = row.stored()  # what the run store takes: its 25 columns, in order
    assert list(stored) == list(ROW_COLUMNS) and len(stored) == 30 and stored["request_id"] == "r1"
    assert out.slo.snapshot(101.0)["run"]["requests"] == 1
    assert list(out.metrics.ttft.collect())[0].samples  # observed


def test_a_failure_is_published_and_counted_a_recovery_is_published() -> None:
    out, log = outcomes()
    seen = out.events.history
    failed = record("bad")
    out.started(failed)
    failed.reason, failed.outcome = "decode d0 stream ended early", Outcome.UPSTREAM
    failed.enter(Step.FAILED, 101.0)
    out.left(failed)
    out.record(failed)
    saved = record("saved")
    out.started(saved)
    saved.outcome, saved.first_token_at, saved.output_tokens, saved.recovered = Outcome.OK, 100.2, 3, "resumed on d1"
    saved.enter(Step.FINISHED, 101.0)
    out.left(saved)
    out.record(saved)
    assert out.failed == 1 and [e["type"] for e in seen] == ["failure", "recovered"]
    assert log.requests[0].status == "failed" and log.requests[0].ttft is None and log.requests[0].slo_met is False


def test_instance_and_policy_events_reach_the_log_and_the_bus() -> None:
    out, log = outcomes()
    inst = instances(0, 1)[0]
    out.instance_event("d0", inst.role, "down", "connection refused", "probe")
    out.policy_swapped(3.0, "routing", "sibyl", "least_load", {"by": "tokens"}, "cli", pool="A")
    out.sample(inst, 95.0)
    inst.health_rtt_s.extend([0.003, 0.001, 0.002])
    out.sample(inst, 96.0)
    assert log.instance_events[0]["detail"] == "connection refused [probe]"
    assert log.policy_events == [
        {"t": 3.0, "kind": "routing", "old": "sibyl", "new": "least_load", "params": {"by": "tokens"}, "source": "cli",
         "pool": "A"}
    ]  # stored with the pool whose policy it was
    assert log.samples[0]["t"] == 5.0 and log.samples[0]["instance_id"] == "d0"
    # the median /health round trip so far (none before the first probe): `calibrate` reads it while the run lasts
    assert [s["health_rtt_s"] for s in log.samples] == [None, 0.002]
    assert [(e["type"], e.get("event"), e.get("new")) for e in out.events.history] == [
        ("instance", "down", None),
        ("policy", None, "least_load"),
    ]
    summary = out.summary(101.0, [inst])
    assert summary["requests_total"] == 0 and summary["health_rtt_s"] == {"d0": 0.002}  # the same median at stop


def finished(live: RequestRecord, *, first: float | None, tokens: int = 5) -> RequestRecord:
    """`live` through prefill (100.1-100.3) and decode to 101.0, as the gateway stamps it."""
    live.enter(Step.PREFILL, 100.1)
    live.enter(Step.DECODE_BOUND, 100.3)
    live.enter(Step.DECODING, 100.3)
    live.first_token_at, live.output_tokens, live.outcome = first, tokens, Outcome.OK
    live.prefill_instance, live.decode_instance = "p0", "d0"
    live.enter(Step.FINISHED, 101.0)
    return live


def samples(out: Outcomes, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for m in out.metrics.registry.collect()
        for s in m.samples
        if s.name == name
    }


def test_a_whole_reply_has_no_tpot_and_its_ttft_ends_at_its_prefill_leg() -> None:
    """A non-streamed reply: no token time is seen (request.py leaves first_token_at unset), so TPOT is
    unknown and TTFT is the prefill leg's end; it is judged on TTFT alone and says so in its row."""
    out, log = outcomes()
    whole = finished(record("w", stream=False), first=None)
    out.started(whole)
    out.left(whole)
    out.record(whole)
    row = log.requests[0]
    assert row.tpot is None and row.first_token is None and row.ttft_source == "prefill_end"
    assert abs(row.ttft - 0.3) < 1e-9 and abs(row.e2e - 1.0) < 1e-9 and row.slo_met is True
    snap = out.slo.snapshot(101.5)["window"]
    assert snap["tpot_unknown"] == 1 and snap["tpot_attainment"] is None and snap["ttft_attainment"] == 1.0
    assert samples(out, "sibyl_tpot_seconds_count") == {(("slo_class", "default"),): 0.0}
    assert samples(out, "sibyl_ttft_seconds_count") == {(("slo_class", "default"),): 1.0}
    assert samples(out, "sibyl_whole_replies_total") == {(("slo_class", "default"),): 1.0}
    assert samples(out, "sibyl_pd_handoff_seconds_count") == {(("slo_class", "default"),): 0.0}


def test_a_whole_reply_served_by_its_decode_instance_alone_has_no_ttft() -> None:
    """No prefill leg (the decode instance computed the prompt): nothing marks its first token, so its
    TTFT is unknown, not the moment its decode leg was sent."""
    out, log = outcomes()
    whole = record("w", stream=False)
    whole.enter(Step.DECODE_BOUND, 100.05)
    whole.enter(Step.DECODING, 100.05)
    whole.output_tokens, whole.outcome = 5, Outcome.OK
    whole.prefill_instance, whole.decode_instance = None, "d0"
    whole.enter(Step.FINISHED, 101.0)
    out.started(whole)
    out.left(whole)
    out.record(whole)
    row = log.requests[0]
    assert row.ttft is None and row.ttft_source is None and row.prefill_instance is None and row.slo_met is True
    assert samples(out, "sibyl_ttft_seconds_count") == {(("slo_class", "default"),): 0.0}


def test_a_streamed_reply_observes_every_latency_of_its_class() -> None:
    out, log = outcomes()
    live = finished(record("s"), first=100.5)
    out.started(live)
    out.left(live)
    out.record(live)
    row = log.requests[0]
    assert row.ttft_source == "first_token" and abs(row.ttft - 0.5) < 1e-9 and abs(row.tpot - 0.125) < 1e-9
    assert row.slo_met is False  # 125 ms per token against a 100 ms target
    assert samples(out, "sibyl_pd_handoff_seconds_sum") == {(("slo_class", "default"),): pytest.approx(0.2)}
    assert samples(out, "sibyl_queue_wait_seconds_sum") == {(("slo_class", "default"),): pytest.approx(0.1)}
    assert samples(out, "sibyl_e2e_seconds_sum") == {(("slo_class", "default"),): pytest.approx(1.0)}
    assert samples(out, "sibyl_slo_requests_total") == {
        (("result", r), ("slo_class", "default")): float(r == "missed") for r in ("met", "missed", "failed")
    }


def ended(rid: str, outcome: Outcome, *, queued: bool = False, reason: str = "") -> RequestRecord:
    """A request's record as it left, with `outcome` (held by the queue policy first when `queued`)."""
    rec = record(rid)
    if queued:
        rec.enter(Step.QUEUED, 100.0)
    rec.outcome, rec.reason = outcome, reason or None
    return rec


def test_decisions_are_read_from_the_request_record() -> None:
    assert decisions(ended("abandoned", Outcome.ABANDONED, queued=True)) == [("queue", "held"), ("queue", "abandoned")]
    assert decisions(ended("expired", Outcome.EXPIRED, queued=True)) == [("queue", "held"), ("queue", "expired")]
    released = ended("released", Outcome.OK, queued=True)
    released.prefill_instance, released.decode_instance = "p0", "d0"
    assert decisions(released) == [("queue", "held"), ("routing", "routed")]
    assert decisions(ended("shed", Outcome.SHED)) == [("queue", "shed")]
    assert decisions(ended("limited", Outcome.TENANT_LIMIT)) == []  # its tenant's own counters have it
    assert decisions(ended("none", Outcome.NO_CAPACITY)) == [("routing", "no_capacity")]
    # a decode-only assignment that failed on its decode leg was shed by the queue policy only by its reason's guess
    assert decisions(ended("decode-only", Outcome.UPSTREAM, reason="decode d0 stream ended early")) == []
    assert decisions(ended("bug", Outcome.INTERNAL, reason="internal error: KeyError")) == []
    retried = ended("retried", Outcome.OK)
    retried.prefill_instance, retried.tried_prefill, retried.decode_instance, retried.tried_decode = (
        "p1",
        ["p0"],
        "d1",
        ["d0"],
    )
    assert decisions(retried) == [("routing", "routed"), ("routing", "prefill_retried"), ("routing", "failed_over")]
    # two pools, each with its own routing policy: a request's decisions count under its own pool's
    out, _ = outcomes()
    out.pool_of = lambda live: {"model-a": "A", "model-b": "B"}[live.model]
    out.policy_active("routing", "least_load", {}, pool="A")
    out.policy_active("routing", "sibyl", {}, pool="B")
    failed = finished(record("f"), first=100.5)
    failed.outcome, failed.tried_prefill, failed.model = Outcome.UPSTREAM, ["p9"], "model-a"
    out.record(failed)
    routed = finished(record("g"), first=100.5)
    routed.model = "model-b"
    out.record(routed)
    counts = samples(out, "sibyl_decisions_total")
    assert counts == {
        (("kind", "routing"), ("outcome", "routed"), ("policy", "least_load"), ("pool", "A")): 1.0,
        (("kind", "routing"), ("outcome", "prefill_retried"), ("policy", "least_load"), ("pool", "A")): 1.0,
        (("kind", "routing"), ("outcome", "routed"), ("policy", "sibyl"), ("pool", "B")): 1.0,
    }
    assert samples(out, "sibyl_slo_requests_total")[(("result", "failed"), ("slo_class", "default"))] == 1.0


def test_policy_swaps_move_the_annotation_series_of_their_pool() -> None:
    out, _ = outcomes()
    a, b = (("kind", "routing"), ("pool", "A")), (("kind", "routing"), ("pool", "B"))
    out.policy_active("routing", "sibyl", {}, pool="A")
    out.policy_active("routing", "sibyl", {}, pool="B")
    assert samples(out, "sibyl_policy_last_swap_timestamp_seconds") == {a: 0.0, b: 0.0}
    assert samples(out, "sibyl_policy_swaps_total") == {a: 0.0, b: 0.0}
    out.policy_swapped(3.0, "routing", "sibyl", "least_load", {}, "cli", pool="B")
    swapped_at = samples(out, "sibyl_policy_last_swap_timestamp_seconds")
    assert swapped_at[a] == 0.0 and swapped_at[b] > 1e9
    assert samples(out, "sibyl_policy_swaps_total") == {a: 0.0, b: 1.0}
    assert samples(out, "sibyl_policy_info") == {
        (("kind", "routing"), ("name", "sibyl"), ("params", "{}"), ("pool", "A")): 1.0,
        (("kind", "routing"), ("name", "least_load"), ("params", "{}"), ("pool", "B")): 1.0,
    }
    assert out.events.history[-1]["pool"] == "B"

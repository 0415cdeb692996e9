"""Outcomes: counts in flight, the SLO window, events on failure and recovery, the stored row, swaps."""

from __future__ import annotations

from console.live.outcomes import Outcomes
from console.live.request import Step
from core.slo import SLOClass
from tests.console.live.fakes import ListLog, instances, live_request


def outcomes() -> tuple[Outcomes, ListLog]:
    log = ListLog()
    return Outcomes(log, {"default": SLOClass(ttft_s=1.0, tpot_s=0.1)}, t0=90.0), log


def test_a_finished_request_is_counted_scored_and_stored() -> None:
    out, log = outcomes()
    live = live_request("r1", arrival=100.0)
    out.started(live)
    assert (out.in_flight, out.total, out.live, out.idle.is_set()) == (1, 1, {"r1": live}, False)
    live.enter(Step.PREFILL, 100.1)
    live.enter(Step.DECODE_BOUND, 100.2)
    live.enter(Step.DECODING, 100.2)
    live.first_token_at, live.output_tokens, live.ok = 100.5, 5, True
    live.prefill_instance, live.decode_instance = "p0", "d0"
    live.enter(Step.FINISHED, 100.8)
    out.left(live)
    out.record(live)
    assert (out.in_flight, out.failed, out.live, out.idle.is_set()) == (0, 0, {}, True)
    row = log.requests[0]
    assert row["arrival"] == 10.0 and abs(row["ttft"] - 0.5) < 1e-9 and abs(row["tpot"] - 0.075) < 1e-9
    assert abs(row["prefill_start"] - 10.1) < 1e-9 and (row["queued"], row["status"], row["slo_met"]) == (None, "ok", True)
    assert abs(row["finish"] - 10.8) < 1e-9 and abs(row["e2e"] - 0.8) < 1e-9
    assert out.slo.snapshot(101.0)["run"]["requests"] == 1
    assert list(out.metrics.ttft.collect())[0].samples  # observed


def test_a_failure_is_published_and_counted_a_recovery_is_published() -> None:
    out, log = outcomes()
    seen = out.events.history
    failed = live_request("bad")
    out.started(failed)
    failed.reason = "decode d0 stream ended early"
    failed.enter(Step.FAILED, 101.0)
    out.left(failed)
    out.record(failed)
    saved = live_request("saved")
    out.started(saved)
    saved.ok, saved.first_token_at, saved.output_tokens, saved.recovered = True, 100.2, 3, "resumed on d1"
    saved.enter(Step.FINISHED, 101.0)
    out.left(saved)
    out.record(saved)
    assert out.failed == 1 and [e["type"] for e in seen] == ["failure", "recovered"]
    assert log.requests[0]["status"] == "failed" and log.requests[0]["ttft"] is None and log.requests[0]["slo_met"] is False


def test_instance_and_policy_events_reach_the_log_and_the_bus() -> None:
    out, log = outcomes()
    inst = instances(0, 1)[0]
    out.instance_event("d0", inst.role, "down", "connection refused", "probe")
    out.policy_swapped(3.0, "routing", "sibyl", "least_load", {"by": "tokens"}, "cli")
    out.sample(inst, 95.0)
    assert log.instance_events[0]["detail"] == "connection refused [probe]"
    assert log.policy_events == [{"t": 3.0, "kind": "routing", "old": "sibyl", "new": "least_load", "params": {"by": "tokens"}, "source": "cli"}]
    assert log.samples[0]["t"] == 5.0 and log.samples[0]["instance_id"] == "d0"
    assert [(e["type"], e.get("event"), e.get("new")) for e in out.events.history] == [("instance", "down", None), ("policy", None, "least_load")]
    summary = out.summary(101.0, [inst])
    assert summary["requests_total"] == 0 and summary["health_rtt_s"] == {}

"""Advisor events read back as `runs show` presents them: advice as spans, each canary's life."""

from __future__ import annotations

from typing import Any

from console.offline.advisor_log import KEEP, advice_timeline, canary_lives


def event(t: float, name: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": name, "canary": None, "kind": "routing", "policy": None, "decision": None,
            "detail": "", "data": {}, **fields}


def test_consecutive_equal_advice_makes_one_span() -> None:
    events = [
        event(30, "advice", detail="no gain past the error"),
        event(60, "advice"),
        event(90, "advice", policy="prefix_aware", detail="ttft_p99 -31%", decision="suggest"),
        event(100, "canary_start", canary="c1", policy="prefix_aware"),
        event(120, "advice", policy="prefix_aware", detail="ttft_p99 -28%", decision="canary"),
        event(150, "advice"),
    ]
    spans = advice_timeline(events)
    assert [(s["from_t"], s["to_t"], s["advised"], s["readings"]) for s in spans] == [
        (30, 60, KEEP, 2),
        (90, 120, "prefix_aware", 2),
        (150, 150, KEEP, 1),
    ]
    assert (spans[1]["detail"], spans[1]["decision"]) == ("ttft_p99 -28%", "canary")  # the span's last advice


def test_every_canary_has_its_start_readings_and_end() -> None:
    events = [
        event(10, "canary_start", canary="c1", policy="sibyl", data={"share": 0.1}),
        event(20, "canary_reading", canary="c1", decision="continue"),
        event(25, "canary_start", canary="c2", kind="rank", policy="jsq"),
        event(30, "canary_reading", canary="c1", decision="continue"),
        event(40, "canary_end", canary="c1", decision="rollback", detail="worse"),
        event(45, "advice", policy="sibyl"),
    ]
    c1, c2 = canary_lives(events)
    assert (c1["canary"], c1["policy"], c1["verdict"]) == ("c1", "sibyl", "rollback")
    assert c1["start"]["data"] == {"share": 0.1}
    assert [r["t"] for r in c1["readings"]] == [20, 30] and c1["end"]["detail"] == "worse"
    assert (c2["kind"], c2["readings"], c2["end"], c2["verdict"]) == ("rank", [], None, None)  # still running

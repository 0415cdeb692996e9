"""Circuit breakers: an instance whose requests keep failing leaves routing, and comes back."""

from __future__ import annotations

from pathlib import Path

import httpx

from adapters.store import RunStore
from core.breaker import BreakerState, CircuitBreaker
from tests.procs import FIXED_PROFILE, kill_children, start_console, wait_for


def test_the_breaker_opens_after_consecutive_failures_half_opens_and_closes() -> None:
    b = CircuitBreaker(failures=3, cooloff_s=10.0)
    assert b.failure(0.0) is None and b.failure(1.0) is None
    assert b.success() is None and b.consecutive == 0  # a success in between resets the count
    assert [b.failure(t) for t in (2.0, 3.0, 4.0)] == [None, None, BreakerState.OPEN]
    assert not b.allows and b.tick(13.9) is None
    assert b.tick(14.0) == BreakerState.HALF_OPEN and b.allows
    assert b.failure(15.0) == BreakerState.OPEN and b.opened_at == 15.0  # the probe failed: open again
    assert b.tick(25.0) == BreakerState.HALF_OPEN
    assert b.success() == BreakerState.CLOSED and b.allows


def test_an_instance_that_fails_every_request_is_routed_around_then_used_again(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'prefill = 1\ndecode = 2\nprofile = "{FIXED_PROFILE}"\npolicy = "round_robin"\n'
        "breaker_failures = 3\nbreaker_cooloff_s = 1.0\n"
    )
    con = start_console(tmp_path, str(cfg))
    try:
        urls = {i["id"]: i["url"] for i in con.state()["instances"]}
        httpx.put(
            urls["d0"] + "/admin/faults", json={"fail_rate": 1.0, "fail_status": 500}, timeout=5
        )  # /health stays 200

        def send() -> int:
            return httpx.post(
                con.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30
            ).status_code

        statuses = [send() for _ in range(6)]  # round robin: every other one lands on d0 until it opens
        # each request d0 gets fails there twice (its KV leg, then once more without the KV, in case
        # the KV was the trouble), so its breaker's 3 failures in a row come within two requests
        assert statuses.count(502) == 2 and statuses[0] == 502
        state = {i["id"]: i for i in con.state()["instances"]}
        assert state["d0"]["breaker"] == "open" and state["d0"]["healthy"]  # probes pass; requests do not
        assert [send() for _ in range(4)] == [200] * 4  # routed around it
        httpx.put(urls["d0"] + "/admin/faults", json={"fail_rate": 0.0}, timeout=5)
        wait_for(
            lambda: {i["id"]: i for i in con.state()["instances"]}["d0"]["breaker"] == "half_open", 10, "the cool-off"
        )
        assert [send() for _ in range(4)] == [200] * 4
        assert {i["id"]: i for i in con.state()["instances"]}["d0"]["breaker"] == "closed"
        con.stop()
        events = [e["event"] for e in RunStore(con.db).instance_events(con.run_id) if e["instance_id"] == "d0"]
        assert events == ["circuit_open", "circuit_half_open", "circuit_closed"]
        rows = RunStore(con.db).requests(con.run_id)
        assert sum(r["decode_instance"] == "d0" and r["status"] == "ok" for r in rows) >= 1  # used again
    finally:
        con.stop()
        kill_children(con.home)

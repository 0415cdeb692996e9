"""SLO-driven scaling end to end: `threshold` adds a decode instance when the TPOT SLO is missed over
its window, though utilisation, KV and the queue are all low, and drains it away once the load is
gone — with no failed request.

The decode instance is slowed down ×16 (the emulator's slowdown fault: a slow or shared GPU), so
a dozen streams on it decode at well over 100 ms a token against the 100 ms TPOT target, while it holds a
tenth of its slots: only the SLO signal can see it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from adapters.store import RunStore
from tests.procs import FIXED_PROFILE, instance_steps_live, kill_children, start_console, wait_for

THRESHOLD = {
    "role": "decode",
    "period_s": 0.5,
    "cooldown_s": 2.0,
    "scale_in_after_s": 3.0,
    "max_instances": 2,
    "slo_min_samples": 4,
}
"""Default thresholds (utilisation 0.9/0.3, KV 0.8/0.3, queue 5, SLO attainment 90%), quicker cadence."""
RATE, SECONDS, OUTPUT = 4.0, 8.0, 40


@pytest.mark.slow  # waits for the SLO window to clear before the scale-in: ~50 s (make test-slow)
def test_a_missed_tpot_slo_adds_a_decode_instance_which_drains_away_after(tmp_path: Path) -> None:
    params = ", ".join(f"{k} = {json.dumps(v)}" for k, v in THRESHOLD.items())
    cfg = tmp_path / "console.toml"
    cfg.write_text(
        f'prefill = 1\ndecode = 1\nprofile = "{FIXED_PROFILE}"\npolicy = "least_load"\n'
        f'[scaling]\nname = "threshold"\nparams = {{ {params} }}\n'
    )
    con = start_console(tmp_path, str(cfg))
    try:
        d0 = next(i for i in con.state()["instances"] if i["id"] == "d0")
        httpx.put(d0["url"] + "/admin/faults", json={"slowdown": 16.0}).raise_for_status()
        client = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0, timeout=120)
        errors: list[str] = []

        def one(k: int) -> None:
            try:
                s = client.completions.create(
                    model="sibyl-model", prompt=[9, k], max_tokens=OUTPUT, stream=True, extra_body={"ignore_eos": True}
                )
                n = sum(1 for ch in s if ch.choices and ch.choices[0].text)
                if n != OUTPUT:
                    errors.append(f"request {k}: {n} tokens")
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                errors.append(f"request {k}: {type(e).__name__}: {e}")

        threads = []
        t0 = time.monotonic()
        for k in range(int(RATE * SECONDS)):
            time.sleep(max(0.0, t0 + k / RATE - time.monotonic()))
            threads.append(threading.Thread(target=one, args=(k,)))
            threads[-1].start()
        wait_for(
            lambda: any(i["id"] == "d1" and i["phase"] == "active" for i in con.state()["instances"]),
            40,
            "the policy to add d1",
        )
        for th in threads:
            th.join(120)
        assert errors == []
        wait_for(lambda: any(ev == "removed" for ev, _ in instance_steps_live(con, "d1")), 90, "d1 to be drained away")
        con.stop()
        events = [
            (e["event"], e["detail"]) for e in RunStore(con.db).instance_events(con.run_id) if e["instance_id"] == "d1"
        ]
        assert [ev for ev, _ in events] == ["starting", "added", "draining", "removed"], events
        assert "TPOT attainment" in events[0][1] and "utilisation" in events[0][1], events[0][
            1
        ]  # the reason quotes the SLO and the numbers
        rows = RunStore(con.db).requests(con.run_id)
        assert len(rows) == RATE * SECONDS and all(r["status"] == "ok" for r in rows)
    finally:
        con.stop()
        kill_children(con.home)

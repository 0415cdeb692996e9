"""A policy canary on a named pool end to end: an emulated console with two [[pools]] (A and B) under traffic to both;
`policy canary ... --pool B` splits B's requests into arms (the run store records arms on B's requests and none on
A's), a second canary or an unknown pool is refused, the canary ends with a verdict whose events and series name pool
B, and the advisor on `[advisor] pool = "B"` says so in `/control/advice` and in `advise`'s first line."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.store import RunStore
from tests.procs import FAST_PROFILE, kill_children, start_console, wait_for


def traffic(url: str, stop: threading.Event) -> None:
    """Completions to A and B in turn, each in its own session (so the split spreads them), until `stop`."""
    with httpx.Client(base_url=url, timeout=30) as http:
        k = 0
        while not stop.is_set():
            for model in ("A", "B"):
                body = {"model": model, "prompt": [1, 2, 3, 4, k], "max_tokens": 3, "ignore_eos": True}
                headers = {"X-Request-Id": f"{model}-{k}", "X-Session-Id": f"{model}-s{k}"}
                with contextlib.suppress(httpx.HTTPError):
                    http.post("/v1/completions", json=body, headers=headers)
            k += 1


def running_series(metrics: str) -> dict[tuple[str, str], float]:
    """sibyl_canary_running by (pool, candidate)."""
    return {
        (s.labels["pool"], s.labels["candidate"]): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "sibyl_canary_running"
    }


@pytest.mark.slow  # ~10-20 s: four emulated instances, a 4 s canary and its verdict
def test_a_canary_on_pool_b_splits_bs_requests_only_and_its_verdict_names_b(tmp_path: Path) -> None:
    pool = f'prefill = 1\ndecode = 1\nprofile = "{FAST_PROFILE}"\n'
    config = tmp_path / "pools.toml"
    config.write_text(
        'policy = "round_robin"\n[advisor]\nenabled = true\npool = "B"\nperiod_s = 30.0\nwindow_s = 30.0\n\n'
        f'[[pools]]\nmodel = "A"\n{pool}\n[[pools]]\nmodel = "B"\n{pool}'
    )
    con = start_console(tmp_path, str(config))
    stop = threading.Event()
    load = threading.Thread(target=traffic, args=(con.url, stop), daemon=True)
    try:
        load.start()
        args = ("routing", "least_load", "--pool", "B", "--share", "50%", "--for", "4s", "--json")
        started = con.cli("policy", "canary", *args)
        assert started.returncode == 0, started.stderr
        canary = json.loads(started.stdout)
        assert canary["pool"] == "B" and canary["plan"]["share"] == 0.5
        busy = con.cli("policy", "canary", "routing", "least_load", "--pool", "A", "--for", "4s")
        assert busy.returncode == 2 and "409" in busy.stderr
        assert f"canary {canary['id']} (routing least_load on pool B) is running" in busy.stderr
        unknown = con.cli("policy", "canary", "routing", "least_load", "--pool", "C")
        assert unknown.returncode == 2 and "422: no pool 'C'; pools: A, B" in unknown.stderr
        shown = con.cli("policy", "canary")
        assert f"running: {canary['id']} routing least_load  on 50% of pool B" in shown.stdout
        assert running_series(httpx.get(con.url + "/metrics").text) == {("B", "least_load"): 1.0}

        with con.control() as ctl:

            def ended() -> bool:
                last = ctl.get("/control/canary").json()["last"]
                return last is not None and last["id"] == canary["id"]

            wait_for(ended, 20, "the canary's verdict")
            last = ctl.get("/control/canary").json()["last"]
            advice = ctl.get("/control/advice").json()
        assert last["pool"] == "B" and last["decision"] in ("promote", "rollback", "equal", "inconclusive"), last
        assert last["finished"]["canary"] > 0 and last["finished"]["control"] > 0
        assert running_series(httpx.get(con.url + "/metrics").text) == {("B", "least_load"): 0.0}
        assert advice["enabled"] and advice["pool"] == "B"
        advise = con.cli("advise")
        assert advise.returncode == 0 and advise.stdout.splitlines()[0].startswith("advisor on pool B: every 30 s")
        stop.set()
        load.join(30)
        assert con.stop() == 0
    finally:
        stop.set()
        con.stop()
        kill_children(con.home)
    store = RunStore(con.db)
    rows = store.requests(con.run_id)
    arms_a = {r["arm"] for r in rows if r["model"] == "A"}
    arms_b = [r["arm"] for r in rows if r["model"] == "B"]
    assert arms_a == {None} and len([r for r in rows if r["model"] == "A"]) > 10  # A's requests: never split
    assert arms_b.count("canary") > 0 and arms_b.count("control") > 0
    events = [e for e in store.advisor_events(con.run_id) if e["event"] in ("canary_start", "canary_end")]
    assert [(e["event"], e["canary"], e["data"]["pool"]) for e in events] == [
        ("canary_start", canary["id"], "B"),
        ("canary_end", canary["id"], "B"),
    ]
    assert "of pool B's requests" in events[0]["detail"] and events[1]["decision"] == last["decision"]
    if last["decision"] == "promote":  # the swap is B's
        swaps = [(e["pool"], e["new"]) for e in store.policy_events(con.run_id) if e["source"] == "canary"]
        assert swaps == [("B", "least_load")]

"""Decision records end to end: a real console (1P3D emulated, sibyl) serves requests; their decisions,
every candidate included, are read back through the control API and, after the stop, `runs why`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from typer.testing import CliRunner

from console.cli import _register_commands, app
from tests.procs import FIXED_PROFILE, kill_children, start_console, wait_for

_register_commands()
runner = CliRunner()


def test_a_requests_decisions_through_the_inspector_api_and_runs_why(tmp_path: Path) -> None:
    con = start_console(tmp_path, "--profile", FIXED_PROFILE, "--prefill", "1", "--decode", "3", "--policy", "sibyl")
    try:
        body = {"model": "sibyl-model", "prompt": "why", "max_tokens": 4, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=con.url, timeout=30) as http:
            for k in range(4):
                r = http.post("/v1/completions", json=body, headers={"X-Request-Id": f"why-{k}"})
                assert r.status_code == 200 and "[DONE]" in r.text
        with con.control() as ctl:
            answer = ctl.get("/control/requests/why-3/decisions").json()
            kinds = {(d["kind"], d["stage"]) for d in answer["decisions"]}
            assert {("route", "prefill"), ("route", "decode"), ("handoff", "decode")} <= kinds
            route = next(d for d in answer["decisions"] if (d["kind"], d["stage"]) == ("route", "decode"))
            assert [c["name"] for c in route["candidates"]] == ["d0", "d1", "d2"]
            assert route["policy"] == "sibyl" and route["score_name"] == "projected_load_at_tau"
            assert all(c["score"] is not None and "running" in c["features"] for c in route["candidates"])
            decode = route["chosen"]
            listed = ctl.get(f"/control/instances/{decode}/requests").json()["requests"]
            assert "why-3" in [r["request_id"] for r in listed] and all(r["decisions"] for r in listed)
            assert ctl.get("/control/instances/nope/requests").status_code == 404
            assert "not sampled" in ctl.get("/control/requests/unknown/decisions").json()["note"]
            assert httpx.get(con.url + "/control/requests/why-3/decisions").status_code == 401
            metrics = httpx.get(con.url + "/metrics").text
            # one pool, named after its served model: the label every per-pool series carries
            assert 'sibyl_decode_choices_scored_total{pool="sibyl-model",router="active"} 4.0' in metrics
            assert "sibyl_decision_records_total" in metrics
        assert con.stop() == 0
        out = runner.invoke(app, ["runs", "why", con.run_id, "why-3", "--json", "--db", str(con.db)])
        assert out.exit_code == 0, out.output
        stored = json.loads(out.stdout)
        assert stored["request"]["decode_instance"] == decode
        again = next(d for d in stored["decisions"] if (d["kind"], d["stage"]) == ("route", "decode"))
        assert again["candidates"] == route["candidates"] and again["margin"] == route["margin"]
        shown = runner.invoke(app, ["runs", "show", con.run_id, "--db", str(con.db)], terminal_width=200)
        assert "decision quality:" in shown.stdout and "decision records:" in shown.stdout
    finally:
        con.stop()
        kill_children(con.home)
    wait_for(lambda: con.proc.poll() is not None, 5, "the console to stop")

"""The advisor and a policy canary end to end: an emulated 2P2D console replays a short trace; /control/advice
answers with ranked candidates after a couple of periods; a canary started with the CLI routes a share of the
requests under the candidate, the run store records each request's arm, and the canary ends with a verdict event."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from adapters.store import RunStore
from console.cli import _register_commands, app
from tests.procs import FIXED_PROFILE, ROOT, kill_children, start_console, wait_for

_register_commands()
runner = CliRunner()


def short_trace(path: Path, n: int = 80, gap_ms: int = 250) -> Path:
    """`n` arrivals 250 ms apart: four conversations whose turns share a one- or two-block prefix and add a block
    of their own (512-token hash blocks as Mooncake records them, replayed as 128-token blocks)."""
    with path.open("w") as f:
        for k in range(n):
            conversation, turn = k % 4, k // 4
            shared = [1000 * conversation + b for b in range(1 + turn % 2)]
            row = {"timestamp": k * gap_ms, "input_length": 512 * (len(shared) + 1), "output_length": 8,
                   "hash_ids": [*shared, 100_000 + k]}
            f.write(json.dumps(row) + "\n")
    return path


def canary_series(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The sibyl_canary_* samples of a /metrics scrape: name → [(labels without pool, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("sibyl_canary_"):
                labels = {k: v for k, v in s.labels.items() if k != "pool"}
                out.setdefault(s.name, []).append((labels, s.value))
    return out


@pytest.mark.slow  # ~5-15 s: the default suite stays under 6 min on 2 cores; make test-slow runs it
def test_advice_then_a_canary_from_the_cli_with_arms_and_a_verdict(tmp_path: Path) -> None:
    config = tmp_path / "console.toml"
    config.write_text(
        'policy = "round_robin"\n[advisor]\nenabled = true\nperiod_s = 2.0\nwindow_s = 20.0\n'
        'candidates = ["routing:least_load", "routing:prefix_aware"]\n'
    )
    trace = short_trace(tmp_path / "trace.jsonl")
    con = start_console(
        tmp_path, str(config), "--profile", FIXED_PROFILE, "--prefill", "2", "--decode", "2", "--replay", str(trace),
        "--loop", "--replay-hash-block-tokens", "128",
    )
    try:
        with con.control() as ctl:

            def advised() -> bool:
                answer = ctl.get("/control/advice").json()
                return answer["advice"] is not None

            wait_for(advised, 25, "the first advice")
            answer = ctl.get("/control/advice").json()
            labels = [r["label"] for r in answer["advice"]["ranked"]]
            assert sorted(labels) == ["active", "routing:least_load", "routing:prefix_aware"]
            assert answer["pid"] and answer["apply"] == "suggest" and answer["advice"]["window"]["requests"] > 0
            assert answer["advice"]["window"]["with_prefix_keys"]
            assert "in_flight_at_end" in answer["advice"]["window"]  # the gateway's requests, replayed unmeasured
            metrics = httpx.get(con.url + "/metrics").text
            assert 'sibyl_advisor_predicted_ttft_p99_seconds{candidate="active"}' in metrics
            assert "sibyl_advisor_cpu_share" in metrics
            assert httpx.get(con.url + "/control/advice").status_code == 401

            cli = ["--url", con.url, "--token", con.token]
            bad = runner.invoke(app, ["policy", "canary", "routing", "least_load", "--share", "60%", *cli])
            assert bad.exit_code != 0 and "at most 50%" in str(bad.exception)
            bad = runner.invoke(app, ["policy", "canary", "queue", "priority", *cli])
            assert "a queue policy cannot be canaried" in str(bad.exception)
            one_line = subprocess.run(
                [sys.executable, "-m", "console.cli", "policy", "canary", "routing", "nope", *cli],
                cwd=ROOT, capture_output=True, text=True, timeout=60,
            )
            assert one_line.returncode == 2 and len(one_line.stderr.strip().splitlines()) == 1
            assert "unknown routing policy 'nope'" in one_line.stderr

            out = runner.invoke(
                app, ["policy", "canary", "routing", "least_load", "--share", "40%", "--for", "6s", "--json", *cli]
            )
            assert out.exit_code == 0, out.output
            canary_id = json.loads(out.stdout)["id"]
            running = canary_series(httpx.get(con.url + "/metrics").text)
            assert running["sibyl_canary_running"] == [({"kind": "routing", "candidate": "least_load"}, 1.0)]
            assert running["sibyl_canary_share"][0][1] == 0.4
            assert {labels["arm"] for labels, _ in running["sibyl_canary_arm_requests"]} == {"canary", "control"}

            def ended() -> bool:
                last = ctl.get("/control/canary").json()["last"]
                return last is not None and last["id"] == canary_id

            wait_for(ended, 15, "the canary's verdict")
            last = ctl.get("/control/canary").json()["last"]
            assert last["decision"] in ("promote", "rollback", "equal", "inconclusive"), last
            assert last["finished"]["canary"] > 0 and last["finished"]["control"] > 0
            ended = canary_series(httpx.get(con.url + "/metrics").text)
            assert ended["sibyl_canary_running"] == [({"kind": "routing", "candidate": "least_load"}, 0.0)]
            verdicts = {labels["outcome"]: v for labels, v in ended["sibyl_canary_verdicts_total"]}
            assert verdicts[last["decision"]] == 1.0 and sum(verdicts.values()) == 1.0
            assert "sibyl_canary_arm_requests" not in ended
            shown = runner.invoke(app, ["policy", "canary", *cli])
            assert f"last: {canary_id} routing least_load" in shown.stdout
            advise = runner.invoke(app, ["advise", *cli], env={"COLUMNS": "160"})
            assert advise.exit_code == 0 and "routing:least_load" in advise.stdout
        assert con.stop() == 0
        store = RunStore(con.db)
        arms = [r["arm"] for r in store.requests(con.run_id)]
        assert arms.count("canary") > 0 and arms.count("control") > 0 and arms.count(None) > 0
        events = store.advisor_events(con.run_id)
        kinds = [e["event"] for e in events]
        assert "advice" in kinds and kinds.count("canary_start") == 1 and kinds.count("canary_end") == 1
        end = next(e for e in events if e["event"] == "canary_end")
        assert end["canary"] == canary_id and end["decision"] == last["decision"]
    finally:
        con.stop()
        kill_children(con.home)

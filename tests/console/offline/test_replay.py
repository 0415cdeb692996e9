"""Trace replay against a real emulated console: `sibyl-console replay` and `up --replay`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from adapters.store import RunStore
from core.traces import read_trace
from tests.procs import FAST_PROFILE, FIXED_PROFILE, ROOT, kill_children, start_console, wait_for

DEMO = ROOT / "demos" / "azure_conv_sample.csv"
# committed slices of the real traces (tests/data/traces/README.md): no ../shared/traces needed
TRACES = ROOT / "tests" / "data" / "traces"
MOONCAKE_SLICE = TRACES / "mooncake_conversation_first500.jsonl"
SERVEGEN_SLICE = TRACES / "servegen_deepseek_r1_slice"


def replay(con, *args: str) -> dict:  # type: ignore[no-untyped-def, type-arg]
    out = subprocess.run(
        [sys.executable, "-m", "console.cli", "replay", *args, "--json"],
        cwd=ROOT,
        env=con.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.slow  # three trace formats end to end: ~14 s (make test-slow)
def test_replay_records_each_trace_slice_linked_to_the_console(tmp_path: Path) -> None:
    con = start_console(tmp_path, "--profile", FAST_PROFILE, "--prefill", "1", "--decode", "2")
    try:
        # Azure CSV, Mooncake JSONL (10 rows at 0 ms, 5 at 3,000 ms) and a ServeGen folder
        # (sampled: its first 600 s hold only client 39's traffic)
        slices = [(DEMO, 40, 20.0), (MOONCAKE_SLICE, 15, 50.0), (SERVEGEN_SLICE, 15, 200.0)]
        for trace, n, speed in slices:
            summary = replay(con, str(trace), "--limit", str(n), "--speed", str(speed))
            assert summary["requests"] == n and summary["done"] == n and summary["failed"] == 0, summary
            assert summary["parent_run_id"] == con.run_id
            rows = RunStore(con.db).requests(summary["run_id"])
            assert len(rows) == n and all(r["status"] == "ok" for r in rows)
            # open loop: request i is scheduled at its trace arrival / speed
            t = read_trace(trace, limit=None).window(limit=n)
            expected = sorted((t.arrivals - t.arrivals[0]) / speed)
            if trace == MOONCAKE_SLICE:
                assert expected == pytest.approx([0.0] * 10 + [0.06] * 5)
            got = sorted(r["arrival"] for r in rows)
            assert got == pytest.approx(expected, abs=0.05)
            # outputs were forced to the trace's lengths (clipped to the 1,024-token context)
            assert sorted(r["output_tokens"] for r in rows) == sorted(min(o, 1023) for o in t.output_tokens.tolist())
    finally:
        con.stop()
        kill_children(con.home)


@pytest.mark.slow  # two replays end to end: ~8 s (make test-slow, which CI runs)
def test_each_replay_sends_fresh_prompts_under_its_own_ids_and_calibrates_from_its_own_requests(tmp_path: Path) -> None:
    """Two replays of one slice through the console (the second by its --url): neither repeats the
    other's prompts (a prefix cache would serve them), every request id carries its replay's run id,
    and `calibrate`/`runs whatif` of one replay use the gateway's records of that replay only."""
    from console.offline.replay import prompt_ids

    assert prompt_ids(300, 1, 0, 5) != prompt_ids(300, 2, 0, 5) and prompt_ids(300, 1, 0, 5) == prompt_ids(300, 1, 0, 5)
    assert prompt_ids(300, 1, 0, 5)[:16] != prompt_ids(300, 1, 0, 6)[:16] and set(prompt_ids(2000, 3, 1, 1)) <= set(
        range(1, 1001)
    )
    con = start_console(
        tmp_path, "--profile", FAST_PROFILE, "--prefill", "1", "--decode", "1", "--policy", "least_load"
    )
    try:
        first = replay(con, str(DEMO), "--limit", "14", "--speed", "20")
        second = replay(con, str(DEMO), "--limit", "14", "--speed", "20", "--url", con.url + "/")
        store = RunStore(con.db)
        runs = {s["run_id"]: store.get_run(s["run_id"]) for s in (first, second)}
        assert all(info.parent_run_id == con.run_id for info in runs.values())
        assert runs[first["run_id"]].config["prompt_seed"] != runs[second["run_id"]].config["prompt_seed"]
        for run in runs:
            assert sorted(r["request_id"] for r in store.requests(run)) == sorted(f"{run}-0-{i}" for i in range(14))
        sent = {f"{run}-0-{i}" for run in runs for i in range(14)}
        wait_for(
            lambda: sent <= {r["request_id"] for r in store.requests(con.run_id)},
            10,
            "the gateway's records of both replays",
        )
        cal = con.cli("calibrate", first["run_id"], "--json", "--name", "mine")
        assert cal.returncode == 0, cal.stderr
        report = json.loads(cal.stdout)
        assert report["run_id"] == con.run_id and report["prefills"] == 14  # not the 28 the console served
        wi = con.cli("runs", "whatif", second["run_id"], "--profile", "cpu-tiny-llama", "--json")
        assert wi.returncode == 0, wi.stderr
        data = json.loads(wi.stdout)
        assert data["recorded"]["policy"] == "least_load" and data["predicted"][0]["policy"] == "least_load"
        assert data["predicted"][0]["requests"] == data["recorded"]["requests"] == 14
    finally:
        con.stop()
        kill_children(con.home)


def test_bad_trace_and_missing_console_are_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,abc,3\n")
    env = {"SIBYL_HOME": str(tmp_path / "home"), "SIBYL_DB": str(tmp_path / "x.db"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "console.cli", "replay", str(bad)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "bad.csv:2: field 'ContextTokens'" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "console.cli", "replay", str(DEMO)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "no local console" in out.stderr


@pytest.mark.slow  # ~7 s (make test-slow); a dashboard pausing a replay: tests/console/tui/test_app_live.py
def test_up_replay_pauses_resumes_and_records_a_child_run(tmp_path: Path) -> None:
    con = start_console(
        tmp_path,
        "--profile",
        FIXED_PROFILE,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--replay",
        str(DEMO),
        "--replay-speed",
        "4",
        "--loop",
    )
    try:
        wait_for(lambda: (con.state()["replay"] or {}).get("sent", 0) >= 5, 15, "the replay to send")
        with con.control() as c:
            assert c.post("/control/replay/pause").json()["status"] == "paused"
            sent = con.state()["replay"]["sent"]
            time.sleep(0.6)
            assert con.state()["replay"]["sent"] == sent and con.state()["replay"]["label"].startswith(
                "azure_conv_sample.csv"
            )
            assert c.post("/control/replay/resume").json()["status"] == "running"
            wait_for(lambda: con.state()["replay"]["sent"] > sent, 10, "sending to resume")
            assert c.post("/control/replay/rewind").status_code == 404
        assert httpx.post(con.url + "/control/replay/pause").status_code == 401
        con.stop()
        runs = {r.kind: r for r in RunStore(con.db).list_runs()}
        assert runs["replay"].parent_run_id == con.run_id and runs["replay"].status == "interrupted"
        assert runs["replay"].requests > 0 and runs["live"].status == "completed"
    finally:
        con.stop()
        kill_children(con.home)

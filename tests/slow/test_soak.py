"""A short soak (`benchmarks/soak.py`): its own emulated cluster, 32 streaming clients for 50 s."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ROOT, alive

SECONDS, WARMUP, WINDOW, CLIENTS = 50, 10, 10, 32


def ours(home: Path) -> list[int]:
    """Every live process started with this SIBYL_HOME (the soak's console and its instances)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if f"SIBYL_HOME={home}".encode() in (d / "environ").read_bytes().split(b"\0") and alive(int(d.name)):
                    found.append(int(d.name))
    return found


@pytest.mark.slow
def test_short_soak_has_no_errors_reports_every_window_and_leaves_nothing_running(tmp_path: Path) -> None:
    work = tmp_path / "soak"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.soak",
        "--seconds",
        str(SECONDS),
        "--clients",
        str(CLIENTS),
        "--warmup",
        str(WARMUP),
        "--window-s",
        str(WINDOW),
        "--prefill",
        "1",
        "--decode",
        "2",
        "--max-tokens",
        "32",
        "--swap-every",
        "15",
        "--workdir",
        str(work),
        "--json",
        # drift and RSS are judged by the long soak; 50 s on a shared 2-core machine is too noisy for 10 %
        "--max-p99-drift",
        "5",
        "--max-rss-growth",
        "1",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=SECONDS + 120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the soak stops its console on SIGTERM
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"the soak did not stop by itself:\n{err[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in ours(work / "home"):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    rep = json.loads(out)

    # zero errors, and the load really ran
    assert rep["verdict"] == "PASS" and rep["failures"] == []
    assert rep["totals"]["errors"] == 0 and rep["totals"]["error_reasons"] == {}
    assert rep["totals"]["requests"] > CLIENTS * 3
    # the report: a warm-up window then one window per 10 s, each with throughput, latency and RSS per process
    assert [w["window"] for w in rep["windows"]] == ["warmup", "w1", "w2", "w3", "w4"]
    assert [(w["start_s"], w["end_s"]) for w in rep["windows"]] == [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50)]
    assert set(rep["pids"]) == {"gateway", "p0", "d0", "d1"}
    for w in rep["windows"]:
        assert w["errors"] == 0 and w["requests"] > 0, w
        assert w["req_per_s"] > 0 and w["tokens_per_s"] == pytest.approx(w["req_per_s"] * 32)
        assert 0 < w["e2e_p50_ms"] <= w["e2e_p99_ms"] and 0 < w["tpot_p50_ms"] <= w["tpot_p99_ms"]
        assert set(w["rss_mib"]) == set(rep["pids"]) and all(v is not None and v > 10 for v in w["rss_mib"].values())
    assert set(rep["p99_drift"]) == {"e2e_p99", "tpot_p99"} and all(v is not None for v in rep["p99_drift"].values())
    assert set(rep["rss_growth"]) == set(rep["pids"]) and all(
        g["growth"] is not None for g in rep["rss_growth"].values()
    )
    # the routing policy was swapped every 15 s through the control API, and the console recorded it
    assert [(s["policy"], s["ok"]) for s in rep["swaps"]] == [
        ("least_load", True),
        ("round_robin", True),
        ("sibyl", True),
    ]
    with sqlite3.connect(work / "runs.db") as db:
        sources = db.execute(
            "SELECT new, source FROM policy_events WHERE run_id = ? AND kind = 'routing' ORDER BY id", (rep["run_id"],)
        ).fetchall()
        status = db.execute("SELECT status FROM runs WHERE run_id = ?", (rep["run_id"],)).fetchone()[0]
        served = db.execute(
            "SELECT COUNT(*) FROM requests WHERE run_id = ? AND status = 'ok'", (rep["run_id"],)
        ).fetchone()[0]
    assert [s for s in sources if s[1] == "soak"] == [
        ("least_load", "soak"),
        ("round_robin", "soak"),
        ("sibyl", "soak"),
    ]
    # stopped with SIGTERM (a clean drain), every request the clients saw done is in the run store
    assert rep["stop"] == {"how": "SIGTERM", "exit_code": 0, "leftover": {}}
    assert status == "completed" and served == rep["totals"]["requests"]
    # and nothing it started still runs
    assert not any(alive(pid) for pid in rep["pids"].values())
    assert ours(work / "home") == []

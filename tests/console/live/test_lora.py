"""LoRA adapters on a live console's instances (console/live/lora.py) against vLLM's answers (httpx.MockTransport):
loads where requests run, one load shared by concurrent requests, least recently used idle adapters unloaded to
make room, adapters in use never, failures naming the instance and vLLM's message, residency from scrapes, and
`lora add` refusing a bad path before any instance is touched."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from adapters.vllm.instances import Instance
from adapters.vllm.lora import AdapterCallError, LoraEndpoints
from adapters.vllm.scrape import parse_metrics
from console.live.lora import LiveAdapters, LoraCollector
from core.dispatch import Dispatcher
from core.errors import ConfigError
from core.lora import Tier
from core.perf import get_profile
from core.pools import Pool, Pools
from core.types import Role


class FakeVllm:
    """Each instance's registered adapters, answered as vLLM 0.32 answers; `refuse` maps an instance to a 404."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.loaded: dict[str, set[str]] = {}
        self.refuse: set[str] = set()
        self.delay_s = 0.0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host, body = request.url.host, json.loads(request.content)
        name = body["lora_name"]
        action = "load" if request.url.path == "/v1/load_lora_adapter" else "unload"
        self.calls.append((host, action, name))
        await asyncio.sleep(self.delay_s)
        have = self.loaded.setdefault(host, set())
        if action == "load":
            if host in self.refuse:
                return error(404, f"Loading lora {name} failed: No adapter found for {body['lora_path']}")
            have.add(name)
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")
        if name not in have:
            return error(404, f"The lora adapter '{name}' cannot be found.")
        have.discard(name)
        return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed successfully.")


def error(status: int, message: str) -> httpx.Response:
    return httpx.Response(
        status, content=orjson.dumps({"error": {"message": message, "type": "NotFoundError", "param": None}})
    )


def adapter_dir(root: Path, name: str) -> str:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8}')
    return str(d)


def setup(
    max_loras: int = 2, adapters: dict[str, str] | None = None
) -> tuple[LiveAdapters, FakeVllm, dict[str, Instance]]:
    vllm = FakeVllm()
    insts = {i: Instance(i, role, f"http://{i}") for i, role in (("p0", Role.PREFILL), ("d0", Role.DECODE))}
    insts["d1"] = Instance("d1", Role.DECODE, "http://d1")
    pool = Pool("m", "m", Dispatcher(get_profile("h20-qwen3-32b"), "least_load"), adapters=dict(adapters or {}))
    live = LiveAdapters(
        Pools([pool]), insts, max_loras, LoraEndpoints(httpx.AsyncClient(transport=httpx.MockTransport(vllm)))
    )
    for inst in insts.values():
        live.instance_added(inst)
    return live, vllm, insts


def test_a_request_loads_its_adapter_once_and_the_next_finds_it() -> None:
    live, vllm, insts = setup(adapters={"a": "/ad/a"})

    async def go() -> None:
        vllm.delay_s = 0.05
        waits = await asyncio.gather(*(live.place(f"r{i}", insts["p0"], "a") for i in range(3)))
        assert vllm.calls == [("p0", "load", "a")] and all(w >= 0.04 for w in waits)  # one load, all waited
        assert await live.place("r3", insts["p0"], "a") == 0.0

    asyncio.run(go())
    c = live.counts["m"]
    assert (c.hits, c.misses, c.loads) == (1, 3, 1)  # three waited for the one load, the fourth found it
    held = live.pools.pick(None).residency.of("p0")
    assert held.slots["a"].active == 4 and held.tier("a", 1e12) == Tier.LOADED
    for i in range(4):
        live.release(f"r{i}")
    assert held.slots["a"].active == 0 and live.holders("a") == {"p0"}


def test_a_full_instance_unloads_its_least_recently_used_idle_adapter() -> None:
    live, vllm, insts = setup(max_loras=2, adapters={"a": "/a", "b": "/b", "c": "/c"})

    async def go() -> None:
        await live.place("r1", insts["d0"], "a")
        await live.place("r2", insts["d0"], "b")
        live.release("r1")  # a idle (least recently used), b in use
        await live.place("r3", insts["d0"], "c")
        assert vllm.calls[-2:] == [("d0", "unload", "a"), ("d0", "load", "c")]
        assert vllm.loaded["d0"] == {"b", "c"} and live.adapters_on("d0") == ["b", "c"]
        with pytest.raises(AdapterCallError, match=r"adapter 'a' on d0 failed: every one of its 2 adapter slots"):
            await live.place("r4", insts["d0"], "a")  # b and c both in use: nothing to evict

    asyncio.run(go())
    c = live.counts["m"]
    assert (c.loads, c.evictions, c.load_failures) == (3, 1, 1)


def test_a_refused_load_names_the_instance_and_vllms_message_and_leaves_nothing_held() -> None:
    live, vllm, insts = setup(adapters={"a": "/ad/a"})
    vllm.refuse.add("d1")
    with pytest.raises(AdapterCallError, match=r"on d1 failed: vLLM answered 404: Loading lora a failed: No adapter"):
        asyncio.run(live.place("r1", insts["d1"], "a"))
    assert not live.pools.pick(None).residency.of("d1").holds("a") and live.holders("a") == set()
    assert live.counts["m"].load_failures == 1
    with pytest.raises(AdapterCallError, match="not registered with pool 'm'"):
        asyncio.run(live.place("r2", insts["p0"], "nope"))


def test_a_scrape_tells_which_adapters_ran_there() -> None:
    live, _, insts = setup()
    page = (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="x",waiting_lora_adapters=""} 100.0\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="x,y",waiting_lora_adapters="z"} 105.0\n'
    )
    insts["d0"].sample = parse_metrics(page)
    assert insts["d0"].sample.lora_running == ("x", "y") and insts["d0"].sample.lora_at == 105.0
    live.observe(insts["d0"], now=50.0)
    assert live.adapters_on("d0") == ["x", "y"]
    assert live.pools.pick(None).residency.of("d0").tier("y", 50.0) == Tier.LOADED
    assert parse_metrics("vllm:num_requests_running 1\n").lora_running is None  # no --enable-lora


def test_lora_add_checks_the_path_before_touching_an_instance_then_loads_on_each_role(tmp_path: Path) -> None:
    live, vllm, _ = setup()
    with pytest.raises(ConfigError, match="has no adapter_config.json"):
        asyncio.run(live.add("sql", str(tmp_path)))
    assert vllm.calls == [] and "sql" not in live.pools.routes
    result = asyncio.run(live.add("sql", adapter_dir(tmp_path, "sql")))
    assert result["loaded_on"] == ["p0", "d0"] and result["errors"] == []
    assert [c for c in vllm.calls] == [("p0", "load", "sql"), ("d0", "load", "sql")]
    assert live.pools.resolve("sql").adapter == "sql"
    snap = live.snapshot()["m"]
    assert snap["adapters"]["sql"]["instances"] == ["d0", "p0"] and snap["adapters"]["sql"]["in_flight"] == 0
    removed = asyncio.run(live.remove("sql"))
    assert sorted(removed["unloaded_from"]) == ["d0", "p0"] and "sql" not in live.pools.routes


def test_lora_add_that_no_instance_takes_is_not_kept(tmp_path: Path) -> None:
    live, vllm, _ = setup()
    vllm.refuse.update({"p0", "d0", "d1"})
    with pytest.raises(AdapterCallError, match=r"on p0 failed: vLLM answered 404: .*; load of LoRA adapter 'sql' on d"):
        asyncio.run(live.add("sql", adapter_dir(tmp_path, "sql")))
    assert "sql" not in live.pools.routes


def test_metrics_count_per_pool() -> None:
    live, _, insts = setup(adapters={"a": "/a"})
    asyncio.run(live.place("r1", insts["p0"], "a"))
    asyncio.run(live.place("r2", insts["p0"], "a"))
    registry = CollectorRegistry()
    registry.register(LoraCollector(live.counts))
    text = generate_latest(registry).decode()
    assert 'sibyl_lora_hits_total{pool="m"} 1.0' in text and 'sibyl_lora_loads_total{pool="m"} 1.0' in text
    assert 'sibyl_lora_misses_total{pool="m"} 1.0' in text and 'sibyl_lora_evictions_total{pool="m"} 0.0' in text

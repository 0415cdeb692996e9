"""Several pools on one console (console/live/pools.py): each [[pools]] entry's backend settings and instance ids, and
a controller with two pools whose parts answer for their own pool only, whose swaps are stored with their pool and whose
summary keeps each pool's decision quality."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from adapters.backends import Capability
from adapters.store import RunStore
from adapters.vllm.instances import Instance
from console.live.config import ConsoleConfig
from console.live.controller import Controller
from console.live.pools import cluster_label, instance_prefixes, plan_pools
from console.live.scaler import Scaler
from core.errors import ConfigError
from core.pools import UnknownPool
from core.types import InstancePhase, Request, Role, ScaleAction
from tests.console.live.fakes import Cluster, FakeBackend


def adapter(root: Path, name: str) -> str:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return str(d)


def two_pools(**top: Any) -> ConsoleConfig:
    return ConsoleConfig.model_validate(
        {
            "policy": "round_robin",
            "pools": [
                {"model": "A", "prefill": 1, "decode": 2, **top.pop("a", {})},
                {"model": "org/B", "name": "b", "prefill": 2, "decode": 1, "profile": "cpu-tiny-llama"},
            ],
            **top,
        }
    )


def test_each_pool_gets_an_id_prefix_that_is_safe_in_urls_and_unique() -> None:
    assert instance_prefixes(["A", "b"]) == ["A.", "b."]
    assert instance_prefixes(["org/llama 8b", "org_llama_8b", "x-1"]) == ["org_llama_8b_0.", "org_llama_8b_1.", "x-1."]


def test_one_pool_plans_the_top_level_cluster() -> None:
    cfg = ConsoleConfig(prefill=1, decode=3, served_model_name="m")
    (plan,) = plan_pools(cfg)
    assert (plan.name, plan.model, plan.settings) == ("m", "m", cfg.backend_settings())
    assert plan.settings.instance_prefix == "" and cluster_label([plan]) == "1P3D"


def test_several_pools_plan_their_own_counts_profile_model_ids_and_ports(tmp_path: Path) -> None:
    sql = adapter(tmp_path, "sql")
    cfg = two_pools(instance_base_port=9000, a={"adapters": {"sql": sql}})
    a, b = plan_pools(cfg)
    assert (a.name, a.model, a.profile, a.adapters) == ("A", "A", cfg.profile, {"sql": sql})
    assert (b.name, b.model, b.profile, b.adapters) == ("b", "org/B", "cpu-tiny-llama", {})
    sa, sb = a.settings, b.settings
    assert (sa.prefill, sa.decode, sa.served_model_name, sa.instance_prefix) == (1, 2, "A", "A.")
    assert (sb.prefill, sb.decode, sb.served_model_name, sb.instance_prefix) == (2, 1, "org/B", "b.")
    assert (sa.instance_base_port, sb.instance_base_port) == (9000, 9003)  # after A's three instances
    assert sa.emulator.enable_lora and not sb.emulator.enable_lora  # only the pool with adapters serves LoRA
    assert cluster_label([a, b]) == "A:1P2D+b:2P1D"


def test_several_pools_refuse_what_names_no_pool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be combined with several"):
        plan_pools(two_pools(attach={"prefill": ["http://h:1"], "decode": ["http://h:2"]}))
    with pytest.raises(ConfigError, match="put chat in that pool's `adapters`"):
        plan_pools(two_pools(lora={"adapters": {"chat": adapter(tmp_path, "chat")}}))


def test_a_scaled_out_instance_keeps_its_pools_prefix() -> None:
    async def body() -> None:
        insts = [Instance("B.p0", Role.PREFILL, "http://127.0.0.1:1"), Instance("B.d0", Role.DECODE, "http://x:1")]
        host = Cluster(FakeBackend(frozenset({Capability.SCALE})), insts)
        scaler = Scaler(
            host.backend,
            host.dispatcher,
            host.instances,
            host.config,
            host.metrics,
            host.outcomes,
            host.listeners,
            id_prefix="B.",
        )
        assert scaler.execute(ScaleAction("add", Role.DECODE, reason="load"), "api") == "B.d1"
        while scaler.busy:
            await asyncio.sleep(0.01)
        assert host.fake.calls == [("add", "decode", "B.d1")] and "B.d1" in host.instances
        await host.instances["B.d1"].close()

    asyncio.run(body())


PD = (Role.PREFILL, Role.DECODE)


def controller(tmp_path: Path) -> tuple[Controller, list[FakeBackend]]:
    cfg = two_pools()
    plans = plan_pools(cfg)
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run(kind="live", backend="fake", cluster="x", workload="", policy="round_robin", config={})
    fakes = [FakeBackend(), FakeBackend()]
    started = [
        [Instance(f"{p.settings.instance_prefix}{r.value[0]}0", r, "http://127.0.0.1:1") for r in PD]
        for p in plans
    ]
    c = Controller(
        cfg,
        [],
        store=store,
        run_id=run_id,
        run_dir=tmp_path / run_id,
        backend=fakes[0],  # type: ignore[arg-type]
        pools=list(zip(plans, fakes, started, strict=True)),  # type: ignore[arg-type]
    )
    return c, fakes


def test_a_controller_with_two_pools_keeps_each_pools_parts_apart(tmp_path: Path) -> None:
    c, _ = controller(tmp_path)
    a, b = c.runtimes
    assert a.dispatcher is not b.dispatcher and a.held is not b.held and a.health is not b.health
    assert sorted(a.dispatcher.view.instance_ids) == ["A.d0", "A.p0"]
    assert sorted(b.dispatcher.view.instance_ids) == ["b.d0", "b.p0"]
    assert sorted(c.instances) == ["A.d0", "A.p0", "b.d0", "b.p0"]
    assert c.runtime_with("b.d0") is b and c.runtime_with("nope") is None
    assert c.pools.resolve("org/B").pool is b.pool and c.runtime_of[b.pool].services.dispatcher is b.dispatcher

    b.dispatcher.add_instance("b.d1", Role.DECODE, phase=InstancePhase.STARTING)
    state = c.state()
    assert state["cluster"] == "2P2D" and state["model"] == ["A", "org/B"]
    assert [(i["id"], i["pool"]) for i in state["instances"]] == [
        ("A.p0", "A"),
        ("A.d0", "A"),
        ("b.p0", "b"),
        ("b.d0", "b"),
        ("b.d1", "b"),  # starting, shown in its pool
    ]
    assert {n: p["cluster"] for n, p in state["pools"].items()} == {"A": "1P1D", "b": "1P1D"}

    with pytest.raises(UnknownPool, match="runs 2 pools"):
        c.set_policy("routing", "least_load", None, "api")
    c.set_policy("routing", "least_load", None, "api", pool="b")
    assert c.state()["pools"]["A"]["policies"]["routing"]["name"] == "round_robin"
    assert c.state()["pools"]["b"]["policies"]["routing"]["name"] == "least_load"


def test_a_swap_is_stored_with_its_pool_and_the_summary_keeps_each_pools_decision_quality(tmp_path: Path) -> None:
    c, _ = controller(tmp_path)
    a, b = c.runtimes
    for rid in ("r1", "r2"):  # two requests through pool b: decoding began on b.d0, its only (so best) decode instance
        b.dispatcher.route(Request(rid, 0.0, 10, 5), 0.0)
        b.dispatcher.on_decode_start(rid, 0.0)
    c.set_policy("routing", "least_load", None, "api", pool="b")
    c.recorder.close(status="completed", summary=c.summary())
    [swap] = c.store.policy_events(c.run_id)
    assert (swap["new"], swap["source"], swap["pool"]) == ("least_load", "api", "b")
    summary = c.store.get_run(c.run_id).summary or {}
    pools = summary["pools"]
    assert {n: p["model"] for n, p in pools.items()} == {"A": "A", "b": "org/B"}
    assert (pools["b"]["decision_quality"]["decode_scored"], pools["b"]["decision_quality"]["decode_still_best"]) == (
        2,
        1.0,
    )
    assert (pools["A"]["decision_quality"]["decode_scored"], pools["A"]["decision_quality"]["decode_still_best"]) == (
        0,
        None,
    )
    assert summary["decision_quality"] == pools["A"]["decision_quality"]  # the first pool's, as with one pool


def test_the_poller_reaches_the_instances_pool(tmp_path: Path) -> None:
    async def body() -> None:
        c, _ = controller(tmp_path)
        a, b = c.runtimes
        inst = b.instances["b.d0"]
        inst.healthy = False  # as the poller marks it before it calls back
        c._on_status(inst, False, "probe failed")
        assert not b.dispatcher.view.healthy[b.dispatcher.index_of("b.d0")]
        assert all(a.dispatcher.view.healthy[a.dispatcher.index_of(i)] for i in ("A.p0", "A.d0"))

    asyncio.run(body())

"""Pools behind one gateway: a request's model (a base model, an alias, an adapter) picks its pool and adapter,
names are unique across pools, an operator names a pool (or the only one), and /v1/models lists every model and
adapter with its parent, as vLLM does."""

from __future__ import annotations

import pytest

from core.dispatch import Dispatcher
from core.errors import ConfigError
from core.perf import get_profile
from core.pools import Pool, Pools, UnknownModel, UnknownPool
from core.types import Role


def pool(name: str, model: str, adapters: dict[str, str] | None = None) -> Pool:
    d = Dispatcher(get_profile("h20-qwen3-32b"), "least_load")
    return Pool(name, model, d, adapters=dict(adapters or {}))


def test_a_model_or_adapter_name_picks_its_pool_and_adapter() -> None:
    a, b = pool("a", "llama-8b", {"sql": "/ad/sql"}), pool("b", "qwen-7b", {"chat": "/ad/chat"})
    pools = Pools([a, b])
    assert (pools.resolve("llama-8b").pool, pools.resolve("llama-8b").adapter) == (a, None)
    assert (pools.resolve("sql").pool, pools.resolve("sql").adapter) == (a, "sql")
    assert (pools.resolve("chat").pool, pools.resolve("chat").adapter) == (b, "chat")
    with pytest.raises(UnknownModel, match=r"The model `mistral` does not exist\. Served .*: chat, llama-8b"):
        pools.resolve("mistral")
    with pytest.raises(UnknownModel):  # several models: a request must name one
        pools.resolve(None)
    assert pools.default is None
    one = Pools([pool("only", "m")])
    assert one.resolve(None).pool.model == "m" and one.resolve(None).adapter is None


def test_each_pool_has_its_own_dispatcher_whose_view_reads_its_residency() -> None:
    a, b = pool("a", "m1"), pool("b", "m2")
    pools = Pools([a, b])
    assert a.dispatcher is not b.dispatcher and a.dispatcher.view.lora is a.residency
    a.dispatcher.add_instance("p0", Role.PREFILL)
    pools.add_instance(a, "p0", max_loras=2)
    pools.add_instance(b, "q0")
    assert pools.of_instance("p0") is a and pools.of_instance("q0") is b and pools.of_instance("x") is None
    assert a.residency.of("p0").max_loras == 2 and "q0" not in a.residency.instances
    pools.remove_instance("p0")
    assert pools.of_instance("p0") is None and "p0" not in a.instance_ids and "p0" not in a.residency.instances


def test_names_are_unique_across_pools() -> None:
    with pytest.raises(ConfigError, match="two pools are named 'a'"):
        Pools([pool("a", "m1"), pool("a", "m2")])
    with pytest.raises(ConfigError, match="'m1' is already the base model of pool 'a'"):
        Pools([pool("a", "m1"), pool("b", "m2", {"m1": "/x"})])
    pools = Pools([pool("a", "m1", {"sql": "/x"}), pool("b", "m2")])
    with pytest.raises(ConfigError, match="'sql' is already the adapter of pool 'a'"):
        pools.add_adapter(pools.pick("b"), "sql", "/y")
    with pytest.raises(ConfigError, match="already registered with pool 'a'"):
        pools.add_adapter(pools.pick("a"), "sql", "/y")
    assert not pools.add_alias(pools.pick("b"), "m1") and pools.resolve("m1").pool.name == "a"
    assert pools.add_alias(pools.pick("b"), "/models/m2") and pools.resolve("/models/m2").pool.name == "b"


def test_adapters_come_and_go_at_run_time() -> None:
    pools = Pools([pool("a", "m1")])
    a = pools.pick(None)
    pools.add_adapter(a, "sql", "/ad/sql")
    assert pools.resolve("sql").adapter == "sql" and a.adapters == {"sql": "/ad/sql"}
    assert pools.remove_adapter("sql") is a and a.adapters == {}
    with pytest.raises(UnknownModel, match="`sql` does not exist"):
        pools.resolve("sql")
    with pytest.raises(UnknownModel):
        pools.remove_adapter("m1")  # a base model is not an adapter


def test_an_operator_names_a_pool_or_gets_the_only_one() -> None:
    one = Pools([pool("a", "m1")])
    assert one.pick(None).name == "a"
    two = Pools([pool("a", "m1"), pool("b", "m2")])
    assert two.pick("b").model == "m2"
    with pytest.raises(UnknownPool, match=r"runs 2 pools \(a, b\): name one"):
        two.pick(None)
    with pytest.raises(UnknownPool, match="no pool 'c'; pools: a, b"):
        two.pick("c")


def test_the_model_cards_list_every_model_and_adapter_with_its_parent() -> None:
    pools = Pools([pool("a", "m1", {"sql": "/ad/sql"}), pool("b", "m2")])
    cards = {c["id"]: c for c in pools.cards(created=7, max_model_len=4096)}
    assert list(cards) == ["m1", "m2", "sql"]
    base = {"id": "m1", "object": "model", "created": 7, "owned_by": "sibyl-console", "max_model_len": 4096}
    assert cards["m1"] == base and "parent" not in cards["m2"]
    assert cards["sql"]["parent"] == "m1" and cards["sql"]["root"] == "/ad/sql"

"""LoRA adapter residency (slots, LRU eviction, tiers, waits, reports) and adapter-carrying prefix keys."""

from __future__ import annotations

import math

import pytest

from adapters.vllm import kv_wire
from adapters.vllm.kv_events import EngineKeyMap
from core.cache.keys import adapter_extra, chain_keys, prompt_keys
from core.lora import AdapterSlotsFull, InstanceAdapters, LoraResidency, Tier
from core.perf import PerfProfile
from tests.helpers import toy_profile

LOAD_S = 0.5


def test_loads_fill_free_slots_then_evict_the_least_recently_used_idle_adapter() -> None:
    inst = InstanceAdapters(max_loras=2)
    assert inst.load("a", 0.0, LOAD_S).loaded and inst.load("b", 1.0, LOAD_S).loaded
    assert inst.load("a", 2.0, LOAD_S).loaded is False  # a hit: a is now the most recently used
    placed = inst.load("c", 3.0, LOAD_S)
    assert placed.loaded and placed.evicted == "b" and placed.ready_at == 3.5
    assert sorted(inst.slots) == ["a", "c"]
    c = inst.counters
    assert (c.hits, c.misses, c.loads, c.evictions) == (1, 3, 3, 1)


def test_an_adapter_in_use_or_still_loading_is_never_evicted() -> None:
    inst = InstanceAdapters(max_loras=2)
    inst.acquire("a", 0.0, LOAD_S)  # pinned by a running request
    inst.load("b", 0.0, LOAD_S)  # loading until 0.5
    assert inst.tier("c", 0.2) is Tier.FULL and math.isinf(inst.wait_s("c", 0.2, LOAD_S))
    with pytest.raises(AdapterSlotsFull, match="cannot load 'c'"):
        inst.load("c", 0.2, LOAD_S)
    assert inst.tier("c", 0.6) is Tier.EVICT  # b finished loading and is idle
    inst.release("a", 1.0)  # a is idle now and the most recently used
    assert inst.load("c", 1.0, LOAD_S).evicted == "b"


@pytest.mark.parametrize(
    ("now", "tier", "wait"),
    [(0.1, Tier.LOADING, 0.4), (0.5, Tier.LOADED, 0.0), (9.0, Tier.LOADED, 0.0)],
)
def test_tier_and_wait_of_a_held_adapter_follow_its_load(now: float, tier: Tier, wait: float) -> None:
    inst = InstanceAdapters(max_loras=1)
    inst.load("a", 0.0, LOAD_S)
    assert inst.tier("a", now) is tier
    assert inst.wait_s("a", now, LOAD_S) == pytest.approx(wait)
    assert inst.loaded(now) == ([] if tier is Tier.LOADING else ["a"])


def test_tiers_of_an_adapter_not_held() -> None:
    inst = InstanceAdapters(max_loras=2)
    assert inst.tier("x", 0.0) is Tier.FREE_SLOT and inst.wait_s("x", 0.0, LOAD_S) == LOAD_S
    inst.load("a", 0.0, 0.0)
    inst.load("b", 0.0, 0.0)
    assert inst.tier("x", 0.0) is Tier.EVICT and inst.wait_s("x", 0.0, LOAD_S) == LOAD_S


def test_an_instance_report_marks_running_adapters_loaded_and_drops_the_evicted() -> None:
    inst = InstanceAdapters(max_loras=2)
    inst.load("a", 0.0, LOAD_S)
    inst.load("b", 1.0, LOAD_S)
    # the instance runs c and b: it must have evicted a, the least recently used
    assert inst.observe(["c", "b", ""], 2.0) == ["a"]
    assert inst.loaded(2.0) == ["b", "c"]
    assert inst.slots["b"].ready_at == 1.5  # already loaded by then


def test_the_cluster_view_of_residency_by_instance_index() -> None:
    res = LoraResidency(default_max_loras=1)
    res.add_instance("p0", max_loras=2).load("a", 0.0, LOAD_S)
    res.add_instance("d0").acquire("b", 0.0, 0.0)  # one slot, pinned
    ids = ["p0", "d0", "new"]
    assert res.tiers("a", ids, 1.0).tolist() == [Tier.LOADED, Tier.FULL, Tier.FREE_SLOT]
    assert res.wait_s("a", ids, 0.2, LOAD_S).tolist() == pytest.approx([0.3, math.inf, LOAD_S])
    assert res.holders("a") == ["p0"]
    assert res.counters().loads == 2
    with pytest.raises(ValueError, match="max_loras"):
        InstanceAdapters(0)


def test_profiles_default_the_lora_terms_and_existing_profiles_load_unchanged() -> None:
    p = toy_profile()
    assert p.lora_load_s == 0.5 and p.lora_per_adapter_step_s == 0.0005
    assert PerfProfile.model_validate({**p.model_dump(), "lora_load_s": 2.0}).lora_load_s == 2.0


# --- prefix keys carry the adapter -------------------------------------------------------------
TOKENS = list(range(64))
BS = 16


def test_base_model_keys_are_the_plain_chain() -> None:
    assert prompt_keys(TOKENS, BS) == prompt_keys(TOKENS, BS, "") == chain_keys(TOKENS, BS)
    assert adapter_extra(None) is None and adapter_extra("") is None


def test_no_block_of_one_adapter_matches_another_or_the_base_model() -> None:
    base, a, b = (set(prompt_keys(TOKENS, BS, x)) for x in (None, "a", "b"))
    assert len(base) == len(a) == len(b) == 4
    assert not (base & a) and not (base & b) and not (a & b)
    assert prompt_keys(TOKENS, BS, "a") == prompt_keys(TOKENS, BS, "a")  # stable


def test_gateway_keys_equal_the_kv_event_translation_of_an_adapters_blocks() -> None:
    """A prompt keyed at the gateway under adapter a matches the keys our KV-event subscriber gives the
    blocks vLLM stores under a (its BlockStored carries lora_name; vLLM hashes the name in)."""
    stored = kv_wire.BlockStored(
        block_hashes=[101, 102, 103, 104],
        parent_block_hash=None,
        token_ids=TOKENS,
        block_size=BS,
        lora_id=1,
        medium="GPU",
        lora_name="a",
    )
    ours = EngineKeyMap().stored(stored)
    assert ours is not None and list(ours.keys) == prompt_keys(TOKENS, BS, "a")

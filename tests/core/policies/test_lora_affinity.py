"""Adapter-aware routing on hand-built states: holders first within the load bound on both legs, the spill
tier's TTFT with the adapter's load counted, slots in use, late binding, records, the registry."""

from __future__ import annotations

from typing import Any

import pytest

from core.decision_log import DecisionLog
from core.decision_records import Decision
from core.dispatch import Dispatcher
from core.errors import PolicyError
from core.lora import LoraResidency, Tier
from core.perf import PerfProfile
from core.policies import registry
from core.types import PolicyKind, Request, Role
from tests.helpers import toy_profile

LOAD_S = 0.5
"""The profile's adapter load time."""


def cluster(
    params: dict[str, Any] | None = None,
    *,
    prefill: int = 3,
    decode: int = 3,
    held: dict[str, list[str]] | None = None,
    policy: str = "lora_affinity",
    max_loras: int = 2,
) -> Dispatcher:
    """Instances p0.. and d0..; `held[i]` lists the adapters instance i holds (loaded at time 0)."""
    prof = profile(LOAD_S)
    d = Dispatcher(prof, policy, params)
    for i in range(prefill):
        d.add_instance(f"p{i}", Role.PREFILL)
    for i in range(decode):
        d.add_instance(f"d{i}", Role.DECODE)
    res = LoraResidency(default_max_loras=max_loras)
    for iid in d.view.instance_ids:
        res.add_instance(iid)
    for iid, adapters in (held or {}).items():
        for a in adapters:
            res.of(iid).load(a, 0.0, 0.0)
    d.view.lora = res
    return d


def profile(load_s: float) -> PerfProfile:
    """Prefill 1 ms a token; engine steps cost next to nothing, so TTFTs are queue + prefill (+ load)."""
    return toy_profile(prefill_base_s=0.0, prefill_per_token_s=0.001, decode_step_base_s=1e-9, lora_load_s=load_s)


def req(rid: str = "r", lora: str | None = "a", tokens: int = 100) -> Request:
    return Request(rid, 0.0, tokens, 10, lora=lora)


def busy(d: Dispatcher, *, prefill: dict[str, int] | None = None, running: dict[str, int] | None = None) -> None:
    for iid, n in (prefill or {}).items():
        d.view.prefill_n[d.index_of(iid)] = n
    for iid, n in (running or {}).items():
        d.view.running_n[d.index_of(iid)] = n


def test_holders_of_the_adapter_on_both_legs_win_over_the_wrapped_policys_choice() -> None:
    d = cluster({"routing": "least_load"}, held={"p2": ["a"], "d1": ["a"]})
    busy(d, running={"d0": 0, "d1": 1, "d2": 0})  # least_load alone would pick d0 or d2
    d.view.prefill_free_at[d.index_of("p2")] = 0.2  # and p0 or p1, which free up first
    a = d.route(req(), 0.0)
    assert (a.prefill, a.decode) == ("p2", "d1")
    # the adapter is loaded on both: the wrapped policy's handoff, 0.2 s queued + 0.1 s of prefill
    assert a.projected_handoff == pytest.approx(0.3, abs=1e-6)


def test_base_model_requests_and_unknown_residency_route_as_the_wrapped_policy() -> None:
    d = cluster({"routing": "least_load"}, held={"p2": ["a"], "d1": ["a"]})
    plain = cluster(policy="least_load")
    for k in range(6):
        assert d.route(req(f"r{k}", lora=None), 0.0) == plain.route(req(f"r{k}", lora=None), 0.0)
    d.view.lora = None
    got = d.route(req("x"), 0.0)
    assert got == plain.route(req("x"), 0.0)


def test_past_the_load_bound_the_request_goes_where_ttft_with_the_load_is_least() -> None:
    # epsilon 0, no floor: mean in prefill with the newcomer (3 + 0 + 0 + 1) / 3 → bound 2; p2 holds a, has 3
    d = cluster({"routing": "least_load", "epsilon": 0.0, "min_bound": 1}, held={"p2": ["a"], "d0": ["a"]})
    busy(d, prefill={"p2": 3})
    free_at = d.view.prefill_free_at
    free_at[d.index_of("p2")] = 0.6  # holder: 0.6 queued + 0 load + 0.1 prefill = 0.7
    free_at[d.index_of("p0")] = 0.3  # 0.3 + 0.5 load + 0.1 = 0.9
    free_at[d.index_of("p1")] = 0.05  # 0.05 + 0.5 + 0.1 = 0.65: least
    a = d.route(req(), 0.0)
    assert a.prefill == "p1"
    assert a.projected_handoff == pytest.approx(0.65, abs=1e-6)
    # with a longer load the overloaded holder is still the least TTFT
    d.view.profile = profile(2.0)
    busy(d, prefill={"p1": 0, "p2": 3})
    assert d.route(req("r2"), 0.0).prefill == "p2"


@pytest.mark.parametrize(("in_prefill", "want"), [(3, "p2"), (4, "p0|p1")])
def test_the_bound_never_falls_below_min_bound(in_prefill: int, want: str) -> None:
    # mean with the newcomer (n + 1) / 3, times 1.5, stays under the floor of 4 requests
    d = cluster({"routing": "least_load", "min_bound": 4}, held={"p2": ["a"]})
    busy(d, prefill={"p2": in_prefill})
    # 0.55 s queued: loading a elsewhere (0.5 s) would be quicker, but within the bound p2 is kept
    d.view.prefill_free_at[d.index_of("p2")] = 0.55
    assert d.route(req(), 0.0).prefill in want.split("|")


def test_an_instance_whose_slots_are_all_in_use_is_no_spill_candidate() -> None:
    d = cluster({"routing": "least_load", "epsilon": 0.0, "min_bound": 1}, held={"p0": ["a"]}, max_loras=1)
    busy(d, prefill={"p0": 5})
    d.view.prefill_free_at[d.index_of("p0")] = 2.0  # the holder is far behind
    d.view.lora.of("p1").acquire("b", 0.0, 0.0)  # p1's one slot runs b
    d.view.prefill_free_at[d.index_of("p2")] = 0.3  # p1 would free up first, but cannot take a
    assert d.view.lora.tiers("a", ["p1"], 0.0).tolist() == [Tier.FULL]
    assert d.route(req(), 0.0).prefill == "p2"


def test_decode_leg_spills_to_the_wrapped_policys_choice_among_instances_that_can_take_it() -> None:
    d = cluster({"routing": "least_load", "epsilon": 0.0, "min_bound": 1}, held={"p0": ["a"], "d0": ["a"]}, max_loras=1)
    busy(d, running={"d0": 4, "d1": 1, "d2": 2})
    d.view.lora.of("d1").acquire("b", 0.0, 0.0)  # d1, least loaded, cannot take a
    a = d.route(req(), 0.0)
    assert (a.prefill, a.decode) == ("p0", "d2")
    # the decode load of a starts at routing, 0.5 s; the prefill (0.1 s) ends first
    assert a.projected_handoff == pytest.approx(LOAD_S, abs=1e-6)


def test_every_slot_everywhere_in_use_leaves_the_wrapped_policy_all_instances() -> None:
    d = cluster({"routing": "least_load"}, max_loras=1)
    for iid in d.view.instance_ids:
        d.view.lora.of(iid).acquire("b", 0.0, 0.0)
    d.view.prefill_free_at[:] = [0.3, 0.1, 0.2, 0.0, 0.0, 0.0]
    a = d.route(req(), 0.0)
    assert a.prefill == "p1" and a.projected_handoff == pytest.approx(0.2, abs=1e-6)  # the wait is unknown


def test_late_binding_chooses_the_decode_holder_at_prefill_end() -> None:
    d = cluster({"routing": "least_load", "routing_params": {"bind": "prefill_end"}}, held={"d2": ["a"]})
    assert d.routing.bind_at == "prefill_end"
    busy(d, running={"d2": 1})
    assert d.route(req(), 0.0).decode is None
    assert d.bind_late("r", 0.5) == "d2"


def test_decision_records_show_each_candidates_residency_on_both_legs() -> None:
    d = cluster({"routing": "least_load", "epsilon": 0.0, "min_bound": 1}, held={"p2": ["a"], "d1": ["a"]})
    busy(d, prefill={"p2": 3})
    d.view.lora.of("p1").load("a", 0.0, LOAD_S)  # p1 is loading a: 0.5 s left
    log = DecisionLog(max_per_s=10**9)
    d.use_decisions(log)
    a = d.route(req(), 0.0)
    recs: dict[str, Decision] = {r.get().stage: r.get() for r in log.ring}
    pre, dec = recs["prefill"], recs["decode"]
    assert pre.names == ("p0", "p1", "p2") and pre.chosen == a.prefill
    assert pre.feature("lora_tier") == [Tier.FREE_SLOT, Tier.LOADING, Tier.LOADED]
    assert pre.feature("lora_wait_s") == [LOAD_S, LOAD_S, 0.0]
    # p2 holds a but is past the bound (3 + 1 > (3 + 1) / 3); p1 loading a is within it
    assert pre.info["lora_tier"] == "affinity" and a.prefill == "p1"
    assert pre.info["lora"] == "a" and pre.info["lora_load_bound"] == 2
    assert dec.chosen == "d1" and dec.feature("lora_tier")[1] == Tier.LOADED
    assert dec.info["lora_tier"] == "affinity"


def test_the_spill_tier_records_its_own_ttft_scores() -> None:
    d = cluster({"routing": "least_load", "epsilon": 0.0, "min_bound": 1}, held={"p2": ["a"]})
    busy(d, prefill={"p2": 3})
    d.view.prefill_free_at[:3] = [0.3, 0.05, 0.6]
    log = DecisionLog(max_per_s=10**9)
    d.use_decisions(log)
    d.route(req(), 0.0)
    pre = next(r.get() for r in log.ring if r.get().stage == "prefill")
    assert pre.score_name == "est_ttft_with_lora_load_s" and pre.info["lora_tier"] == "spill"
    assert pre.scores == pytest.approx([0.9, 0.65, 0.7], abs=1e-6) and pre.chosen == "p1"


@pytest.mark.parametrize("inner", ["sibyl", "prefix_aware", "round_robin", "session_affinity"])
def test_wraps_any_routing_policy(inner: str) -> None:
    d = cluster({"routing": inner}, held={"p1": ["a"], "d2": ["a"]})
    a = d.route(req(), 0.0)
    assert (a.prefill, a.decode) == ("p1", "d2")
    assert d.routing.needs_progress == d.routing.inner.needs_progress  # type: ignore[attr-defined]


def test_params_are_validated_and_a_sim_only_or_self_wrap_is_refused() -> None:
    with pytest.raises(PolicyError, match="epsilon"):
        registry.build(PolicyKind.ROUTING, "lora_affinity", {"epsilon": -1})
    with pytest.raises(PolicyError, match="true output lengths"):
        registry.build(PolicyKind.ROUTING, "lora_affinity", {"routing": "oracle"})
    with pytest.raises(PolicyError, match="itself"):
        registry.build(PolicyKind.ROUTING, "lora_affinity", {"routing": "lora_affinity"})
    with pytest.raises(PolicyError, match="unknown routing policy"):
        registry.build(PolicyKind.ROUTING, "lora_affinity", {"routing": "nope"})
    assert registry.spec(PolicyKind.ROUTING, "lora_affinity").defaults()["routing"] == "least_load"

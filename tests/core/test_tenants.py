"""core/tenants.py on constructed states: keys, the token bucket, per-tenant limits and refunds, fair release."""

from __future__ import annotations

import math
import tomllib

import pytest

from core.admission import AdmissionControl, SloAdmission
from core.dispatch import Dispatcher
from core.errors import ConfigError
from core.perf import get_profile
from core.policies.base import QueueParams
from core.policies.queue import Fcfs, Priority
from core.tenants import DEFAULT_TENANT, FairShare, TenantSpec, TenantTable, TokenBucket, hash_key, tenant_specs
from core.types import Admission, Request, Role

A_KEY, B_KEY = "sk-a-secret", "sk-b-secret"


def table(now: float = 0.0, **specs: dict[str, object]) -> TenantTable:
    return TenantTable({name: TenantSpec.model_validate(s) for name, s in specs.items()}, now)


def req(rid: str, tenant: str, priority: int = 0) -> Request:
    return Request(rid, 0.0, 10, 10, priority=priority, tenant=tenant)


def test_a_key_is_stored_as_its_sha256_and_matched_by_it() -> None:
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    t = table(a={"key_sha256": hash_key(A_KEY)}, b={"key_sha256": [hash_key(B_KEY), hash_key("sk-b-next")]})
    assert t.authenticate(A_KEY.encode()) == "a"
    assert t.authenticate(b"sk-b-next") == "b"  # a second key of b (rotation)
    assert t.authenticate(b"sk-c") is None and t.authenticate(None) is None
    assert t.unauthorized == 2


def test_without_keys_every_request_is_the_default_tenants_and_unlimited() -> None:
    t = TenantTable(None, 0.0)
    assert not t.keyed and t.authenticate(None) == DEFAULT_TENANT
    for k in range(1000):
        assert t.admit(DEFAULT_TENANT, k, 10_000, 10_000, 0.0) is None
    assert t.tenants[DEFAULT_TENANT].in_flight == 1000


def test_the_bucket_holds_a_minute_refills_at_its_rate_and_refunds_never_overfill() -> None:
    b = TokenBucket(600, now=0.0)  # 10 tokens a second, 600 at most
    assert b.take(500, 0.0) == 0.0 and b.level == 100
    assert b.take(200, 0.0) == pytest.approx(10.0)  # 100 short at 10/s; nothing taken
    assert b.level == 100
    assert b.take(200, 10.0) == 0.0 and b.level == pytest.approx(0.0)
    assert math.isinf(b.take(601, 10.0))  # more than a minute's worth: never
    b.refund(10_000, 20.0)
    assert b.level == 600


def test_in_flight_limit_refuses_with_retry_and_frees_on_finish() -> None:
    t = table(a={"key_sha256": hash_key(A_KEY), "max_in_flight": 2}, b={"key_sha256": hash_key(B_KEY)})
    assert t.admit("a", "1", 10, 10, 0.0) is None and t.admit("a", "2", 10, 10, 0.0) is None
    refusal = t.admit("a", "3", 10, 10, 0.0)
    assert refusal is not None and refusal.limit == "requests" and refusal.retry_after_s == 1.0
    assert "max_in_flight = 2" in refusal.message
    assert t.admit("b", "4", 10, 10, 0.0) is None  # another tenant is not affected
    t.finish("1", "met", 10, prefilled=True, now=1.0)
    assert t.admit("a", "5", 10, 10, 1.0) is None
    assert t.tenants["a"].outcomes == {"met": 1, "missed": 0, "failed": 0, "limited": 1}


def test_tokens_are_charged_prompt_plus_max_tokens_and_the_unused_part_refunded() -> None:
    t = table(a={"key_sha256": hash_key(A_KEY), "tokens_per_minute": 1200})  # 20 tokens a second
    assert t.admit("a", "1", 100, 500, 0.0) is None  # 600 charged
    assert t.admit("a", "2", 100, 500, 0.0) is None  # 1200: empty
    refusal = t.admit("a", "3", 100, 500, 0.0)
    assert refusal is not None and refusal.limit == "tokens" and refusal.retry_after_s == pytest.approx(30.0)
    t.finish("1", "met", 50, prefilled=True, now=0.0)  # used 50 of its 500: 450 back
    assert t.tenants["a"].bucket is not None and t.tenants["a"].bucket.level == pytest.approx(450)
    t.finish("2", "failed", 0, prefilled=False, now=0.0)  # never computed: all 600 back
    assert t.tenants["a"].bucket.level == pytest.approx(1050)
    assert t.tenants["a"].prompt_tokens == 100 and t.tenants["a"].output_tokens == 50
    too_big = t.admit("a", "4", 1000, 1000, 0.0)
    assert too_big is not None and too_big.retry_after_s is None and "lower max_tokens" in too_big.message


def test_a_reload_keeps_what_is_in_flight_and_the_buckets_share() -> None:
    t = table(a={"key_sha256": hash_key(A_KEY), "tokens_per_minute": 1000, "max_in_flight": 1})
    assert t.admit("a", "1", 250, 250, 0.0) is None  # half the bucket
    t.replace({"a": TenantSpec(key_sha256=[hash_key("sk-a-new")], tokens_per_minute=2000, max_in_flight=1)}, 0.0)
    assert t.authenticate(A_KEY.encode()) is None and t.authenticate(b"sk-a-new") == "a"
    assert t.tenants["a"].bucket is not None and t.tenants["a"].bucket.level == pytest.approx(1000)
    assert t.admit("a", "2", 1, 1, 0.0) is not None  # still one in flight
    t.replace({"b": TenantSpec(key_sha256=[hash_key(B_KEY)])}, 0.0)
    assert "a" in t.describe(0.0)  # gone from the file, shown while its request is in flight
    t.finish("1", "met", 250, prefilled=True, now=0.0)
    assert list(t.describe(0.0)) == ["b"]


KEYS = f"""
[tenants.a]
key_sha256 = "{hash_key(A_KEY)}"
max_in_flight = 4

[tenants.b]
key_sha256 = "{hash_key(B_KEY)}"
tokens_per_minute = 0
"""


def test_a_bad_file_is_named_with_its_line_and_field_and_what_is_allowed() -> None:
    with pytest.raises(ConfigError) as e:
        tenant_specs(tomllib.loads(KEYS), KEYS, "t.toml")
    assert "t.toml, line 6: tenant 'b': field 'tokens_per_minute'" in str(e.value)
    assert "allowed fields: key_sha256, max_in_flight, tokens_per_minute, priority, weight" in str(e.value)
    plain = KEYS.replace(hash_key(A_KEY), A_KEY).replace("tokens_per_minute = 0", "")
    with pytest.raises(ConfigError, match=r"line 2: tenant 'a': field 'key_sha256': must be the 64 hex digits"):
        tenant_specs(tomllib.loads(plain), plain, "t.toml")
    twice = KEYS.replace(hash_key(B_KEY), hash_key(A_KEY)).replace("tokens_per_minute = 0", "")
    with pytest.raises(ConfigError, match="is also tenant 'a'"):
        tenant_specs(tomllib.loads(twice), twice, "t.toml")
    with pytest.raises(ConfigError, match="field 'max_in_fligth'"):
        tenant_specs({"tenants": {"a": {"key_sha256": hash_key(A_KEY), "max_in_fligth": 1}}}, "", "t.toml")
    with pytest.raises(ConfigError, match="no tenants"):
        tenant_specs({}, "", "t.toml")


def test_fair_share_round_robins_tenants_inside_the_policys_order() -> None:
    items = [req(f"a{k}", "a") for k in range(4)] + [req("b0", "b"), req("b1", "b"), req("c0", "c")]
    assert [r.id for r in FairShare().order(items)] == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    one = [req(f"a{k}", "a") for k in range(3)]
    assert FairShare().order(one) == one  # one tenant: the policy's order
    weighted = FairShare({"a": 2.0}).order(items[:4] + items[4:6])
    assert [r.id for r in weighted] == ["a0", "b0", "a1", "a2", "b1", "a3"]


def test_fair_share_keeps_priority_bands_and_gives_no_credit_for_idle_time() -> None:
    items = [req("hi", "a", priority=-1), req("a1", "a"), req("b1", "b")]
    assert [r.id for r in FairShare().order(items)] == ["hi", "b1", "a1"]  # the band first; a just had its turn
    f = FairShare()
    for k in range(5):
        f.served(req(f"a{k}", "a"))  # a alone for a while
    # b arrives: it does not get five turns in a row for the time it had nothing held
    assert [r.id for r in f.order([req("a5", "a"), req("a6", "a"), req("b0", "b"), req("b1", "b")])] == [
        "b0",
        "a5",
        "b1",
        "a6",
    ]


def test_admission_releases_fairly_when_a_fair_share_is_set() -> None:
    for policy in (Fcfs(QueueParams()), Priority(QueueParams())):
        adm = AdmissionControl()
        adm.fair = FairShare()
        for r in [req(f"a{k}", "a") for k in range(3)] + [req("b0", "b")]:
            adm.admit(policy, r, 0.0, room=0)
        assert adm.head(policy) is not None
        released = adm.release(policy, 1.0, room=4)
        assert [r.id for r in released] == ["a0", "b0", "a1", "a2"]
        assert len(adm) == 0 and len(policy) == 0


def test_slo_admission_releases_held_requests_fairly_between_tenants() -> None:
    d = Dispatcher(get_profile("h20-qwen3-32b"), "round_robin")
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    d.use_slo_admission(SloAdmission(decode_slots=1, extra_wait_s=30.0))
    d.admission.fair = FairShare()
    first = Request("x", 0.0, 256, 200, tenant="a")
    assert d.admit(first, 0.0) == Admission.ROUTE
    d.route(first, 0.0)
    d.on_prefill_end("x", 0.3, 0.3)
    d.on_decode_start("x", 0.3)
    for rid, tenant in [("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")]:
        assert d.admit(Request(rid, 1.0, 256, 200, tenant=tenant), 1.0) == Admission.QUEUED
    order, done = [], "x"
    for k in range(4):
        d.on_finish(done, 2.0 + k, 200, 0.35)
        released = d.release(2.0 + k)
        assert len(released) == 1  # one decode slot
        done = str(released[0].id)
        order.append(done)
        d.route(released[0], 2.0 + k)
        d.on_prefill_end(done, 2.3 + k, 0.3)
        d.on_decode_start(done, 2.3 + k)
    assert order == ["a1", "b1", "a2", "a3"]  # fcfs alone would release b1 last


def test_what_is_ahead_of_a_tenants_next_request_under_a_fair_share() -> None:
    f = FairShare({"b": 2.0})
    assert f.ahead({"a": 10}, "b") == 0.5  # b has twice a's weight: half a turn of a's per turn of b's
    assert f.ahead({"a": 10, "b": 1}, "b") == 1 + 1
    assert f.ahead({"a": 10, "b": 3}, "a") == 10 + 3  # a's 11th waits for all of b's
    assert f.ahead({"a": 1}, "a") == 1


def test_with_a_fair_share_slo_admission_holds_a_quiet_tenants_request_behind_a_flood() -> None:
    def gate(fair: bool) -> tuple[Dispatcher, list[Admission]]:
        d = Dispatcher(get_profile("h20-qwen3-32b"), "round_robin")
        d.add_instance("p0", Role.PREFILL)
        d.add_instance("d0", Role.DECODE)
        d.use_slo_admission(SloAdmission(extra_wait_s=2.0, evidence_hold_s=0.0))  # refuse on the prior at once
        d.admission.fair = FairShare() if fair else None
        out = []
        for k in range(60):  # the flood: routed until the prefill is full, then held up to the bound, then shed
            r = Request(f"a{k}", 0.0, 256, 200, tenant="a")
            out.append(d.admit(r, 0.0))
            if out[-1] == Admission.ROUTE:
                d.route(r, 0.0)
        return d, out

    d, flood = gate(fair=True)
    assert Admission.QUEUED in flood and flood[-1] == Admission.SHED  # a's own arrivals: refused once held is full
    assert d.admit(Request("b0", 0.0, 256, 200, tenant="b"), 0.0) == Admission.QUEUED  # b goes after one of a's
    d, _ = gate(fair=False)
    assert d.admit(Request("b0", 0.0, 256, 200, tenant="b"), 0.0) == Admission.SHED  # in fcfs order: behind all

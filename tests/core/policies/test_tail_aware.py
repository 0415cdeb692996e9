"""The gateway's `tail_aware` queue policy: γ-Boost order, no overtaking after b_max, γ and τ adapted from
completions (spec: shared/design/papers/tail-aware.md §4)."""

from __future__ import annotations

import pytest

from core.policies import build
from core.policies.gamma import boost
from core.policies.tail_aware import TailAwareQueue, TailAwareQueueParams
from core.types import Request

# τ = 1 ms/token, k = 256 → τk = 0.256 s; u_k = 1 → γ = 1/0.256 s⁻¹.
TAU, K = 0.001, 256
GAMMA = 1.0 / (TAU * K)


def _q(**kw: object) -> TailAwareQueue:
    q = build("queue", "tail_aware", {"tau_s": TAU, **kw})
    assert isinstance(q, TailAwareQueue)
    return q


def req(rid: str, arrival: float, prompt: int = 100, slo: str = "default") -> Request:
    return Request(rid, arrival, prompt, 50, slo_class=slo)


def test_gateway_queue_protocol() -> None:
    q = _q()
    for r in (req("a", 0.0, 3000, "x"), req("b", 0.05, 100, "y"), req("c", 0.30, 100, "x")):
        q.push(r, r.arrival)
    assert len(q) == 3 and q.depth_by_class() == {"x": 2, "y": 1}
    # b (boost 0.117 s) overtakes a (boost ≈ 0); c arrived 0.3 s after a: more than b_max later
    assert q.max_boost_s == pytest.approx(boost(TAU * 256, GAMMA))
    assert [r.id for r in q.items()] == ["b", "a", "c"]
    assert q.remove("a") is not None and q.remove("a") is None
    assert len(q) == 2 and q.depth_by_class() == {"x": 1, "y": 1}
    assert q.pop(1.0).id == "b" and q.pop(1.0).id == "c" and q.pop(1.0) is None  # type: ignore[union-attr]
    assert len(q) == 0 and q.depth_by_class() == {} and q.items() == []
    q.push(req("d", 2.0), 2.0)
    q.push(req("d", 2.0), 2.5)  # pushed again: held once
    assert len(q) == 1 and q.pop(3.0).id == "d" and q.pop(3.0) is None  # type: ignore[union-attr]
    with pytest.raises(Exception, match="bad params"):
        build("queue", "tail_aware", {"delta_s": 1})  # an instance-only knob


def test_gateway_queue_starving_request_is_never_overtaken_after_b_max() -> None:
    q = _q()
    q.push(req("long", 0.0, 8000), 0.0)
    for i in range(30):
        q.push(req(f"s{i}", 0.01 * (i + 1), 50), 0.0)
    order = [r.id for r in q.items()]
    b_max = q.max_boost_s
    overtook = {f"s{i}" for i in range(30) if 0.01 * (i + 1) - b_max < q.phi(req("long", 0.0, 8000))}
    assert order.index("long") == len(overtook) and set(order[: len(overtook)]) == overtook
    assert 0 < len(overtook) < 30


def test_gateway_gamma_adapts_from_completions_and_rekeys() -> None:
    q = _q(adapt_gamma=True, u_init=0.01, min_samples=20, update_every=20, update_min_interval_s=0.0)
    q.push(req("early-long", 0.0, 4000), 0.0)
    q.push(req("late-short", 2.0, 50), 0.0)
    assert [r.id for r in q.items()] == ["late-short", "early-long"]  # LAS-like: big boosts
    g0 = q.gamma
    for i in range(20):  # identical latencies: a very light tail → γ up (FCFS-ward)
        q.observe_completion(req(f"done{i}", float(i)), 5.0, 50)
    assert q.gamma > g0
    assert [r.id for r in q.items()] == ["early-long", "late-short"]  # re-keyed with the new γ
    q2 = _q(adapt_gamma=True, min_samples=20, update_every=20, update_min_interval_s=0, window_s=1e4)
    g1 = q2.gamma
    for i in range(20):  # a wide tail → γ down (LAS-ward)
        q2.observe_completion(req(f"done{i}", float(i)), 1.0 + 30.0 * i, 50)
    assert q2.gamma < g1


def test_gateway_measures_tau_from_completions_while_holding() -> None:
    q = build("queue", "tail_aware", {"tau_prior_s": 0.01})
    assert isinstance(q, TailAwareQueue) and q.tau == 0.01
    q.observe_completion(req("x", 0.0), 1.0, 100)  # nothing held: not a saturation sample
    assert q.measured_tau() is None
    q.push(req("held", 0.0), 0.0)
    for i in range(11):  # 150 tokens (100 prompt + 50 out) finishing every 0.1 s → 1,500 tok/s
        q.observe_completion(req(f"d{i}", 0.0, 100), 1.0 + 0.1 * i, 50)
    assert q.measured_tau() == pytest.approx(0.1 / 150)
    assert TailAwareQueueParams().bin_tokens == 256

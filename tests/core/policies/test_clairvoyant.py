"""The clairvoyant reference: it routes by the true remaining work (processor sharing or the iteration model, with
its KV overflow penalty), counts pending requests by their true length, and declares that it needs true lengths."""

from __future__ import annotations

import inspect

import pytest

from core.dispatch import Dispatcher
from core.errors import PolicyError
from core.policies import build
from core.types import Request, Role
from tests.core.policies.routes import route_one
from tests.helpers import add_pending, add_running, cluster, toy_profile

ORACLE_KW = {"true_lengths": True} if "true_lengths" in inspect.signature(Dispatcher.__init__).parameters else {}
"""What a dispatcher needs to be allowed to run an oracle (the simulator says lengths are true)."""


def set_true_length(d: Dispatcher, rid: str, out: int) -> None:
    d.view.table.max_out[d.view.table.row[rid]] = out


def nearly_done_vs_long_running(policy: str, params: dict | None = None) -> Dispatcher:
    """d0: two requests 10 tokens from their end; d1: one request with 9,000 tokens to go.

    The toy profile decodes TPS(N) = 10 tok/s in total, so one token costs N/10 s per request.
    """
    d = cluster(policy, params, decode=2, **ORACLE_KW)
    d.view.decode_rate.value = 10.0
    for k in range(2):
        add_running(d, f"short{k}", "d0", prompt=10, generated=990, rate=5, now=0)
        set_true_length(d, f"short{k}", 1000)
    add_running(d, "long", "d1", prompt=10, generated=1000, rate=10, now=0)
    set_true_length(d, "long", 10_000)
    return d


@pytest.mark.parametrize("objective", ["sum", "self"])
def test_clairvoyant_picks_where_true_remaining_work_makes_the_request_fastest(
    objective: str,
) -> None:
    assert route_one(nearly_done_vs_long_running("least_load")) == "d1"  # fewest running now
    d = nearly_done_vs_long_running("clairvoyant", {"objective": objective})
    # A 1,000-token request shares d0 for ~10 tokens then decodes alone (≈ 0.1 s/token); on d1 it
    # shares with the long request all its life (0.2 s/token).
    costs = d.routing.costs(Request("x", 0.0, 10, 1000), 0.0, d.view)
    if objective == "self":
        assert costs[d.index_of("d1")] == pytest.approx(0.2)
        assert costs[d.index_of("d0")] == pytest.approx((10 * 0.3 + 990 * 0.1) / 1000)
    assert costs[d.index_of("d0")] < costs[d.index_of("d1")]
    assert route_one(d, out=1000) == "d0"


def test_clairvoyant_counts_pending_requests_by_their_true_length() -> None:
    """d0 is empty but two long requests bound to it start decoding at once."""
    d = cluster("clairvoyant", decode=2, **ORACLE_KW)
    d.view.decode_rate.value = 10.0
    for k in range(2):
        add_pending(d, f"p{k}", "d0", prompt=10, handoff=0.5)
        set_true_length(d, f"p{k}", 5000)
    add_running(d, "r", "d1", prompt=10, generated=0, rate=10, now=0)
    set_true_length(d, "r", 5000)
    assert route_one(d, out=1000) == "d1"


def test_clairvoyant_iteration_model_avoids_kv_overflow() -> None:
    prof = toy_profile(
        tps_curve=None,
        decode_step_per_seq_s=0.01,
        decode_step_per_kv_token_s=1e-5,
        kv_capacity_tokens=3000,
    )
    d = Dispatcher(prof, "clairvoyant", {"model": "iteration"}, **ORACLE_KW)
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    d.add_instance("d1", Role.DECODE)
    d.view.decode_rate.value = 10.0
    # d0: one request that will hold 2,500 KV tokens; d1: two short ones, 400 tokens together.
    add_running(d, "big", "d0", prompt=500, generated=0, rate=10, now=0)
    set_true_length(d, "big", 2000)
    for k in range(2):
        add_running(d, f"s{k}", "d1", prompt=100, generated=0, rate=10, now=0)
        set_true_length(d, f"s{k}", 100)
    costs = d.routing.costs(Request("x", 0.0, 500, 1000), 0.0, d.view)
    assert costs[d.index_of("d0")] > 1.0  # the KV overflow penalty
    assert route_one(d, prompt=500, out=1000) == "d1"


def test_clairvoyant_declares_it_needs_true_lengths() -> None:
    policy = build("routing", "clairvoyant")
    assert type(policy).needs_true_lengths is True
    assert getattr(build("routing", "sibyl"), "needs_true_lengths", False) is False
    if "true_lengths" not in inspect.signature(Dispatcher.__init__).parameters:
        pytest.skip("Dispatcher has no true_lengths flag yet (the refusal lives there)")
    with pytest.raises(PolicyError, match="simulator"):
        Dispatcher(toy_profile(), "clairvoyant", None, true_lengths=False)
    Dispatcher(toy_profile(), "clairvoyant", None, true_lengths=True)

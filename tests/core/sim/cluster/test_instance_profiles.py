"""Per-instance profiles in the cluster simulator: an instance runs, and is projected, on its own profile;
without one (or with the cluster's own profile for every instance) a run is what it was."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from core.dispatch import Dispatcher
from core.perf import PerfProfile, get_profile
from core.prefill import StepTerms
from core.sim.cluster import ClusterSimResult, ClusterSimulation, Mode
from core.traces import synthetic_trace
from tests.helpers import toy_profile

# prefill 0.5 s + 0.01 s a token: a 50-token prompt takes 1.0 s; SLOW takes twice as long on every prefill term
FAST = toy_profile(prefill_base_s=0.5, prefill_per_token_s=0.01)
SLOW = FAST.model_copy(update={"name": "slow", "prefill_base_s": 1.0, "prefill_per_token_s": 0.02})
FIELDS = ("prefill_instance", "decode_instance", "prefill_start", "prefill_end", "decode_start", "first_token")


def run(
    profile: PerfProfile,
    arrivals: list[float] | np.ndarray,
    prompts: list[int] | np.ndarray,
    outputs: list[int] | np.ndarray,
    *,
    mode: Mode = "ps",
    policy: str = "round_robin",
    n_prefill: int = 2,
    n_decode: int = 1,
    own: dict[str, PerfProfile] | None = None,
    prefix_keys: list[tuple[int, ...]] | None = None,
    down: tuple[str, ...] = (),
) -> tuple[ClusterSimResult, Dispatcher]:
    d = Dispatcher(profile, policy, survival_prior_max=int(np.max(outputs)))
    sim = ClusterSimulation(
        arrivals=np.asarray(arrivals, dtype=float),
        prompt_tokens=np.asarray(prompts),
        output_tokens=np.asarray(outputs),
        profile=profile,
        n_prefill=n_prefill,
        n_decode=n_decode,
        dispatcher=d,
        mode=mode,
        instance_profiles=own,
        prefix_keys=prefix_keys,
    )
    for iid in down:
        d.set_health(iid, False)
    return sim.run(), d


@pytest.mark.parametrize("mode", ["ps", "iteration"])
@pytest.mark.parametrize("policy", ["sibyl", "least_load", "prefix_aware", "round_robin"])
def test_the_clusters_profile_given_for_every_instance_changes_nothing(mode: Mode, policy: str) -> None:
    """Each instance given an equal copy of the cluster's profile: every request's timeline and placement
    is the run's without the mapping, to the last bit (prefix keys, a small cache and wake-ups included)."""
    prof = get_profile("roofline-h100-qwen2.5-7b")
    prof = prof.model_copy(update={"kv_capacity_tokens": 16 * 600, "idle_wake_s": 0.02})
    trace = synthetic_trace("reasoning-chat", requests=400, rate=12, seed=3)
    n = len(trace.arrivals)
    groups = np.random.default_rng(7).integers(6, size=n)
    keys = [tuple(10_000 * (int(g) + 1) + b for b in range(48)) + (10_000_000 + i,) for i, g in enumerate(groups)]
    prompts, outputs = np.full(n, 16 * 49), np.minimum(trace.output_tokens, 400)
    ids = ["p0", "p1", "p2", "d0", "d1", "d2"]
    kw: dict[str, Any] = {"mode": mode, "policy": policy, "n_prefill": 3, "n_decode": 3, "prefix_keys": keys}
    plain, _ = run(prof, trace.arrivals, prompts, outputs, **kw)
    mapped, d = run(prof, trace.arrivals, prompts, outputs, own={i: prof.model_copy() for i in ids}, **kw)
    assert plain.ok.sum() > 0.9 * n and plain.hit_rate > 0.3
    for f in (*FIELDS, "finish"):
        assert np.array_equal(getattr(plain, f), getattr(mapped, f), equal_nan=True), f
    assert (plain.events, plain.preemptions) == (mapped.events, mapped.preemptions)
    assert not d.view.queues.own.own  # an equal profile keeps the shared terms, as an uncalibrated instance live


@pytest.mark.parametrize("mode", ["ps", "iteration"])
def test_a_lone_request_on_the_slow_prefill_instance_takes_its_profiles_prefill_time(mode: Mode) -> None:
    """2P1D, p0 on SLOW and p1 down: the lone 50-token prompt goes to p0, whose prefill takes SLOW's
    1.0 + 0.02·50 = 2.0 s (ps: exactly prefill_time; iteration: plus the step it runs in, step(1) = 0.1 s),
    twice FAST's 1.0 s; the dispatcher projects p0 with SLOW's terms, p1 with the shared ones (FAST's, with the
    prefill estimator's coefficients: it learns from every instance's lone prefills, as live)."""
    step = 0.1 if mode == "iteration" else 0.0
    slow, d = run(FAST, [0.0], [50], [3], mode=mode, own={"p0": SLOW}, down=("p1",))
    assert slow.prefill_instance.tolist() == [0]
    assert slow.prefill_start.tolist() == [0.0] and slow.prefill_end == pytest.approx([2.0 + step], abs=1e-12)
    assert d.view.queues.terms_of(0) == StepTerms.of(SLOW, serial=mode == "ps")
    assert list(d.view.queues.own.own) == [0]
    fast, _ = run(FAST, [0.0], [50], [3], mode=mode, down=("p1",))
    assert fast.prefill_instance.tolist() == [0] and fast.prefill_end == pytest.approx([1.0 + step], abs=1e-12)
    # the decode side runs FAST's terms in both runs: the first token comes the same time after the prefill
    assert slow.first_token[0] - slow.prefill_end[0] == pytest.approx(fast.first_token[0] - fast.prefill_end[0])


def test_the_dispatchers_projection_sees_the_slow_instance() -> None:
    d = Dispatcher(FAST, "least_load")
    sim = ClusterSimulation(
        arrivals=np.zeros(1), prompt_tokens=np.array([50]), output_tokens=np.array([3]), profile=FAST,
        n_prefill=2, n_decode=1, dispatcher=d, mode="ps", instance_profiles={"p0": SLOW},
    )  # fmt: skip
    assert [type(p).__name__ for p in sim.profiles.at] == ["PerfProfile"] * 3
    assert sim.profiles.at[0] is SLOW and sim.profiles.at[1] is FAST and sim.profiles.at[2] is FAST
    d.view.now = 0.0
    assert d.view.first_token_at(50)[:2] == pytest.approx([2.0, 1.0])  # idle: each one's prefill_time(50)


@pytest.mark.parametrize("mode", ["ps", "iteration"])
@pytest.mark.parametrize("policy", ["least_load", "sibyl", "prefix_aware", "round_robin"])
def test_a_policy_projecting_the_first_token_prefers_the_fast_instance_at_equal_queues(mode: Mode, policy: str) -> None:
    """Both prefill instances idle, one on SLOW: a policy that routes the prefill by the projected first token
    (`least_queued_prefill`: these four; prefix_aware adds the cached tokens, none here) sends the prompt to
    the other one, which finishes it in FAST's 1.0 s, not SLOW's 2.0 s, whichever of the two is slow (so
    not by how the policy breaks a tie)."""
    step = 0.1 if mode == "iteration" else 0.0
    for slow, fast in ((0, 1), (1, 0)):
        r, _ = run(FAST, [0.0], [50], [3], mode=mode, policy=policy, own={f"p{slow}": SLOW})
        assert r.prefill_instance.tolist() == [fast] and r.prefill_end == pytest.approx([1.0 + step], abs=1e-12)


def test_a_decode_instance_runs_on_its_own_profile_and_pulls_kv_with_it() -> None:
    """1P2D in ps mode, d1 decoding at 5 tok/s instead of 10 and pulling KV in 0.5 s instead of 0: round
    robin puts A on d0 and B on d1. A: prefill [0, 1], KV at once, first token 1.1, 4 tokens by 1.4. B:
    prefill [1, 2], KV pulled [2, 2.5], first token 2.5 + 1/5 = 2.7, last 2.5 + 4/5 = 3.3."""
    slow_decode = FAST.model_copy(
        update={"tps_curve": FAST.tps_curve.model_copy(update={"c": 5.0}), "kv_transfer_base_s": 0.5}  # type: ignore[union-attr]
    )
    r, _ = run(FAST, [0.0, 0.0], [50, 50], [4, 4], n_prefill=1, n_decode=2, own={"d1": slow_decode})
    assert r.decode_instance.tolist() == [0, 1]
    assert r.decode_start == pytest.approx([1.0, 2.5])
    assert r.first_token == pytest.approx([1.1, 2.7])
    assert r.finish == pytest.approx([1.4, 3.3])


def test_a_profile_with_another_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="block size 32"):
        run(FAST, [0.0], [50], [3], own={"p1": FAST.model_copy(update={"block_size": 32})})

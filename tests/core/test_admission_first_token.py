"""Admission's first-token projection one instance at a time (small pools) equals the one in arrays
(large pools), on constructed states: queued steps, engine-reported waiting, joiners, drifts,
an instance with its own step terms, per-instance uncached prompts. And what an engine's report of
waiting prompts adds to it as the report ages."""

from __future__ import annotations

import numpy as np
import pytest

from core.admission import SloAdmission
from core.admission_signals import StepJoiners
from core.dispatch import Dispatcher
from core.perf import get_profile
from core.step_terms import StepTerms
from core.types import InstanceState, Request, Role
from tests.helpers import toy_profile

PROFILE = get_profile("h20-qwen3-32b")
N = StepJoiners.SMALL_POOL + 3


def busy_cluster(seed: int) -> Dispatcher:
    """N prefill instances with prompts routed over the last half second (some steps not started yet),
    measured drifts on a few, one instance projected with its own terms, one not routable."""
    rng = np.random.default_rng(seed)
    d = Dispatcher(PROFILE, "round_robin")
    for k in range(N):
        d.add_instance(f"p{k}", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    gate = d.use_slo_admission(SloAdmission())
    for k, t in enumerate(np.sort(rng.uniform(0.0, 0.5, 40))):
        d.route(Request(k, float(t), int(rng.integers(20, 3000)), 50), float(t))
    for p in (1, 4, 7):  # own-service samples, some spread enough to identify a line
        for x in rng.uniform(0.05, 0.6, 10):
            gate.observe_ttft(p, float(x), float(1.1 * x + 0.01))
    for p in (2, 4, 9):  # the queue's part: projected 0.3 s of which 0.1 s own service
        for m in rng.uniform(0.3, 0.6, 6):
            gate.observe_ttft(p, 0.3, float(m), own_s=0.1)
    d.view.queues.set_terms(3, StepTerms.of(toy_profile(prefill_per_token_s=2e-4, max_num_batched_tokens=1024)))
    return d


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("waiting", [False, True])
@pytest.mark.parametrize("per_instance", [False, True])
def test_one_instance_at_a_time_projects_what_the_arrays_do(seed: int, waiting: bool, per_instance: bool) -> None:
    d = busy_cluster(seed)
    gate, v = d.gate, d.view
    assert gate is not None
    if waiting:
        d.observe_instance(InstanceState("p0", Role.PREFILL, waiting=30, observed_at=0.2))  # 0.3 s old at 0.5
        d.observe_instance(InstanceState("p5", Role.PREFILL, waiting=30))  # when unknown: as of now
    d.set_health("p6", False)
    now = 0.5
    v.now = now
    mask = v.prefill_mask()
    rng = np.random.default_rng(seed + 100)
    tokens: float | np.ndarray = rng.uniform(1.0, 2500.0, v.n_instances) if per_instance else 700.0
    arrays = gate.first_token_array(v, mask, tokens, now)
    assert len(arrays) == N - 1  # p6 is not routable
    one = [
        gate.first_token_one(v, p, float(tokens[p]) if isinstance(tokens, np.ndarray) else tokens, now, waiting)
        for p in np.flatnonzero(mask).tolist()
    ]
    assert one == pytest.approx(arrays, rel=1e-9, abs=1e-12)
    queued = v.prefill_free_at[mask] > now
    assert queued.sum() >= 3 and len(set(np.round(arrays, 6))) >= N - 2  # a varied state, not a trivial one


def test_a_small_pool_is_projected_one_instance_at_a_time_and_a_large_one_in_arrays() -> None:
    d = busy_cluster(4)
    gate, v = d.gate, d.view
    assert gate is not None
    r = Request("x", 0.5, 900, 50)
    v.now = 0.5
    assert gate.first_token_s(r, v, 0.5) == pytest.approx(gate.first_token_array(v, v.prefill_mask(), 900.0, 0.5))
    for k in range(N - StepJoiners.SMALL_POOL):  # down to SMALL_POOL routable instances
        d.set_health(f"p{k}", False)
    mask = v.prefill_mask()
    assert mask.sum() == StepJoiners.SMALL_POOL
    assert gate.first_token_s(r, v, 0.5) == pytest.approx(gate.first_token_array(v, mask, 900.0, 0.5))


def test_an_engines_report_of_waiting_prompts_counts_less_as_it_ages() -> None:
    """An idle 1P1D whose engine reported one typical prompt waiting at t = 10: a 900-token prompt
    at 10 s is projected behind it, 0.1 s later by 0.1 s less, and once that prompt would have
    drained (as of its report) exactly as with no report. The dashboard's backlog ages alike."""
    d = Dispatcher(PROFILE, "round_robin")
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    gate = d.use_slo_admission(SloAdmission())
    v = d.view
    terms = v.queues.terms
    ahead = terms.backlog_s(1.0, gate.typical_prompt)
    assert ahead > 0.2
    r = Request("x", 10.0, 900, 50)
    clean = {t: float(gate.first_token_s(r, v, t)[0]) for t in (10.0, 10.1, 12.0)}
    d.observe_instance(InstanceState("p0", Role.PREFILL, waiting=1, observed_at=10.0))
    behind = terms.backlog_s(1.0, gate.typical_prompt, 900.0)
    assert behind > clean[10.0] + 0.2  # the report matters when fresh
    assert float(gate.first_token_s(r, v, 10.0)[0]) == pytest.approx(behind)
    assert float(gate.first_token_s(r, v, 10.1)[0]) == pytest.approx(behind - 0.1)
    assert float(gate.first_token_s(r, v, 12.0)[0]) == pytest.approx(clean[12.0])
    assert gate.backlogs(v, 10.0)[0] == pytest.approx(ahead)
    assert gate.backlogs(v, 10.1)[0] == pytest.approx(ahead - 0.1)
    assert gate.backlogs(v, 12.0)[0] == 0.0
    d.observe_instance(InstanceState("p0", Role.PREFILL, waiting=1))  # no time: taken as reported now
    assert float(gate.first_token_s(r, v, 12.0)[0]) == pytest.approx(behind)
    assert gate.backlogs(v, 12.0)[0] == pytest.approx(ahead)

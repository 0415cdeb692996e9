"""The simulator's prefill instances step as core/prefill.py projects: hand computations, `project` and the
dispatcher's own projection (`PrefillQueues`), in iteration mode (vLLM's chunked steps) and ps mode (serial)."""

from __future__ import annotations

import numpy as np
import pytest

from core.dispatch import Dispatcher
from core.prefill import PrefillQueues, StepTerms, project
from core.sim.cluster import ClusterSimulation
from core.sim.cluster.prefill import SimPrefill, step_terms
from tests.helpers import toy_profile

# base 1 s a step carrying prefill, 0.001 s per token, steps of 0.1 s, 2048 tokens a step
PROFILE = toy_profile(prefill_per_token_s=0.001, max_num_batched_tokens=2048, max_model_len=4096)


def run_instance(prefill: SimPrefill, keys: list[int], start: float = 0.0) -> dict[int, float]:
    """Queue `keys` on an idle instance at `start` (their intakes then) and step it dry: each prompt's prefill end."""
    for k in keys:
        prefill.stepper.waiting.append(k)
        prefill.arrive(start)
    ends: dict[int, float] = {}
    now = start
    while prefill.stepper:
        now = max(now, prefill.host_free)
        started = prefill.start(now)
        assert started is not None
        now = started[0]
        for k in prefill.end(now):
            ends[k] = now
    return ends


def test_iteration_steps_chunk_prompts_across_steps_as_project_does() -> None:
    """Three 1500-token prompts under a 2048-token budget: step 1 computes the first and 548 tokens of
    the second (0.1 + 1 + 2.048 s), step 2 the second's 952 left and 1096 of the third (another
    3.148 s), step 3 the third's 404 left (0.1 + 1 + 0.404 s)."""
    terms = step_terms(PROFILE, "iteration")
    prompts = [1500, 1500, 1500]
    ends = run_instance(SimPrefill(0, terms, prompts, None), [0, 1, 2])
    expected = [3.148, 6.296, 7.8]
    assert [ends[k] for k in range(3)] == pytest.approx(expected)
    assert project(prompts, terms).first_token.tolist() == pytest.approx(expected)


def test_iteration_steps_respect_the_running_slots_and_each_prompts_intake() -> None:
    """max_num_seqs 2, 0.5 s of host work per prompt's intake. 100 and 200 reach the idle instance at
    0: their step starts after both intakes, at 1 s (0.1 + 1 + 0.3 s, ending 2.4). 300 and 400 come at
    1.5 s, during it: their intakes follow it, so their step runs [3.4, 5.2] (0.1 + 1 + 0.7 s). The
    dispatcher's projection, routing them at those times, says the same."""
    prof = PROFILE.model_copy(update={"max_num_seqs": 2, "prefill_host_per_request_s": 0.5})
    terms = step_terms(prof, "iteration")
    prompts = [100, 200, 300, 400]
    pf = SimPrefill(0, terms, prompts, None)
    for k in (0, 1):
        pf.stepper.waiting.append(k)
        pf.arrive(0.0)
    assert pf.host_free == pytest.approx(1.0)
    started = pf.start(1.0)
    assert started is not None and started[0] == pytest.approx(2.4) and started[1] == [0, 1]
    for k in (2, 3):
        pf.stepper.waiting.append(k)
        pf.arrive(1.5)
    assert pf.end(2.4) == [0, 1] and pf.host_free == pytest.approx(3.4)
    started = pf.start(3.4)
    assert started is not None and started[0] == pytest.approx(5.2)
    assert pf.end(5.2) == [2, 3]
    q = PrefillQueues(prof)
    q.add_instance()
    for k, at in enumerate([0.0, 0.0, 1.5, 1.5]):
        q.push(0, k, prompts[k], at)
    assert [q.due(k) for k in range(4)] == pytest.approx([2.4, 2.4, 5.2, 5.2])
    # `project` takes the prompts as waiting, their intake done: the steps follow each other
    assert project(prompts, terms).first_token.tolist() == pytest.approx([1.4, 1.4, 3.2, 3.2])


def test_ps_mode_is_serial_prefill_time_and_projected_so() -> None:
    """ps mode (SIBYL App. I): one prompt at a time for exactly prefill_time(l), after the intakes
    (0.25 s each) of the three reaching the idle instance together; `project` with the serial terms
    (ready after those intakes) and the dispatcher's serial projection give the same ends."""
    prof = PROFILE.model_copy(update={"prefill_host_per_request_s": 0.25})
    terms = step_terms(prof, "ps")
    assert terms == StepTerms.of(prof, serial=True)
    prompts = [3000, 200, 100]  # 3000 > the 2048 budget: serial prefill never chunks
    ends = run_instance(SimPrefill(0, terms, prompts, None), [0, 1, 2])
    t = [float(prof.prefill_time(n)) for n in prompts]
    expected = [0.75 + t[0], 0.75 + t[0] + t[1], 0.75 + t[0] + t[1] + t[2]]
    assert [ends[k] for k in range(3)] == pytest.approx(expected)
    assert project(prompts, terms, ready_at=0.75).first_token.tolist() == pytest.approx(expected)
    q = PrefillQueues(prof)
    q.serial = True
    q.add_instance()
    for k, n in enumerate(prompts):
        q.push(0, k, n, 0.0)
    assert [q.due(k) for k in range(3)] == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["ps", "iteration"])
def test_the_dispatcher_projects_what_the_simulated_instance_does(mode: str) -> None:
    """One prefill instance; a prompt at 0, four more during its step. The simulated prefill ends
    equal the dispatcher's projection made at routing (PrefillQueues, serial in ps mode), and
    the hand computation: ps, each for 1 + 0.001·l after the one before; iteration, 700 alone
    (1.8 s), then 1500+548 of 1500 (3.148 s), then the 952 left, 400 and 696 of 900 (3.148 s),
    then the 204 left of 900 (1.304 s)."""
    prompts = [700, 1500, 1500, 400, 900]
    arrivals = [0.0, 0.1, 0.1, 0.2, 0.3]
    d = Dispatcher(PROFILE, "round_robin")
    sim = ClusterSimulation(
        arrivals=np.array(arrivals),
        prompt_tokens=np.array(prompts),
        output_tokens=np.ones(5, dtype=int),
        profile=PROFILE,
        n_prefill=1,
        n_decode=1,
        dispatcher=d,
        mode=mode,  # type: ignore[arg-type]
    )
    assert d.view.queues.serial == (mode == "ps")
    r = sim.run()
    q = PrefillQueues(PROFILE)
    q.serial = mode == "ps"
    q.add_instance()
    for k, (n, a) in enumerate(zip(prompts, arrivals, strict=True)):
        q.push(0, k, n, a)
    projected = [q.due(k) for k in range(5)]  # later prompts joining a step move its end
    assert r.prefill_end.tolist() == pytest.approx(projected)
    serial = np.cumsum([1 + 0.001 * n for n in prompts]).tolist()
    expected = serial if mode == "ps" else [1.8, 4.948, 8.096, 8.096, 9.4]
    assert r.prefill_end.tolist() == pytest.approx(expected)

"""The batching-aware prefill projection: hand computations, the incremental per-instance form, and
the emulator's own step log."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest

from adapters.emulator.engine import Engine, Sequence
from adapters.emulator.faults import Faults
from core.estimators import PrefillTimeEstimator
from core.prefill import PrefillQueues, StepTerms, project
from tests.core.prefill_profile import profile, step

TERMS = StepTerms.of(profile())


def test_four_prompts_of_512_under_a_2048_budget_come_out_together_in_one_step_paying_its_base_once() -> None:
    r = project([512] * 4, TERMS)
    assert r.steps == 1
    assert r.first_token == pytest.approx([step(4, 2048)] * 4)  # 0.03548 s, not 4 × 0.02212
    assert r.drain == pytest.approx(step(4, 2048))


def test_three_prompts_of_1500_chunk_across_three_steps() -> None:
    # step 1: 1500 of A + 548 of B; step 2: 952 of B + 1096 of C; step 3: 404 of C
    r = project([1500] * 3, TERMS)
    s1, s2, s3 = step(2, 2048), step(2, 2048), step(1, 404)
    assert r.steps == 3
    assert r.first_token == pytest.approx([s1, s1 + s2, s1 + s2 + s3])


def test_max_num_seqs_caps_a_step_and_the_quadratic_term_is_paid_per_chunk() -> None:
    t = StepTerms.of(profile(max_num_seqs=2))
    r = project([100] * 3, t)
    assert r.first_token == pytest.approx([step(2, 200)] * 2 + [step(2, 200) + step(1, 100)])
    quad = StepTerms.of(profile(prefill_per_token2_s=1e-8))
    # a 3000-token prompt chunked 0..2048, 2048..3000: c·(2048² − 0) then c·(3000² − 2048²), i.e. c·3000² in all
    r = project([3000], quad)
    by_hand = step(1, 2048) + step(1, 952) + 1e-8 * 3000**2
    assert r.first_token[0] == pytest.approx(by_hand)
    assert quad.alone_s(3000) == pytest.approx(by_hand)


def test_queued_prompts_intake_is_done_so_steps_follow_each_other_and_running_sequences_go_first() -> None:
    """`project`'s queued prompts wait in the engine: their intake (host work) is behind them, so the
    steps follow each other; what is still under way is the caller's `ready_at`."""
    t = StepTerms.of(profile(prefill_host_per_request_s=0.002, max_num_seqs=2))
    r = project([100] * 3, t, ready_at=0.004)
    assert r.first_token[2] == pytest.approx(0.004 + step(2, 200) + step(1, 100))
    assert r.drain == pytest.approx(r.first_token[2])
    # a running prompt with 2000 tokens left and one decoding sequence take 2001 tokens of the budget first
    r = project([100], TERMS, decoding=1, partial_done=500, partial_left=2000)
    first = 0.010 + 0.001 * 3 + 0.005 + 0.00001 * (2000 + 47)  # 1 decode + 2000 of the partial + 47 of the new
    assert r.partial_first_token == pytest.approx(first)
    assert r.first_token[0] == pytest.approx(first + 0.010 + 0.001 * 2 + 0.005 + 0.00001 * 53)


def test_each_routed_prompts_intake_delays_the_steps_after_the_one_under_way() -> None:
    """Host work h = 2 ms per prompt's intake. A and B routed to an idle instance at 0: the first step
    (A, joined by B) starts after both intakes, at 2h. C routed at 10 ms, while that step runs: its
    step starts h after it ends. D routed at 11 ms, still during it: h more, and D joins C's step,
    which has not started. A query at 11 ms for one more prompt sees its own intake too."""
    h = 0.002
    t = StepTerms.of(profile(prefill_host_per_request_s=h, max_num_seqs=4))
    q = PrefillQueues(profile(prefill_host_per_request_s=h, max_num_seqs=4))
    q.add_instance()
    q.push(0, "A", 100, 0.0)
    q.push(0, "B", 100, 0.0)
    first = 2 * h + step(2, 200)
    assert q.due("A") == pytest.approx(first) and q.due("B") == pytest.approx(first)
    assert first > 0.011
    q.push(0, "C", 100, 0.010)
    assert q.due("C") == pytest.approx(first + h + step(1, 100))
    q.push(0, "D", 100, 0.011)
    second = first + 2 * h + step(2, 200)
    assert q.due("C") == pytest.approx(second) and q.due("D") == pytest.approx(second)
    assert q.free_at[0] == pytest.approx(second)
    # one more at 11 ms would join C and D's step, after its own intake as well
    assert q.first_token_at_one(0, 100, 0.011) == pytest.approx(second + h + step(3, 300) - step(2, 200))
    assert t.alone_s(100) == pytest.approx(h + step(1, 100))  # an idle instance: the intake, then the step
    # measured: A and B's step ended 1 ms late; C and D's step moves with it
    q.end("A", first + 0.001)
    assert q.due("C") == pytest.approx(second + 0.001)


def test_unchunked_a_prompt_waits_for_a_step_with_room_for_all_of_it() -> None:
    t = StepTerms.of(profile(), chunked=False)
    r = project([1500, 1000], t)
    assert r.first_token == pytest.approx([step(1, 1500), step(1, 1500) + step(1, 1000)])


def test_the_closed_forms_agree_with_the_simulation_when_prompts_fit_a_step() -> None:
    assert TERMS.backlog_s(3, 512, 512) == pytest.approx(project([512] * 4, TERMS).first_token[-1])
    assert TERMS.backlog_s(7, 512, 512) == pytest.approx(project([512] * 8, TERMS).first_token[-1])
    assert TERMS.alone_s(700) == pytest.approx(project([700], TERMS).first_token[0])
    assert TERMS.backlog_s(0, 256) == 0.0


def queues(**kw: Any) -> PrefillQueues:
    q = PrefillQueues(profile(**kw))
    q.add_instance()
    q.add_instance()
    return q


def test_a_prompt_routed_to_a_busy_instance_joins_the_step_that_has_not_started() -> None:
    q = queues()
    a = q.push(0, "a", 512, 0.0)  # starts at once, alone
    assert a == pytest.approx(step(1, 512)) and q.ran_alone("a")
    b = q.push(0, "b", 512, 0.0)  # the next step, after a's
    assert q.first_token_at_one(0, 512, 0.001) == pytest.approx(b + 0.001 + 0.00001 * 512)  # joins b's step
    c = q.push(0, "c", 512, 0.001)
    assert c == pytest.approx(a + step(2, 1024)) and q.due("b") == pytest.approx(c)
    assert q.free_at[0] == pytest.approx(c)
    # vectorised over instances: idle p1 starts a new step now
    both = q.first_token_at(512, 0.001)
    assert both[0] == pytest.approx(q.first_token_at_one(0, 512, 0.001))
    assert both[1] == pytest.approx(0.001 + step(1, 512))
    assert np.allclose(q.first_token_at(np.array([512.0, 100.0]), 0.001), [both[0], 0.001 + step(1, 100)])


def test_the_step_a_prompt_would_start_in_is_the_unstarted_tail_it_joins_else_one_after_the_instance_is_free() -> None:
    """Where later prompts could still join a prompt's step: on an idle instance its step starts now;
    behind a started step, when the instance is free; into a tail that has not started, at its start;
    behind a tail with no room left, after it."""
    q = queues()
    q.push(0, "a", 512, 0.0)  # a's step starts at once
    a_end = step(1, 512)
    assert q.step_starts(512, 0.001) == pytest.approx([a_end, 0.001])  # behind a's running step; p1 idle
    assert q.first_step_start("a") == pytest.approx(0.0)
    q.push(0, "b", 512, 0.001)  # b's step starts when a's ends
    assert q.first_step_start("b") == pytest.approx(a_end)
    assert q.step_starts(np.array([512.0, 100.0]), 0.002) == pytest.approx([a_end, 0.002])  # joins b's step
    assert [q.step_start_one(0, 512, 0.002), q.step_start_one(1, 100, 0.002)] == pytest.approx([a_end, 0.002])
    q.push(0, "c", 1536, 0.002)  # b's step is full: 2048 tokens
    assert q.first_step_start("c") == pytest.approx(a_end)
    assert q.step_starts(1, 0.003)[0] == pytest.approx(q.free_at[0])  # no room: after b and c's step
    for now in (0.0005, 0.003):  # one instance at a time, in floats: the same
        assert [q.step_start_one(p, 1, now) for p in (0, 1)] == pytest.approx(q.step_starts(1, now))
    q.end("a", a_end)
    assert q.first_step_start("b") == pytest.approx(a_end)
    q.end("b", 0.2)
    with pytest.raises(KeyError):
        q.first_step_start("b")


def test_a_measured_end_settles_its_step_and_moves_the_rest_by_its_lateness_once() -> None:
    q = queues()
    a = q.push(0, "a", 512, 0.0)
    q.push(0, "b", 512, 0.0)
    q.push(0, "c", 512, 0.0)  # b and c share the second step
    due = q.due("c")
    q.end("a", a + 0.1)  # 100 ms late: the second step starts 100 ms later
    assert q.due("c") == pytest.approx(due + 0.1)
    q.end("b", due + 0.1)
    q.end("c", due + 0.15)  # its step was settled by b's end: nothing moves again
    assert q.free_at[0] == pytest.approx(due + 0.1) and q.queued(0) == 0
    assert q.first_token_at_one(0, 512, due + 0.2) == pytest.approx(due + 0.2 + step(1, 512))


def test_a_prompt_that_leaves_is_taken_out_of_the_steps_not_started() -> None:
    q = queues()
    q.push(0, "a", 512, 0.0)
    q.push(0, "b", 1500, 0.0)
    q.push(0, "c", 1500, 0.0)  # second step: b + 548 of c; third: 952 of c
    q.leave("b", 0.001)
    a_end = step(1, 512)
    assert q.due("c") == pytest.approx(a_end + step(1, 1500))
    assert q.queued_tokens(0) == 512 + 1500 and not q.ran_alone("c")
    q.leave("a", 0.001)  # its step has started, but held it alone: aborted, it frees the engine
    assert q.due("c") == pytest.approx(0.001 + step(1, 1500)) and q.queued_tokens(0) == 1500


def test_a_started_step_shared_with_others_stays_when_one_of_its_prompts_leaves() -> None:
    q = queues()
    q.push(0, "a", 512, 0.0)
    q.push(0, "b", 512, 0.0)
    q.push(0, "c", 512, 0.0)  # b and c share the second step, which starts when a's ends
    due = q.due("c")
    q.leave("b", due - 0.001)  # the second step is under way: the engine spends it anyway
    assert q.due("c") == pytest.approx(due) and q.queued(0) == 2


def test_drift_free_projection_of_a_burst_matches_the_emulators_step_log() -> None:
    """The emulated engine takes a burst of prefill-only prompts at once; each first token comes
    out when the projection says, counted from the engine's first step."""
    prof = profile(
        prefill_per_token2_s=2e-9, prefill_host_per_request_s=0.001, max_num_seqs=6, max_num_batched_tokens=1024
    )
    prompts = [300, 700, 90, 1500, 40, 40, 40, 40, 600]

    async def main() -> tuple[list[float], float, int]:
        engine = Engine(prof, Faults(), enable_prefix_caching=False)
        seqs = [Sequence(f"s{k}", n, 1, prefill_only=True) for k, n in enumerate(prompts)]
        for s in seqs:
            engine.submit(s)
        engine.start()
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in seqs)), 20)
        await engine.stop()
        steps = list(engine.steps)
        slips = sum(1 for r in steps if r.start_kind == "slip")
        return [float(s.first_token_at or math.nan) - steps[0].start for s in seqs], steps[0].start, slips

    measured, _, slips = asyncio.run(main())
    projected = project(prompts, StepTerms.of(prof)).first_token
    if slips:
        pytest.skip("the engine slipped a step (a loaded host): its clock no longer chains")
    assert measured == pytest.approx(list(projected), abs=1e-6)


def general_choice(q: PrefillQueues, tokens: int, now: float, free: np.ndarray, mask: np.ndarray) -> tuple[int, float]:
    """`least_queued_prefill`'s general path: each instance's first token, the earliest, the least queued on a tie."""
    first = np.where(mask, q.first_token_at(tokens, now, free), np.inf)
    p = int(first.argmin())
    ties = first <= first[p]
    if np.count_nonzero(ties) > 1:
        p = int(np.where(ties, np.maximum(free, now), np.inf).argmin())
    return p, float(first[p])


@pytest.mark.parametrize("serial", [False, True])
def test_the_soonest_instance_is_exactly_the_general_choice_wherever_it_answers(serial: bool) -> None:
    """`PrefillQueues.soonest` (the fast path of an instance choice) gives bit for bit what the
    per-instance projection and its tie-break give, on random routes, ends and departures."""
    rng = np.random.default_rng(11 if serial else 5)
    answered = asked = 0
    for trial in range(30):
        q = PrefillQueues(
            profile(
                max_num_seqs=int(rng.integers(1, 5)),
                max_num_batched_tokens=int(rng.choice([512, 2048])),
                prefill_host_per_request_s=float(rng.choice([0.0, 0.002])),
                prefill_per_token2_s=float(rng.choice([0.0, 1e-9])),
            )
        )
        q.serial = serial
        for _ in range(5):
            q.add_instance()
        if trial % 10 == 9:  # an instance with its own (calibrated) terms: soonest defers to the general path
            q.set_terms(2, StepTerms.of(profile(prefill_base_s=0.02)))
        now, live, mask = 0.0, [], np.ones(5, dtype=bool)
        for k in range(60):
            now += float(rng.exponential(0.03))
            op = rng.random()
            if op < 0.55 or not live:
                live.append(f"{trial}-{k}")
                q.push(int(rng.integers(5)), live[-1], int(rng.integers(1, 3000)), now)
            elif op < 0.9:
                q.end(live.pop(int(rng.integers(len(live)))), now)
            else:
                q.leave(live.pop(int(rng.integers(len(live)))), now)
            free = q.free_at if rng.random() < 0.7 else q.free_at + rng.choice([0.0, 1e-17, 0.01], size=5)
            if k % 4 == 0:  # a new mask now and then, the same one (as a view's cached mask) in between
                mask = rng.random(5) < 0.8
                mask[int(rng.integers(5))] = True
            tokens = int(rng.integers(1, 4000))
            asked += 1
            got = q.soonest(tokens, now, free, mask)
            if got is not None:
                answered += 1
                assert got == general_choice(q, tokens, now, free, mask)
    assert answered > asked // 4  # the fast path is taken often enough to be tested


def test_the_terms_prefill_time_is_the_estimators_own_bit_for_bit() -> None:
    """The dispatcher takes a prompt's own prefill time from the step terms (Python floats) instead
    of asking the estimator (NumPy scalars): the same number, before and after refits."""
    prof = profile(prefill_per_token2_s=3e-9)
    est = PrefillTimeEstimator(prof, refit_every=4)
    q = PrefillQueues(prof, est)
    rng = np.random.default_rng(3)
    for _ in range(200):
        tokens = float(rng.integers(1, 8000))
        assert q.terms.prefill_s(tokens) == est(tokens)
        est.observe(tokens, float(rng.uniform(0.01, 0.5)))

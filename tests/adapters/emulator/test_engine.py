"""The emulated engine's scheduler without HTTP: batching, queue, chunked prefill, KV preemption, timing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from adapters.emulator.engine import Engine, Sequence, StepRecord
from adapters.emulator.faults import FaultConfig, Faults
from tests.emulator_fixtures import FAST_PROFILE
from tests.helpers import toy_profile


def fast(**kw: Any) -> Any:
    """1 ms + 0.5 ms per sequence per step, 2 ms prefill base, 4-token blocks."""
    base: dict[str, Any] = dict(
        decode_step_base_s=0.001,
        decode_step_per_seq_s=0.0005,
        prefill_base_s=0.002,
        prefill_per_token_s=0.0001,
        block_size=4,
    )
    return toy_profile(**{**base, **kw})


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


class Recorder:
    """A TokenSink that notes when each token was released, against its prepared deadline."""

    def __init__(self) -> None:
        self.tokens: list[tuple[int, str | None, float, float]] = []
        self._pending: tuple[int, str | None, float] | None = None
        self.closed = False

    def prepare(self, index: int, finish_reason: str | None, step: int, deadline: float) -> None:
        self._pending = (index, finish_reason, deadline)

    def release(self) -> None:
        assert self._pending is not None
        self.tokens.append((*self._pending, time.monotonic()))

    def close(self) -> None:
        self.closed = True


async def serve(engine: Engine, seqs: list[Sequence]) -> list[StepRecord]:
    engine.start()
    for s in seqs:
        engine.submit(s)
    await asyncio.gather(*(s.done.wait() for s in seqs))
    await engine.stop()
    return list(engine.steps)


def test_admits_up_to_max_num_seqs_and_queues_the_rest_in_order() -> None:
    async def main() -> None:
        engine = Engine(fast(), Faults(), max_num_seqs=2)
        seqs = [Sequence(f"s{i}", 4, 3) for i in range(5)]
        steps = await serve(engine, seqs)
        assert max(r.batch for r in steps) == 2
        assert [s.generated for s in seqs] == [3] * 5 and {s.finish_reason for s in seqs} == {"length"}
        admitted = [s.admitted_at or 0.0 for s in seqs]
        assert admitted == sorted(admitted) and admitted[2] > admitted[1]
        assert engine.free_blocks == engine.total_blocks and engine.waiting == 0 and not engine.running

    run(main())


def test_step_time_is_the_profiles_and_tokens_leave_at_the_deadline() -> None:
    async def main() -> None:
        prof = fast()
        engine = Engine(prof, Faults())
        a, b = Sequence("a", 8, 5), Sequence("b", 8, 5)
        a.sink, b.sink = Recorder(), Recorder()
        steps = await serve(engine, [a, b])
        first = steps[0]
        assert first.batch == 2 and first.chunks == [(0, 8), (0, 8)] and first.kv_tokens == 16
        # prefill base once, per-token cost per chunk, plus the step itself
        assert first.end - first.start == pytest.approx(prof.step_time(2, 16) + 0.002 + 2 * 8 * 0.0001, abs=1e-9)
        for r in steps[1:]:
            assert r.start_kind in ("chain", "slip") and not r.chunks  # a slip only if the loop ran a step late
            assert r.end - r.start == pytest.approx(prof.step_time(r.batch, r.kv_tokens), abs=1e-9)
        assert [r.kv_tokens for r in steps[1:]] == [2 * 9, 2 * 10, 2 * 11, 2 * 12]
        for rec in (a.sink, b.sink):
            assert isinstance(rec, Recorder) and rec.closed
            assert [t[0] for t in rec.tokens] == [0, 1, 2, 3, 4] and rec.tokens[-1][1] == "length"
            for _, _, deadline, released in rec.tokens:
                assert 0 <= released - deadline < 0.02  # never early; late only by scheduling noise

    run(main())


def test_the_token_budget_comes_from_the_profile_unless_given() -> None:
    """vLLM's CPU servers schedule 2,048 tokens a step, GPU ones 8,192: the profile says which."""
    assert Engine(fast(), Faults()).max_num_batched_tokens == fast().max_num_batched_tokens == 8192
    cpu = fast().model_copy(update={"max_num_batched_tokens": 2048})
    assert Engine(cpu, Faults()).max_num_batched_tokens == 2048
    assert Engine(cpu, Faults(), max_num_batched_tokens=10).max_num_batched_tokens == 10


def test_chunked_prefill_spreads_a_long_prompt_over_steps_within_the_token_budget() -> None:
    async def main() -> None:
        engine = Engine(fast(), Faults(), max_num_batched_tokens=10)
        short, long = Sequence("short", 2, 60), Sequence("long", 25, 2)
        engine.start()
        engine.submit(short)
        await asyncio.sleep(0.01)  # short is decoding when long arrives
        engine.submit(long)
        await asyncio.gather(short.done.wait(), long.done.wait())
        await engine.stop()
        chunks = [c for r in engine.steps for c in r.chunks if c[1] > 2]
        assert chunks == [(0, 9), (9, 18), (18, 25)]  # 10 tokens a step, one of them short's decode
        assert all(r.tokens <= 10 for r in engine.steps)
        assert long.local_prefill_tokens == 25 and long.generated == 2

    run(main())


def test_kv_exhaustion_preempts_the_latest_admitted_and_recomputes() -> None:
    async def main() -> None:
        # 6 blocks of 4 tokens. Two prompts of 8 (2 blocks each) fit; each grows a block every
        # 4 tokens, so the second admitted is evicted, recomputes prompt + generated, and both finish.
        engine = Engine(fast(), Faults(), kv_capacity_tokens=24)
        preempted: list[str] = []
        engine.on_preempt = lambda s: preempted.append(s.id)
        a, b = Sequence("a", 8, 10), Sequence("b", 8, 10)
        steps = await serve(engine, [a, b])
        assert preempted and set(preempted) == {"b"} and engine.preemptions == b.preemptions >= 1 and a.preemptions == 0
        assert a.generated == b.generated == 10
        recompute = [c for r in steps for c in r.chunks if c[0] == 0 and c[1] > 8]
        assert recompute, "b's readmission prefills its prompt and generated tokens again"
        assert b.local_prefill_tokens > 8
        assert engine.free_blocks == engine.total_blocks

    run(main())


def test_priority_policy_orders_the_queue_and_picks_the_victim() -> None:
    async def main() -> None:
        engine = Engine(fast(), Faults(), max_num_seqs=1, priority_scheduling=True)
        blocker = Sequence("first", 4, 3)
        low, high = Sequence("low", 4, 2, priority=5, arrival=1.0), Sequence("high", 4, 2, priority=-1, arrival=2.0)
        engine.start()
        engine.submit(blocker)
        await asyncio.sleep(0)
        engine.submit(low)
        engine.submit(high)
        await asyncio.gather(low.done.wait(), high.done.wait())
        await engine.stop()
        assert high.admitted_at is not None and low.admitted_at is not None and high.admitted_at < low.admitted_at

        # under KV pressure the largest (priority, arrival) is evicted even if admitted first
        engine = Engine(fast(), Faults(), kv_capacity_tokens=24, priority_scheduling=True)
        victims: list[str] = []
        engine.on_preempt = lambda s: victims.append(s.id)
        bulk, urgent = (
            Sequence("bulk", 8, 10, priority=9, arrival=1.0),
            Sequence("urgent", 8, 10, priority=0, arrival=2.0),
        )
        await serve(engine, [bulk, urgent])
        assert victims and set(victims) == {"bulk"}

    run(main())


def test_prefill_only_sequences_hold_their_blocks_until_released() -> None:
    async def main() -> None:
        engine = Engine(fast(), Faults())
        s = Sequence("p", 10, 1, prefill_only=True, hold_kv=True)
        await serve(engine, [s])
        assert s.generated == 1 and s.finish_reason == "length" and engine.held_blocks == 3 and engine.kv_usage > 0
        engine.release_held(3)
        assert engine.kv_usage == 0

    run(main())


def test_pulled_kv_skips_the_prefill() -> None:
    async def main() -> None:
        engine = Engine(fast(), Faults())
        s = Sequence("d", 40, 3, external_tokens=40)
        steps = await serve(engine, [s])
        assert not any(r.chunks for r in steps) and s.local_prefill_tokens == 0 and s.generated == 3

    run(main())


def test_abort_frees_blocks_whether_waiting_or_running() -> None:
    async def main() -> None:
        engine = Engine(fast(), Faults(), max_num_seqs=1)
        running, waiting = Sequence("r", 8, 1000), Sequence("w", 8, 5)
        engine.start()
        engine.submit(running)
        engine.submit(waiting)
        await asyncio.sleep(0.02)
        assert running.in_running and waiting.in_waiting
        engine.abort(waiting)
        engine.abort(running)
        assert running.finish_reason == waiting.finish_reason == "abort"
        assert engine.free_blocks == engine.total_blocks and engine.waiting == 0 and not engine.running
        n = engine.step_no
        await asyncio.sleep(0.05)
        assert engine.step_no <= n + 1  # idle: no more steps (at most the one in flight)
        await engine.stop()

    run(main())


def test_slowdown_scales_steps_and_hang_pauses_the_engine() -> None:
    async def main() -> None:
        prof = fast()
        faults = Faults(FaultConfig(slowdown=3.0))
        engine = Engine(prof, faults)
        s = Sequence(
            "s",
            4,
            4,
        )
        steps = await serve(engine, [s])
        assert steps[-1].end - steps[-1].start == pytest.approx(3 * prof.step_time(1, 7), abs=1e-9)

        faults = Faults(FaultConfig(hang=True))
        engine = Engine(prof, faults)
        s = Sequence("s", 4, 2)
        engine.start()
        engine.submit(s)
        await asyncio.sleep(0.05)
        assert engine.step_no == 0 and engine.waiting == 1
        faults.update({"hang": False})
        await s.done.wait()
        assert s.generated == 2
        await engine.stop()

    run(main())


def test_a_profile_file_round_trips_for_the_cli() -> None:
    assert FAST_PROFILE.step_time(10, 0) == pytest.approx(0.003)


def test_a_prefill_requests_intake_delays_the_next_step_after_the_one_it_arrived_in() -> None:
    """50 ms of host work per prefill-only request, its intake. Two reaching an idle engine together:
    the first step starts 100 ms after them. One arriving while a 50 ms step runs: the next step
    starts 50 ms after that step's end. The requests' finishes cost nothing."""

    async def main() -> None:
        engine = Engine(fast(prefill_host_per_request_s=0.05, max_num_seqs=2), Faults())
        engine.start()
        t0 = engine.clock()
        first, second = (Sequence(f"p{k}", 8, 1, prefill_only=True) for k in range(2))
        for s in (first, second):
            engine.submit(s)
        await asyncio.gather(first.done.wait(), second.done.wait())
        await asyncio.sleep(0.2)  # idle again, nothing pending
        long = Sequence("long", 480, 1, prefill_only=True)  # 2 ms + 48 ms of prefill
        engine.submit(long)
        while not engine.stepping:
            await asyncio.sleep(0.001)
        late = Sequence("late", 8, 1, prefill_only=True)
        engine.submit(late)  # during the long step
        await asyncio.gather(long.done.wait(), late.done.wait())
        await engine.stop()
        a, b, c = list(engine.steps)[:3]
        assert a.batch == 2 and 0.1 <= a.start - t0 < 0.12  # both intakes before it
        assert (b.batch, c.batch) == (1, 1) and b.end - b.start > 0.045
        assert c.start == pytest.approx(b.end + 0.05, abs=1e-9)  # the late one's intake, after the step it came in

    run(main())


def test_prompts_arriving_during_a_step_make_it_longer_and_its_tokens_later() -> None:
    """30 ms per prompt arriving during a step, 20 ms of intake: a 480-token prompt's 50 ms step runs alone;
    two prompts arriving during it make it end 60 ms later (its first token with it), and their intakes
    (40 ms) follow it before the step that runs them. A prompt reaching the idle engine stretches nothing."""

    async def main() -> None:
        prof = fast(prefill_arrival_stretch_s=0.03, prefill_host_per_request_s=0.02, max_num_seqs=4)
        engine = Engine(prof, Faults())
        engine.start()
        head = Sequence("head", 480, 1, prefill_only=True)  # 2 ms + 48 ms of prefill
        engine.submit(head)
        while not engine.stepping:
            await asyncio.sleep(0.001)
        followers = [Sequence(f"f{k}", 8, 1, prefill_only=True) for k in range(2)]
        for s in followers:
            engine.submit(s)
        await asyncio.gather(head.done.wait(), *(s.done.wait() for s in followers))
        await engine.stop()
        a, b = list(engine.steps)[:2]
        assert a.batch == 1 and a.end - a.start == pytest.approx(prof.step_time(1, 480) + prof.prefill_time(480) + 0.06)
        assert head.first_token_at == a.end
        assert b.batch == 2 and b.start == pytest.approx(a.end + 0.04, abs=1e-9)  # no arrival during it: not stretched
        assert b.end - b.start < 0.01

    run(main())


def test_a_prefill_step_takes_longer_while_the_host_streams() -> None:
    """1 ms of host work per streamed token, the host's instances streaming 400 tokens/s (their board's
    total): a step carrying prefill takes 1 / (1 − 0.4) of its time, a decode step its own."""

    async def main() -> None:
        prof = fast(host_per_streamed_token_s=0.001)
        engine = Engine(prof, Faults())
        engine.host_streaming = lambda: 400.0
        first, *decode = await serve(engine, [Sequence("a", 40, 3)])
        assert first.chunks and first.end - first.start == pytest.approx(
            (prof.step_time(1, 40) + prof.prefill_time(40)) / 0.6
        )
        assert [d.end - d.start for d in decode] == pytest.approx([prof.step_time(1, 41), prof.step_time(1, 42)])

    run(main())


def test_the_first_step_after_idling_pays_the_wake_up_cost_and_the_next_ones_do_not() -> None:
    """With idle_wake_s = 0.2 s and τ = 50 ms, a request arriving 0.3 s after the previous one
    finished finds the engine idle since that one's last step ended: its prefill step lasts its
    modelled time plus wake_time(its start − that end) (about 0.2 s, far above timer noise), and its
    decode step, right after, only its modelled time."""

    async def main() -> None:
        prof = fast(idle_wake_s=0.2, idle_wake_tau_s=0.05)
        engine = Engine(prof, Faults())
        engine.start()
        a = Sequence("a", 4, 2)
        engine.submit(a)
        await a.done.wait()
        await asyncio.sleep(0.3)
        b = Sequence("b", 4, 2)
        engine.submit(b)
        await b.done.wait()
        await engine.stop()
        steps = list(engine.steps)
        assert len(steps) == 4
        a_last, b_first, b_second = steps[1], steps[2], steps[3]
        assert (b_first.start_kind, b_first.chunks, b_second.chunks) == ("idle", [(0, 4)], [])
        idle = b_first.start - a_last.end
        assert 0.29 < idle < 2.0
        modelled = prof.step_time(1, b_first.kv_tokens) + 0.002 + 4 * 0.0001
        assert b_first.end - b_first.start == pytest.approx(modelled + prof.wake_time(idle), abs=1e-9)
        assert b_first.end - b_first.start - modelled >= 0.19
        assert b_second.start_kind in ("chain", "slip")
        assert b_second.end - b_second.start == pytest.approx(prof.step_time(1, b_second.kv_tokens), abs=1e-9)
        assert (b_first.end - b_first.start) - (b_second.end - b_second.start) >= 0.19

    run(main())

"""The emulated engine's scheduler without HTTP: batching, waiting queue, KV preemption, step timing."""

from __future__ import annotations

import asyncio

import pytest

from adapters.emulator.engine import Engine, Sequence
from adapters.emulator.faults import Faults
from tests.helpers import toy_profile


def fast(**kw: object):  # type: ignore[no-untyped-def]
    return toy_profile(decode_step_base_s=0.004, decode_step_per_seq_s=0.001, prefill_base_s=0.002, block_size=4, **kw)


async def run_all(engine: Engine, seqs: list[Sequence]) -> None:
    engine.start()
    for s in seqs:
        engine.submit(s)
    await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in seqs)), 10)
    await engine.stop()


def test_admits_up_to_max_num_seqs_and_queues_the_rest() -> None:
    async def main() -> None:
        engine = Engine(fast(), Faults(), max_num_seqs=2)
        seen: list[int] = []
        engine.on_step = lambda batch, t, n: seen.append(n)
        seqs = [Sequence(f"s{i}", 4, 3) for i in range(5)]
        await run_all(engine, seqs)
        assert max(seen) == 2
        assert [s.generated for s in seqs] == [3] * 5
        assert seqs[4].admitted_at is not None and seqs[0].admitted_at is not None and seqs[4].admitted_at > seqs[0].admitted_at
        assert engine.free_blocks == engine.total_blocks

    asyncio.run(main())


def test_step_time_follows_the_profile() -> None:
    async def main() -> None:
        prof = fast()
        engine = Engine(prof, Faults())
        stamps: list[float] = []
        engine.on_step = lambda batch, t, n: stamps.append(t)
        s = Sequence("a", 8, 6)
        await run_all(engine, [s])
        first = prof.step_time(1, 8) + float(prof.prefill_time(8))
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        assert s.first_token_at is not None and s.admitted_at is not None
        assert s.first_token_at - s.admitted_at == pytest.approx(first, abs=2e-3)
        assert gaps == pytest.approx([prof.step_time(1, 8 + k) for k in range(1, 6)], abs=1e-9)  # deadlines, not wake-ups

    asyncio.run(main())


def test_kv_exhaustion_preempts_the_latest_admitted_and_recomputes() -> None:
    async def main() -> None:
        # 6 blocks of 4 tokens = 24 tokens. Two prompts of 8 (2 blocks each) fit; growing to
        # 12 tokens each needs 6 blocks, growing past that needs a 7th: someone is evicted.
        engine = Engine(fast(), Faults(), kv_capacity_tokens=24)
        a, b = Sequence("a", 8, 10), Sequence("b", 8, 10)
        await run_all(engine, [a, b])
        assert engine.preemptions >= 1 and b.preemptions >= 1 and a.preemptions == 0
        assert a.generated == b.generated == 10
        assert b.prefilled_tokens > 8  # its prompt and generated tokens were computed again
        assert engine.free_blocks == engine.total_blocks

    asyncio.run(main())


def test_priority_scheduling_runs_lower_values_first() -> None:
    async def main() -> None:
        engine = Engine(fast(), Faults(), max_num_seqs=1, priority_scheduling=True)
        low, high = Sequence("low", 4, 2, priority=5), Sequence("high", 4, 2, priority=-1)
        blocker = Sequence("first", 4, 2)
        engine.start()
        engine.submit(blocker)
        await asyncio.sleep(0)
        engine.submit(low)
        engine.submit(high)
        await asyncio.wait_for(asyncio.gather(low.done.wait(), high.done.wait()), 5)
        await engine.stop()
        assert high.admitted_at is not None and low.admitted_at is not None and high.admitted_at < low.admitted_at

    asyncio.run(main())


def test_prefill_only_sequences_hold_their_blocks() -> None:
    async def main() -> None:
        engine = Engine(fast(), Faults())
        s = Sequence("p", 10, 1, prefill_only=True, hold_kv=True)
        await run_all(engine, [s])
        assert s.generated == 1 and engine.held_blocks == 3 and engine.kv_usage > 0
        engine.release_held(3)
        assert engine.kv_usage == 0

    asyncio.run(main())

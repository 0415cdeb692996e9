"""The emulated engine under LoRA, in process: at most max_loras distinct adapters a step (a skipped request keeps its
place), a load stalls the engine, each adapter adds its per-step cost, the adapter is pinned while its request runs,
and the block pool keys and tags an adapter's blocks apart from the base model's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from adapters.emulator.engine import Engine, Sequence
from adapters.emulator.faults import Faults
from adapters.emulator.lora import EmulatedLora, LoraSettings
from adapters.emulator.prefix_cache import KVBlocks
from core.cache import events as ours
from core.cache.keys import prompt_keys
from tests.helpers import toy_profile

STEP_S = 0.002
PER_ADAPTER_S = 0.003


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


def engine_with_lora(max_loras: int, max_cpu_loras: int | None = None, load_s: float = 0.0) -> Engine:
    profile = toy_profile(
        decode_step_base_s=STEP_S, decode_step_per_seq_s=0.0, prefill_base_s=0.0, prefill_per_token_s=0.0
    )
    engine = Engine(profile, Faults())
    settings = LoraSettings(enable_lora=True, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    engine.lora = EmulatedLora(settings, "base", load_s, PER_ADAPTER_S, stall=engine.stall, clock=engine.clock)
    return engine


def seq(name: str, lora: str | None, max_tokens: int = 3) -> Sequence:
    return Sequence(name, 8, max_tokens, lora=lora)


def test_a_step_runs_at_most_max_loras_adapters_and_a_skipped_request_keeps_its_place() -> None:
    async def main() -> None:
        engine = engine_with_lora(max_loras=1, max_cpu_loras=3)
        a1, b1, a2, base, c1 = seq("a1", "a"), seq("b1", "b"), seq("a2", "a"), seq("base", None), seq("c1", "c")
        for s in (a1, b1, a2, base, c1):
            engine.submit(s)
        engine.start()
        await asyncio.gather(*(s.done.wait() for s in (a1, b1, a2, base, c1)))
        await engine.stop()
        # the first step admits a1, a2 and the base request; b1 and c1 wait, b1 first (FIFO kept)
        assert a1.admitted_at == a2.admitted_at == base.admitted_at
        assert b1.admitted_at is not None and c1.admitted_at is not None and a2.finished_at is not None
        assert a2.finished_at <= b1.admitted_at < c1.admitted_at
        assert engine.lora is not None and all(slot.active == 0 for slot in engine.lora.cache.slots.values())

    run(main())


def test_each_distinct_adapter_adds_its_cost_to_the_step() -> None:
    async def main() -> None:
        engine = engine_with_lora(max_loras=2)
        seqs = [seq("a1", "a", 1), seq("a2", "a", 1), seq("b1", "b", 1), seq("base", None, 1)]
        for s in seqs:
            engine.submit(s)
        engine.start()
        await asyncio.gather(*(s.done.wait() for s in seqs))
        await engine.stop()
        (step,) = engine.steps
        assert step.batch == 4 and step.end - step.start == pytest.approx(STEP_S + 2 * PER_ADAPTER_S)

    run(main())


def test_admitting_a_request_under_an_adapter_not_resident_stalls_the_engine_for_the_load() -> None:
    async def main() -> None:
        engine = engine_with_lora(max_loras=1, load_s=0.05)
        engine.start()
        t0 = engine.clock()
        a = seq("a", "a", 1)
        engine.submit(a)
        await a.done.wait()
        assert engine.steps[0].start - t0 >= 0.05  # the step waited for the load
        b = seq("b", "a", 1)
        t1 = engine.clock()
        engine.submit(b)
        await b.done.wait()
        assert engine.steps[-1].start - t1 < 0.05  # resident: no load
        await engine.stop()
        assert engine.lora is not None and engine.lora.cache.counters.loads == 1

    run(main())


def test_an_adapters_blocks_have_their_own_keys_and_their_events_name_it() -> None:
    kv = KVBlocks(16, 4, enable_events=True)
    ids = list(range(8))
    tuned = Sequence("t", 8, 1, prompt_ids=ids, lora="sql", lora_int_id=3)
    base = Sequence("b", 8, 1, prompt_ids=ids)
    assert kv.ensure(tuned, 8) == 0
    assert kv.lookup_ids(ids) == 0 and kv.lookup_ids(ids, "other") == 0 and kv.lookup_ids(ids, "sql") == 4
    assert kv.ensure(base, 8) == 0  # the same tokens under the base model: a miss
    seen: list[ours.KVEvent] = []
    kv.on_events = seen.extend
    kv.flush()
    assert seen == [
        ours.BlockStored(tuple(prompt_keys(ids, 4, "sql")), None, tuple(ids), 4, lora_id=3, lora_name="sql"),
        ours.BlockStored(tuple(prompt_keys(ids, 4)), None, tuple(ids), 4),
    ]



def test_a_load_while_every_slot_runs_a_request_registers_the_adapter_and_its_first_request_loads_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))

    async def main() -> None:
        engine = engine_with_lora(max_loras=1)
        lora = engine.lora
        assert lora is not None
        engine.start()
        a = seq("a", "a", 40)
        engine.submit(a)
        while not a.lora_pinned:
            await asyncio.sleep(0.001)
        assert await lora.load("b", str(tmp_path)) == "Success: LoRA adapter 'b' added successfully."
        assert "b" in lora.registered and not lora.cache.holds("b")  # a's request holds the only slot
        b = seq("b", "b", 1)
        engine.submit(b)
        await b.done.wait()
        assert a.finished_at is not None and b.admitted_at is not None and a.finished_at <= b.admitted_at
        assert lora.cache.holds("b") and not lora.cache.holds("a")
        await engine.stop()

    run(main())

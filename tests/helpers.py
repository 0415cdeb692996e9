"""Small builders shared by the core tests: toy profiles and hand-built dispatcher states."""

from __future__ import annotations

from typing import Any

from core.dispatch import Dispatcher
from core.perf import DecodeCurve, PerfProfile
from core.types import Role


def toy_profile(**overrides: Any) -> PerfProfile:
    """A profile with round numbers so timelines can be computed by hand."""
    base: dict[str, Any] = dict(
        name="toy",
        prefill_base_s=1.0,
        prefill_per_token_s=0.0,
        decode_step_base_s=0.1,
        decode_step_per_seq_s=0.0,
        tps_curve=DecodeCurve(a=0.0, b=0.0, c=10.0),
        kv_transfer_base_s=0.0,
        kv_transfer_per_token_s=0.0,
        kv_capacity_tokens=1_000_000,
        block_size=16,
        max_num_seqs=256,
        max_model_len=1000,
    )
    base.update(overrides)
    return PerfProfile(**base)


def cluster(
    policy: str = "round_robin", params: dict[str, Any] | None = None, *, prefill: int = 1, decode: int = 4, **kw: Any
) -> Dispatcher:
    d = Dispatcher(toy_profile(), policy, params, **kw)
    for i in range(prefill):
        d.add_instance(f"p{i}", Role.PREFILL)
    for i in range(decode):
        d.add_instance(f"d{i}", Role.DECODE)
    return d


def add_running(d: Dispatcher, rid: str, inst: str, *, prompt: int, generated: float, rate: float, now: float) -> None:
    """Put a request straight into RUNNING on `inst` with `generated` tokens observed at `now`."""
    t = d.view.table
    i = t.add(rid)
    idx = d.index_of(inst)
    t.inst[i] = idx
    t.state[i] = 2
    t.l_in[i] = prompt
    t.l_obs[i] = generated
    t.t_obs[i] = now
    t.v[i] = rate
    t.max_out[i] = 10_000
    d.view.running_n[idx] += 1


def add_pending(d: Dispatcher, rid: str, inst: str, *, prompt: int, handoff: float) -> None:
    """Put a request in PENDING (prefill under way) bound to `inst`, decoding from `handoff`."""
    t = d.view.table
    i = t.add(rid)
    idx = d.index_of(inst)
    t.inst[i] = idx
    t.state[i] = 1
    t.l_in[i] = prompt
    t.tau[i] = handoff
    t.max_out[i] = 10_000
    d.view.pending_n[idx] += 1


def instance_table_after(*snapshots: list[dict[str, Any]]) -> Any:
    """Run the dashboard's InstanceTable alone (Textual's run_test), show each snapshot of
    instances in turn and return the table after the last (its cells stay readable)."""
    import asyncio

    from textual.app import App, ComposeResult

    from console.live.state import InstanceRow
    from console.tui.instances import InstanceTable

    class TableOnly(App[None]):
        def compose(self) -> ComposeResult:
            yield InstanceTable()

    seen: list[Any] = []

    async def run() -> None:
        app = TableOnly()
        async with app.run_test() as pilot:
            table = app.query_one(InstanceTable)
            for instances in snapshots:
                table.show([InstanceRow.model_validate(i) for i in instances])
                await pilot.pause()
                seen.append(
                    {
                        "columns": [c.value for c in table.columns],
                        "cells": {
                            iid: {str(c.value): str(table.get_cell(iid, c)) for c in table.columns}
                            for iid in (str(i["id"]) for i in instances)
                        },
                    }
                )

    asyncio.run(run())
    return seen

"""Prefill on a decode instance, live: an emulated 1P1D console with the default admission
(`local_prefill` on) serves part of a streamed burst that the prefill instance alone would refuse on
its decode instance, which computes those prompts itself (no prefill leg, no KV transfer); they meet
their TTFT target as the client and the gateway measure it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from adapters.store import RunStore
from benchmarks.overload import Outcome, one
from tests.procs import Console, kill_children, start_console

PROMPT, OUTPUT = 256, 64


async def streamed_burst(url: str, n: int) -> list[Outcome]:
    """n streamed completions at once, as `benchmarks/overload.py` sends them."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
        return list(await asyncio.gather(*(one(client, url, PROMPT, OUTPUT, k, 60.0) for k in range(n))))


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    c = start_console(tmp_path, "--prefill", "1", "--decode", "1")  # h20-qwen3-32b and admission, as `up` defaults
    try:
        yield c
    finally:
        c.stop()
        kill_children(c.home)


def test_a_burst_past_the_prefill_backlog_is_served_in_part_by_the_decode_instance(console: Console) -> None:
    replies = asyncio.run(streamed_burst(console.url, 40))
    admission = console.state()["queue"]["admission"]
    answered = [r for r in replies if r.status == 200]
    assert {r.status for r in replies} <= {200, 429, 503}
    assert admission["local_prefill"] == 1 and admission["served_on_decode"] >= 3
    assert all(r.complete and r.tokens == OUTPUT for r in answered)
    console.stop()
    rows = [r for r in RunStore(console.db).requests(console.run_id) if r["status"] == "ok"]
    on_decode = [r for r in rows if r["prefill_instance"] is None]
    assert len(rows) == len(answered) and len(on_decode) == admission["served_on_decode"]
    assert all(r["decode_instance"] and r["ttft_source"] == "first_token" for r in on_decode)
    # what the decode instance prefilled met its TTFT target, and the admitted their SLO
    assert all(r["ttft"] <= 2.0 for r in on_decode), [round(r["ttft"], 2) for r in on_decode]
    assert sum(bool(r["slo_met"]) for r in rows) >= 0.9 * len(rows)
    assert all(r.ttft_s is not None and r.ttft_s <= 2.5 for r in answered)  # the client's own clock agrees

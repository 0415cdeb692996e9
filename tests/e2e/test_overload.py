"""Overload keeps its promises: a burst of non-streamed requests at an emulated 1P1D console with the
default settings (SLO admission on, the h20-qwen3-32b profile) is answered promptly.

What every client gets: 200 with the whole reply, or 429/503 with Retry-After well within its
class's wait bound (TTFT target 2 s + bounded wait 0 s); no timeout, nothing else. The requests the
console admitted keep ≥ 90% SLO attainment as it records them. The default suite sends a burst of
120; make test-slow sends issue 28's 600 (on main before SLO admission: 359 answered after 5–89 s,
241 without an answer within 90 s, attainment 0%).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from adapters.store import RunStore
from tests.procs import Console, kill_children, start_console

PROMPT, OUTPUT = 256, 200
WAIT_BOUND_S = 2.0
"""The default class's wait bound: TTFT target 2 s + the default bounded wait 0 s."""
GRACE_S = 1.5
"""Beyond the wait bound, what a rejection may take to reach a client on a busy 2-core machine
(the decision itself is taken when the gateway reads the request)."""


@dataclass
class Reply:
    status: int
    seconds: float
    retry_after: str | None
    tokens: int = 0


async def burst(url: str, n: int, timeout: float) -> list[Reply]:
    async def one(client: httpx.AsyncClient, k: int) -> Reply:
        body = {
            "model": "sibyl-model",
            "prompt": [5 + (k + j) % 500 for j in range(PROMPT)],
            "max_tokens": OUTPUT,
            "ignore_eos": True,
        }
        t0 = time.monotonic()
        try:
            r = await client.post(url + "/v1/completions", json=body)
        except httpx.HTTPError:
            return Reply(0, time.monotonic() - t0, None)
        tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
        return Reply(r.status_code, time.monotonic() - t0, r.headers.get("retry-after"), tokens)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        return list(await asyncio.gather(*(one(client, k) for k in range(n))))


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    c = start_console(tmp_path, "--prefill", "1", "--decode", "1")  # the defaults: h20-qwen3-32b, SLO admission on
    try:
        yield c
    finally:
        c.stop()
        kill_children(c.home)


def check_burst(console: Console, n: int, timeout: float) -> None:
    replies = asyncio.run(burst(console.url, n, timeout))
    state = console.state()
    by_status = {s: sum(r.status == s for r in replies) for s in {r.status for r in replies}}
    assert set(by_status) <= {200, 429, 503}, by_status  # nothing else fails, no timeout (status 0)
    answered = [r for r in replies if r.status == 200]
    rejected = [r for r in replies if r.status != 200]
    assert answered and all(r.tokens == OUTPUT for r in answered)
    assert all(r.retry_after is not None and int(r.retry_after) >= 1 for r in rejected)
    slow = sorted(r.seconds for r in rejected if r.seconds > WAIT_BOUND_S + GRACE_S)
    assert not slow, f"{len(slow)} rejections came after {WAIT_BOUND_S + GRACE_S} s: {slow[:5]}"
    admission = state["queue"]["admission"]
    assert admission["shed"] == by_status.get(429, 0) and admission["expired"] == by_status.get(503, 0)
    console.stop()
    rows = [r for r in RunStore(console.db).requests(console.run_id) if r["status"] == "ok"]
    assert len(rows) == len(answered)
    met = sum(bool(r["slo_met"]) for r in rows)
    assert met >= 0.9 * len(rows), [(round(r["ttft"], 2), r["slo_met"]) for r in rows]


@pytest.mark.slow  # ~7 s; with the 600 burst below in make test-slow, which CI runs
def test_a_burst_of_120_is_answered_promptly_and_the_admitted_meet_their_slo(console: Console) -> None:
    check_burst(console, 120, timeout=60)


@pytest.mark.slow
def test_the_issues_burst_of_600_is_answered_promptly_and_the_admitted_meet_their_slo(console: Console) -> None:
    check_burst(console, 600, timeout=90)

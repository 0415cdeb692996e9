"""SLO admission in front of attached idle fast upstreams refuses nothing (issue 37).

Two zero-latency OpenAI fakes (../shared/tools/fake_upstream.py: no model, no vLLM histograms, never a
waiting request) attached as one prefill and one decode instance; the console judges them by its
default profile, h20-qwen3-32b, whose prefill and TPOT models are far slower than the fakes. 64
concurrent streaming clients: every request is answered, none with 429 or 503 — the prior's
projection is corrected by the measured TTFT as far as the measurements back it, and before anything
is measured a request the prior alone would refuse is held, not refused. Before this (the prior
judging, the correction bounded to ×0.5 after 8 samples): 12–107 of loadgen.py's 3,000 refused at 64
clients. 256 clients (the slow stage) are refused nothing either (676 of loadgen.py's 3,000 before).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from adapters.ports import free_port
from tests.procs import Console, kill_children, start_console, wait_for

FAKE = Path(__file__).resolve().parents[3] / "shared" / "tools" / "fake_upstream.py"
CLIENTS = 64
ROUNDS = 12
"""Each client sends this many requests one after another (a closed loop, as loadgen.py does)."""

pytestmark = pytest.mark.skipif(not FAKE.exists(), reason=f"needs {FAKE} (the shared tools)")


@pytest.fixture
def fakes(tmp_path: Path) -> Iterator[list[str]]:
    procs, urls = [], []
    try:
        for k in range(2):
            port = free_port()
            log = open(tmp_path / f"fake{k}.log", "wb")  # noqa: SIM115 - open for the process's life
            procs.append(subprocess.Popen([sys.executable, str(FAKE), "--port", str(port)], stdout=log, stderr=log))
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda url=url: httpx.get(url + "/health", timeout=1).status_code == 200, 20, "a fake upstream")
            urls.append(url)
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


@pytest.fixture
def console(tmp_path: Path, fakes: list[str]) -> Iterator[Console]:
    prefill, decode = fakes
    c = start_console(tmp_path, "--backend", "vllm", "--attach", f"prefill={prefill};decode={decode}")
    try:
        yield c
    finally:
        c.stop()
        kill_children(c.home)


async def closed_loop(url: str, clients: int = CLIENTS) -> list[int]:
    """Every reply's status, `clients` of them looping ROUNDS times."""

    async def client(http: aiohttp.ClientSession, k: int) -> list[int]:
        out = []
        for j in range(ROUNDS):
            body = {"prompt": f"client {k} request {j}: " + "hello " * 32, "max_tokens": 16, "stream": True}
            async with http.post(url + "/v1/completions", json=body) as r:
                text = await r.text()
                out.append(r.status if "data: [DONE]" in text or r.status != 200 else -1)
        return out

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        replies = await asyncio.gather(*(client(http, k) for k in range(clients)))
    return [s for per_client in replies for s in per_client]


@pytest.mark.parametrize("clients", [CLIENTS, pytest.param(256, marks=pytest.mark.slow)])
def test_concurrent_clients_of_idle_fast_upstreams_see_no_refusal(console: Console, clients: int) -> None:
    statuses = asyncio.run(closed_loop(console.url, clients))
    by_status = {s: statuses.count(s) for s in set(statuses)}
    assert by_status == {200: clients * ROUNDS}, by_status
    admission = console.state()["queue"]["admission"]
    assert admission["shed"] == 0 and admission["expired"] == 0, admission
    # the measured TTFT corrected the prior's projection: the queue's part (most requests here wait behind others),
    # or a prompt's own service (the ones that found an instance idle)
    assert min(admission["ttft_drift_min"], admission["ttft_wait_drift_min"]) < 0.5, admission

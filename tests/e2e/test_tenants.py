"""Tenants of a real console (emulated 1P1D, the default profile and SLO admission): API keys, one tenant
flooding while the other's requests are all admitted and meet their SLO, 401s in OpenAI's shape as the
`openai` client sees them, and the keys file reloaded without a restart (a bad one keeps the old table)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from adapters.store import RunStore
from console.live.tenants import keys_file_line
from tests.procs import Console, kill_children, start_console, wait_for

FLOOD_KEY, STEADY_KEY, LATE_KEY = "sk-flood-0123456789", "sk-steady-0123456789", "sk-late-0123456789"
FLOOD_LIMIT = 3
PROMPT, OUTPUT = 128, 24


def write_keys(path: Path, *tables: str) -> None:
    tmp = path.with_name(".keys.tmp")
    tmp.write_text("\n".join(tables))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Console, Path]]:
    """One console for the module (the keys test first; the flood test stops it to read the run store)."""
    tmp_path = tmp_path_factory.mktemp("tenants")
    keys = tmp_path / "tenants.toml"
    write_keys(
        keys,
        keys_file_line("flood", FLOOD_KEY, max_in_flight=FLOOD_LIMIT),
        keys_file_line("steady", STEADY_KEY, max_in_flight=4, tokens_per_minute=100_000),
    )
    c = start_console(tmp_path, "--prefill", "1", "--decode", "1", "--tenants", str(keys))
    try:
        yield c, keys
    finally:
        c.stop()
        kill_children(c.home)


def body(k: int) -> dict[str, object]:
    return {"model": "sibyl-model", "prompt": [5 + (k + j) % 500 for j in range(PROMPT)], "max_tokens": OUTPUT}


async def flood_and_steady(url: str) -> tuple[list[httpx.Response], list[httpx.Response], int]:
    """8 flooding workers (80 requests, retried at once when refused) while 2 steady workers send 3 each."""
    flood: list[httpx.Response] = []
    steady: list[httpx.Response] = []
    peak = 0
    budget = iter(range(80))
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def flooder() -> None:
            for k in budget:
                r = await client.post("/v1/completions", json=body(k), headers={"Authorization": f"Bearer {FLOOD_KEY}"})
                flood.append(r)
                if r.status_code == 429:
                    await asyncio.sleep(0.05)

        async def steady_worker(w: int) -> None:
            await asyncio.sleep(0.3)  # the flood is on
            for k in range(3):
                r = await client.post(
                    "/v1/completions", json=body(1000 + 10 * w + k), headers={"Authorization": f"Bearer {STEADY_KEY}"}
                )
                steady.append(r)

        async def watch() -> None:
            nonlocal peak
            while True:
                m = (await client.get("/metrics")).text
                line = next(x for x in m.splitlines() if x.startswith('sibyl_tenant_in_flight{tenant="flood"}'))
                peak = max(peak, int(float(line.split()[-1])))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(flooder() for _ in range(8)), *(steady_worker(w) for w in range(2)))
        watcher.cancel()
    return flood, steady, peak


def test_keys_are_required_in_openais_shape_and_reload_without_a_restart(console: tuple[Console, Path]) -> None:
    c, keys = console
    r = httpx.post(c.url + "/v1/completions", json=body(0))
    assert r.status_code == 401
    assert r.json()["error"] == {
        "message": r.json()["error"]["message"],
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert "didn't provide an API key" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=c.url + "/v1", api_key=LATE_KEY, max_retries=0).completions.create(
            model="sibyl-model", prompt="hello", max_tokens=2
        )
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key" and e.value.type == "invalid_request_error"
    assert LATE_KEY not in str(e.value.body)
    steady = openai.OpenAI(base_url=c.url + "/v1", api_key=STEADY_KEY, max_retries=0)
    assert steady.completions.create(model="sibyl-model", prompt="hello", max_tokens=2).usage.completion_tokens == 2
    assert [m.id for m in steady.models.list()] == ["sibyl-model"]

    # a new tenant appears in the file: the console takes it within a second, no restart
    write_keys(keys, keys.read_text(), keys_file_line("late", LATE_KEY))
    late = openai.OpenAI(base_url=c.url + "/v1", api_key=LATE_KEY, max_retries=0)
    wait_for(lambda: "late" in c.state()["tenants"]["tenants"], 5, "the keys file to be reloaded")
    assert late.completions.create(model="sibyl-model", prompt="hi", max_tokens=2).usage.completion_tokens == 2

    # a bad file: the error names file, line and field; the table in force stays
    good = keys.read_text()
    write_keys(keys, good + '\n[tenants.broken]\nkey_sha256 = "not-a-hash"\n')
    wait_for(lambda: c.state()["tenants"]["last_error"] is not None, 5, "the bad reload to be reported")
    error = c.state()["tenants"]["last_error"]
    assert str(keys) in error and "tenant 'broken'" in error and "key_sha256" in error and "line" in error
    assert late.completions.create(model="sibyl-model", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with c.control() as ctl:
        r = ctl.post("/control/tenants/reload")
        assert r.status_code == 422 and "the table in force stays" in r.json()["error"]["message"]
        write_keys(keys, good)
        r = ctl.post("/control/tenants/reload")
        assert r.status_code == 200 and r.json()["tenants"] == ["flood", "steady", "late"]
    assert c.state()["tenants"]["last_error"] is None
    assert "sibyl_gateway_unauthorized_total 2.0" in httpx.get(c.url + "/metrics").text


def test_a_flooding_tenant_is_held_to_its_limit_and_the_other_keeps_its_slo(console: tuple[Console, Path]) -> None:
    c, _ = console
    flood, steady, peak = asyncio.run(flood_and_steady(c.url))
    assert [r.status_code for r in steady] == [200] * 6
    limited = [r for r in flood if r.status_code == 429 and "max_in_flight" in r.text]
    assert limited and all(int(r.headers["retry-after"]) >= 1 for r in limited)
    assert {r.status_code for r in flood} <= {200, 429} and any(r.status_code == 200 for r in flood)
    assert 1 <= peak <= FLOOD_LIMIT
    metrics = httpx.get(c.url + "/metrics").text
    assert f'sibyl_tenant_requests_total{{outcome="limited",tenant="flood"}} {float(len(limited))}' in metrics
    tenants = c.state()["tenants"]
    assert tenants["required"] and tenants["tenants"]["steady"]["requests"]["limited"] == 0
    status = c.cli("status")
    assert status.returncode == 0 and "tenants" in status.stdout and "flood" in status.stdout
    c.stop()
    rows = RunStore(c.db).requests(c.run_id)
    steady_rows = [r for r in rows if r["tenant"] == "steady" and r["prompt_tokens"] == PROMPT]  # the flood's time
    assert len(steady_rows) == 6 and all(r["status"] == "ok" and r["slo_met"] for r in steady_rows)
    assert sum(r["tenant"] == "flood" and "max_in_flight" in (r["reason"] or "") for r in rows) == len(limited)

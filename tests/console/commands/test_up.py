"""`sibyl-console up`: params reach the policies the config chose, and a taken port is one line."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from adapters.ports import cannot_listen, free_port
from console.cli import _register_commands, app
from core.errors import ConfigError

_register_commands(["up"])
runner = CliRunner()
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port this test process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The config `up --headless` would serve (serving itself is replaced)."""
    configs: list[Any] = []
    monkeypatch.setattr("console.commands.up._serve_here", lambda cfg, *a, **kw: configs.append(cfg))
    return configs


def test_prefixed_params_reach_the_policies_the_config_chose(sibyl_home: Path, served: list[Any]) -> None:
    args = ["up", "--headless", "--port", "0", "--param", "prefix_aware.decode_params={}"]
    args += ["--param", "fcfs.max_prefill_backlog_s=None", "--params-json", '{"balance_s": 3}']
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    [cfg] = served
    assert cfg.policy == "prefix_aware" and cfg.params == {"balance_s": 3, "decode_params": {}}
    assert cfg.queue.name == "fcfs" and cfg.queue.params == {"max_prefill_backlog_s": None}


def test_a_prefix_naming_no_policy_in_use_is_an_error(sibyl_home: Path, served: list[Any]) -> None:
    result = runner.invoke(app, ["up", "--headless", "--port", "0", "--param", "least_load.by=tokens"])
    assert isinstance(result.exception, ConfigError) and not served
    assert "--param names policies not in use: least_load; in use: policy=prefix_aware, queue=fcfs" in str(
        result.exception
    )


def test_cannot_listen_names_the_port_and_the_process_holding_it(taken_port: int) -> None:
    said = cannot_listen("127.0.0.1", taken_port)
    assert said is not None and said.startswith(f"port {taken_port} on 127.0.0.1 is in use by pid {os.getpid()} (")
    assert cannot_listen("127.0.0.1", free_port()) is None


def test_up_on_a_taken_port_is_one_line(sibyl_home: Path, taken_port: int) -> None:
    cmd = [sys.executable, "-m", "console.cli", "up", "--headless", "--backend", "sim", "--port", str(taken_port)]
    env = {**os.environ, "SIBYL_HOME": str(sibyl_home)}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 2
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"sibyl-console: error: port {taken_port} on 127.0.0.1 is in use by pid {os.getpid()} (")


def test_the_server_process_says_the_same_line(sibyl_home: Path, taken_port: int) -> None:
    """The console server process (`up` with the dashboard, `--detach`) checks again: a port taken
    between `up`'s check and its bind ends start-up with that one line too, nothing started."""
    from console.live.config import ConsoleConfig
    from console.serve import run_console
    from console.server_process import ServerStartError, spawn_server

    cfg = ConsoleConfig(backend="sim", port=taken_port, db=sibyl_home / "runs.db")
    with pytest.raises(ConfigError, match=f"port {taken_port} on 127.0.0.1 is in use by pid {os.getpid()}"):
        asyncio.run(run_console(cfg, lambda live: None))
    with pytest.raises(ServerStartError) as e:
        spawn_server(cfg, owned=True)
    [line] = str(e.value).splitlines()
    assert line.startswith(f"port {taken_port} on 127.0.0.1 is in use by pid {os.getpid()} (") and "(log: " in line

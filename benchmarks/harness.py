"""What the benchmark scripts share: start a process in its own group, wait for an HTTP endpoint,
stop the group; a headless console on a free port with its own home, database and token; and a run of
shared/tools/loadgen.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def start(cmd: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    """Run `cmd` from `cwd` (the repository root) in a new process group, its output discarded."""
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def wait_http(url: str, timeout: float = 30, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Return once `url` answers 200; raise if it does not within `timeout` or `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def stop(p: subprocess.Popen[bytes], grace_s: float = 15) -> None:
    """SIGTERM the process group, SIGKILL it after `grace_s`."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def console_env(home: Path, token: str | None = None) -> dict[str, str]:
    """The environment of a console (and its CLI clients) living in `home`."""
    env = {**os.environ, "SIBYL_HOME": str(home), "SIBYL_DB": str(home / "runs.db")}
    if token is not None:
        env["SIBYL_TOKEN"] = token
    return env


def start_console(
    port: int, args: list[str], env: dict[str, str], timeout: float = 90, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    """`sibyl-console up --headless --port PORT ARGS...` run from `cwd` (another source tree's, with `env`'s
    PYTHONPATH pointing there), returned once its gateway answers /health."""
    console = start([sys.executable, "-m", "console.cli", "up", "--headless", "--port", str(port), *args], env, cwd)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout, console)
    except RuntimeError:
        stop(console)
        raise
    return console


def run_loadgen(
    loadgen: Path, url: str, pid: int, concurrency: int, n: int, warmup: int = 200, prompt_words: int | None = None
) -> dict[str, Any]:
    """shared/tools/loadgen.py against `url`: streaming /v1/completions of 16 tokens, `n` requests from
    `concurrency` clients after `warmup`, watching process `pid`'s CPU as `proxy`; its JSON summary."""
    words = [] if prompt_words is None else ["--prompt-words", str(prompt_words)]
    cmd = [sys.executable, str(loadgen), "--url", url, "-c", str(concurrency), "-n", str(n), "--stream"]
    cmd += ["--max-tokens", "16", *words, "--warmup", str(warmup), "--watch-pid", f"proxy={pid}", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]

"""`up --backend vllm` without vLLM: a fake `vllm` executable in a fake venv runs an emulator in
its place, so the console's launch, routing, start-up failure and shutdown paths run for real.
(The real-vLLM checks are tests/vllm, run by `make test-vllm`.)"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from tests.procs import ROOT, alive, free_port, start_console, wait_for

EMULATING_VLLM = """
import json, os, sys
args = sys.argv[1:]
assert args[0] == "serve", args
def arg(flag, default=None):
    return args[args.index(flag) + 1] if flag in args else default
kv = json.loads(arg("--kv-transfer-config", "{}"))
os.execv(sys.executable, [sys.executable, "-m", "adapters.emulator", "--role", "both", "--host", arg("--host"),
         "--port", arg("--port"), "--model", arg("--served-model-name"), "--profile", "cpu-tiny-llama",
         "--kv-load-failure-policy", kv.get("kv_load_failure_policy", "fail")])
"""

FAILING_VLLM = """
import sys
print("INFO loading weights", flush=True)
print("OSError: /models/missing does not appear to have a file named config.json", file=sys.stderr, flush=True)
sys.exit(1)
"""

SLOW_VLLM = """
import os, sys, time
open(os.environ["FAKE_VLLM_PIDS"], "a").write(f"{os.getpid()}\\n")
time.sleep(600)
"""


def fake_venv(tmp: Path, body: str) -> Path:
    venv = tmp / "venv"
    (venv / "bin").mkdir(parents=True)
    exe = venv / "bin" / "vllm"
    exe.write_text(f"#!{sys.executable}\n{body}")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return venv


def up_args(tmp: Path, venv: Path) -> list[str]:
    (tmp / "tiny-llama").mkdir(exist_ok=True)  # a local model directory: loaded with the hub offline
    return [
        "--backend",
        "vllm",
        "--model",
        str(tmp / "tiny-llama"),
        "--prefill",
        "1",
        "--decode",
        "1",
        "--vllm-venv",
        str(venv),
    ]


def run_up(tmp: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    base = {**os.environ, "SIBYL_HOME": str(tmp / "home"), "SIBYL_DB": str(tmp / "runs.db"), **(env or {})}
    cmd = [sys.executable, "-m", "console.cli", "up", "--headless", "--port", str(free_port()), *args]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def test_up_launches_vllm_processes_routes_through_them_and_stops_them(tmp_path: Path) -> None:
    con = start_console(tmp_path, *up_args(tmp_path, fake_venv(tmp_path, EMULATING_VLLM)), "--vllm-arg=--enforce-eager")
    try:
        state = con.state()
        assert state["backend"] == "vllm" and state["cluster"] == "1P1D"
        pids = [i["pid"] for i in state["instances"]]
        assert all(isinstance(p, int) and alive(p) for p in pids)
        client = OpenAI(base_url=con.url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(
            model="sibyl-model", prompt="hello", max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert out.usage is not None and out.usage.completion_tokens == 5
        logs = sorted((con.run_dir / "logs").glob("*.log"))
        assert [p.name.split("-")[0] for p in logs] == ["decode", "prefill"]
        head = logs[1].read_text().splitlines()[:2]
        cmd, env = head[0], json.loads(head[1].removeprefix("# env: "))
        assert cmd.startswith(f"$ {tmp_path}/venv/bin/vllm serve {tmp_path}/tiny-llama --host 127.0.0.1")
        assert "--served-model-name sibyl-model" in cmd and cmd.endswith("--disable-uvicorn-access-log --enforce-eager")
        kv = json.loads(cmd.split("--kv-transfer-config ")[1].split(" ")[0])
        assert kv == {"kv_buffer_device": "cpu", "kv_connector": "NixlConnector", "kv_role": "kv_producer"}
        assert (
            env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
        )
        assert (
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
            != json.loads(logs[0].read_text().splitlines()[1][7:])["VLLM_NIXL_SIDE_CHANNEL_PORT"]
        )
    finally:
        assert con.stop() == 0
    assert not any(alive(p) for p in pids)


@pytest.mark.slow  # ~5 s (make test-slow); the default suite launches and stops fake vLLMs in the test above
def test_a_vllm_that_dies_at_start_up_is_reported_with_its_log_tail(tmp_path: Path) -> None:
    proc = run_up(tmp_path, *up_args(tmp_path, fake_venv(tmp_path, FAILING_VLLM)))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "exited with code 1 during start-up" in err
    assert "does not appear to have a file named config.json" in err


@pytest.mark.slow  # ~7 s (make test-slow)
def test_sigterm_during_start_up_stops_the_instances_launched_so_far(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    proc = run_up(tmp_path, *up_args(tmp_path, fake_venv(tmp_path, SLOW_VLLM)), env={"FAKE_VLLM_PIDS": str(pid_file)})
    try:
        wait_for(lambda: pid_file.exists() and len(pid_file.read_text().split()) == 2, 30, "both fake vLLM processes")
        pids = [int(p) for p in pid_file.read_text().split()]
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not any(alive(p) for p in pids)
    runs = subprocess.run(
        [sys.executable, "-m", "console.cli", "runs", "list", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "SIBYL_DB": str(tmp_path / "runs.db")},
        timeout=60,
    )
    assert [r["status"] for r in json.loads(runs.stdout)] == ["interrupted"]


@pytest.mark.parametrize("flag", ["--vllm-venv", pytest.param("--model", marks=pytest.mark.slow)])  # ~4 s each
def test_missing_vllm_or_model_is_a_clear_error(tmp_path: Path, flag: str) -> None:
    args = up_args(tmp_path, tmp_path / "no-venv")
    if flag == "--model":
        args = [a for a in args if a not in ("--model", str(tmp_path / "tiny-llama"))]
    proc = run_up(tmp_path, *args)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    if flag == "--vllm-venv":
        assert f"no `vllm` executable in {tmp_path}/no-venv/bin" in err and "make vllm-cpu" in err
    else:
        assert "--backend vllm needs --model PATH" in err

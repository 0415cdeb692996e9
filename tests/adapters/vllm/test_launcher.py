"""The vLLM launcher without vLLM: command lines and environments per role, start/stop of fake
`vllm` executables (a failing one, a silent one, a tiny HTTP server), attach, and `doctor`."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

from adapters.ports import free_port
from adapters.vllm.launcher import (
    NIXL_PROGRESS_SHIM,
    LaunchedInstance,
    VllmAttachError,
    VllmCluster,
    VllmInstanceSpec,
    VllmLaunchError,
    attach,
    build_command,
    build_env,
    launch,
    plan_specs,
    stop_all,
)
from adapters.vllm.platform import PlatformReport, cpu_facts, memory_gib, what_is_missing
from console.commands import doctor
from core.errors import ConfigError
from core.types import Role
from tests.procs import alive

MODEL = "/models/tiny-llama"


def cpu_spec(role: Role, port: int, **kw: object) -> VllmInstanceSpec:
    return VllmInstanceSpec(role=role, port=port, model=MODEL, served_model_name="tiny", **kw)  # type: ignore[arg-type]


def kv_config(cmd: list[str]) -> dict[str, object]:
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])  # type: ignore[no-any-return]


# --- command lines and environments -------------------------------------------------------


def test_cpu_prefill_command_and_env() -> None:
    spec = cpu_spec(
        Role.PREFILL,
        8100,
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_gib=1,
        enforce_eager=True,
        nixl_side_channel_port=5600,
        cpu_bind="0",
    )
    cmd = build_command(spec, "/venv/bin/vllm")
    assert cmd == [
        "/venv/bin/vllm",
        "serve",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        "8100",
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        "--kv-transfer-config",
        '{"kv_buffer_device":"cpu","kv_connector":"NixlConnector","kv_role":"kv_producer"}',
        "--enforce-eager",
        "--disable-uvicorn-access-log",
    ]
    assert kv_config(cmd) == {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    assert "--disable-uvicorn-access-log" not in build_command(spec.model_copy(update={"access_log": True}))
    assert kv_config(build_command(spec.model_copy(update={"kv_role": "kv_both"})))["kv_role"] == "kv_both"
    assert build_env(spec) == {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
        "SIBYL_NIXL_PROGRESS_DELAY_US": "100",
        "PYTHONPATH": os.pathsep.join(p for p in (str(NIXL_PROGRESS_SHIM), os.environ.get("PYTHONPATH", "")) if p),
    }


def test_cpu_decode_with_failure_policy_extra_config_and_passthrough() -> None:
    spec = cpu_spec(
        Role.DECODE,
        8200,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kv_lease_duration": 60},
        nixl_side_channel_port=5601,
        nixl_side_channel_host="10.0.0.5",
        extra_args=["--block-size", "128", "--seed", "7"],
        extra_env={"VLLM_CPU_KVCACHE_SPACE": "3", "MY_FLAG": "x"},
    )
    cmd = build_command(spec)
    assert cmd[:2] == ["vllm", "serve"] and cmd[-4:] == ["--block-size", "128", "--seed", "7"]
    assert "--enforce-eager" not in cmd and "--scheduling-policy" not in cmd and "--max-model-len" not in cmd
    assert kv_config(cmd) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_lease_duration": 60},
    }
    env = build_env(spec)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.5" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["MY_FLAG"] == "x"  # extra_env wins
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env


def test_gpu_spec_has_no_cpu_settings() -> None:
    spec = VllmInstanceSpec(
        role=Role.DECODE,
        port=8200,
        model="meta-llama/Llama-3.1-8B-Instruct",
        device="cuda",
        gpu_memory_utilization=0.85,
        kv_cache_gib=4,
        cuda_devices="1",
        hub_offline=False,
        nixl_side_channel_port=5700,
    )
    cmd = build_command(spec)
    assert cmd[cmd.index("--served-model-name") + 1] == "Llama-3.1-8B-Instruct"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.85"
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(4 * 2**30)
    assert kv_config(cmd) == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert build_env(spec) == {
        "CUDA_VISIBLE_DEVICES": "1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5700",
    }
    assert build_env(spec, "cpu")["VLLM_TARGET_DEVICE"] == "cpu"  # the platform argument overrides


def test_nixl_progress_thread_sleeps_on_cpu_unless_told_otherwise() -> None:
    spec = cpu_spec(Role.DECODE, 8200, nixl_side_channel_port=5601)
    assert build_env(spec)["SIBYL_NIXL_PROGRESS_DELAY_US"] == "100"
    assert build_env(spec.model_copy(update={"nixl_progress_delay_us": 2000}))["SIBYL_NIXL_PROGRESS_DELAY_US"] == "2000"
    for untouched in (
        spec.model_copy(update={"nixl_progress_delay_us": 0}),
        spec.model_copy(update={"kv_connector": None}),
        spec.model_copy(update={"device": "cuda"}),
    ):
        env = build_env(untouched)
        assert "SIBYL_NIXL_PROGRESS_DELAY_US" not in env
        # every CPU instance carries the shim (its AMX tile request); a CUDA one carries nothing
        assert ("PYTHONPATH" in env) == (untouched.device == "cpu")


def test_the_shim_asks_for_the_amx_tile_state_on_x86_64_linux() -> None:
    """vLLM-cpu's AMX attention kernel dies with SIGILL in a process that never asked for the tile
    state; the shim asks at interpreter start-up. After it, the process holds the permission where
    the CPU has AMX (arch_prctl ARCH_GET_XCOMP_PERM shows XTILEDATA), and start-up never fails where
    it has none."""
    probe = (
        "import ctypes, os, sys\n"
        "bits = ctypes.c_ulong(0)\n"
        "ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(bits))\n"
        "print(int(bool(bits.value >> 18 & 1)))\n"
    )
    env = {"PYTHONPATH": str(NIXL_PROGRESS_SHIM), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    if sys.platform != "linux" or os.uname().machine != "x86_64" or "amx_tile" not in Path("/proc/cpuinfo").read_text():
        return  # nothing to ask for: the shim must only not break start-up
    assert done.stdout.strip() == "1"


def test_the_shim_gives_nixl_agents_the_delay_when_the_bindings_load(tmp_path: Path) -> None:
    """A stand-in `nixl_cu12._bindings` records the config its agent gets; with the shim on the path
    it sees the delay, without the variable it sees NIXL's own 0."""
    pkg = tmp_path / "nixl_cu12"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_bindings.py").write_text(
        "class nixlAgentConfig:\n    pthrDelay = 0\n\ndef nixlAgent(name, config):\n    return config.pthrDelay\n"
    )
    probe = "import nixl_cu12._bindings as b; c = b.nixlAgentConfig(); c.pthrDelay = 0; print(b.nixlAgent('x', c))"
    path = os.pathsep.join([str(NIXL_PROGRESS_SHIM), str(tmp_path)])

    def run(env: dict[str, str]) -> str:
        return subprocess.run(
            [sys.executable, "-c", probe],
            env={"PATH": os.environ["PATH"], "PYTHONPATH": path, **env},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    assert run({"SIBYL_NIXL_PROGRESS_DELAY_US": "250"}) == "250"
    assert run({}) == "0"


def test_priority_flag_only_when_asked_and_no_connector_means_no_kv_config() -> None:
    assert "--scheduling-policy" not in build_command(cpu_spec(Role.BOTH, 8000))
    cmd = build_command(cpu_spec(Role.BOTH, 8000, scheduling_policy="priority", kv_connector=None))
    assert cmd[cmd.index("--scheduling-policy") + 1] == "priority"
    assert "--kv-transfer-config" not in cmd
    assert not any(k.startswith("VLLM_NIXL") for k in build_env(cpu_spec(Role.BOTH, 8000, kv_connector=None)))


def test_plan_gives_unique_side_channel_ports_and_one_core_each() -> None:
    specs = [cpu_spec(Role.PREFILL, 8100), cpu_spec(Role.DECODE, 8200), cpu_spec(Role.DECODE, 8201)]
    planned = plan_specs(specs, cores=[0, 1, 2, 3])
    ports = [s.nixl_side_channel_port for s in planned]
    assert all(ports) and len(set(ports)) == 3 and not {8100, 8200, 8201} & set(ports)  # type: ignore[arg-type]
    assert [s.cpu_bind for s in planned] == ["0", "1", "2"]
    assert len({build_env(s)["VLLM_NIXL_SIDE_CHANNEL_PORT"] for s in planned}) == 3
    assert all(s.cpu_bind is None for s in plan_specs(specs, cores=[0, 1]))  # too few cores: no pinning
    kept = plan_specs([cpu_spec(Role.PREFILL, 8100, cpu_bind="0-1"), cpu_spec(Role.DECODE, 8200)], cores=[0, 1])
    assert [s.cpu_bind for s in kept] == ["0-1", None]  # an explicit binding is left alone


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([cpu_spec(Role.PREFILL, 8100), cpu_spec(Role.DECODE, 8100)], "two vLLM instances on 127.0.0.1:8100"),
        (
            [
                cpu_spec(Role.PREFILL, 8100, nixl_side_channel_port=5600),
                cpu_spec(Role.DECODE, 8200, nixl_side_channel_port=5600),
            ],
            "side-channel ports must differ",
        ),
    ],
)
def test_plan_rejects_clashing_ports(specs: list[VllmInstanceSpec], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_specs(specs, cores=[0, 1])


# --- start and stop with fake `vllm` executables ---------------------------------------------


def fake_vllm(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "vllm"
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


FAILING = """
import sys
for i in range(50):
    print(f"loading line {i}", flush=True)
print("ValueError: model /models/tiny-llama not found", file=sys.stderr, flush=True)
sys.exit(3)
"""

SILENT = """
import time
time.sleep(600)
"""

SERVER = """
import json, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
def arg(flag):
    return args[args.index(flag) + 1]
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like vLLM's EngineCore
time.sleep(0.3)

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            body = b""
        elif self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": arg("--served-model-name")}]}).encode()
        elif self.path == "/info":
            env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "HF_", "TRANSFORMERS_"))}
            body = json.dumps({"engine_pid": engine.pid, "argv": args, "env": env}).encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass

print("serving", flush=True)
ThreadingHTTPServer((arg("--host"), int(arg("--port"))), Handler).serve_forever()
"""


def test_launch_failure_quotes_the_log_tail(tmp_path: Path) -> None:
    vllm = fake_vllm(tmp_path, FAILING)
    with pytest.raises(VllmLaunchError) as err:
        launch([cpu_spec(Role.PREFILL, free_port())], tmp_path / "logs", vllm, health_timeout_s=30)
    msg = str(err.value)
    assert "exited with code 3" in msg and "prefill-" in msg
    assert "ValueError: model /models/tiny-llama not found" in msg
    assert "loading line 49" in msg and "loading line 21" in msg and "loading line 20\n" not in msg
    assert len((tmp_path / "logs").glob("prefill-*.log").__next__().read_text().splitlines()) == 53


def test_launch_timeout_stops_the_process(tmp_path: Path) -> None:
    cluster = VllmCluster(
        [cpu_spec(Role.DECODE, free_port())],
        tmp_path / "logs",
        fake_vllm(tmp_path, SILENT),
        health_timeout_s=1.0,
        poll_interval_s=0.1,
        stop_grace_s=5,
    )
    with pytest.raises(VllmLaunchError, match=r"not healthy after 1 s"):
        cluster.start()
    assert not alive(cluster.instances[0].pid)


def test_launch_serves_attaches_and_stop_kills_the_process_group(tmp_path: Path) -> None:
    vllm = fake_vllm(tmp_path, SERVER)
    specs = [cpu_spec(Role.PREFILL, free_port(), kv_cache_gib=1), cpu_spec(Role.DECODE, free_port(), kv_cache_gib=1)]
    instances = launch(specs, tmp_path / "logs", vllm, health_timeout_s=30, cores=[0, 1])
    try:
        assert all(i.alive() and i.ready_s is not None for i in instances)
        infos = [httpx.get(i.url + "/info").json() for i in instances]
        assert [i["env"]["VLLM_CPU_OMP_THREADS_BIND"] for i in infos] == ["0", "1"]
        assert all(i["env"]["VLLM_TARGET_DEVICE"] == "cpu" and i["env"]["HF_HUB_OFFLINE"] == "1" for i in infos)
        assert len({i["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] for i in infos}) == 2
        assert infos[0]["argv"] == instances[0].command[1:]
        assert (tmp_path / "logs" / f"prefill-{specs[0].port}.log").read_text().count("serving") == 1
        names = attach({"prefill": instances[0].url, Role.DECODE: [instances[1].url]})
        assert names == {instances[0].url: ["tiny"], instances[1].url: ["tiny"]}
    finally:
        stop_all(instances, grace_s=5)
    for inst, info in zip(instances, infos, strict=True):
        assert inst.proc.returncode is not None and not alive(inst.pid) and not alive(info["engine_pid"])
        with pytest.raises(ProcessLookupError):
            os.kill(inst.pid, 0)


def test_interrupt_during_start_up_stops_what_was_started(tmp_path: Path) -> None:
    class Interrupted(VllmCluster):
        def _check_alive(self, inst: LaunchedInstance) -> None:
            raise KeyboardInterrupt

    cluster = Interrupted(
        [cpu_spec(Role.PREFILL, free_port())], tmp_path / "logs", fake_vllm(tmp_path, SILENT), stop_grace_s=5
    )
    with pytest.raises(KeyboardInterrupt):
        cluster.start()
    assert cluster.instances and not alive(cluster.instances[0].pid)


def test_missing_executable_is_a_launch_error(tmp_path: Path) -> None:
    with pytest.raises(VllmLaunchError, match="make vllm-cpu"):
        launch([cpu_spec(Role.PREFILL, free_port())], tmp_path, tmp_path / "no-such-vllm")


def test_attach_reports_an_unhealthy_instance() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503) if request.url.port == 1 else httpx.Response(200, json={"data": [{"id": "m"}]})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    assert attach({"decode": "http://d:2/"}, client=client) == {"http://d:2": ["m"]}
    with pytest.raises(VllmAttachError, match="prefill instance http://p:1: /health answered 503"):
        attach({"prefill": ["http://p:1"]}, client=client)
    with pytest.raises(ConfigError, match="unknown role"):
        attach({"middle": ["http://p:2"]}, client=client)


# --- platform facts and doctor -------------------------------------------------------------


def test_cpu_and_memory_facts_parse() -> None:
    cpuinfo = (
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma\n\nprocessor\t: 1\nflags\t: avx512f\n"
    )
    assert cpu_facts(cpuinfo) == ("AMD EPYC", True, False)
    assert memory_gib("MemTotal:       24641536 kB\nMemFree: 1 kB\nMemAvailable:   23068672 kB\n") == (23.5, 22.0)


def test_what_is_missing_names_the_fix() -> None:
    bare = PlatformReport(python="/x/bin/python", python_found=True, avx2=True, cores=2, memory_available_gib=20)
    missing = what_is_missing(bare)
    assert any("vllm is not importable" in m and "make vllm-cpu" in m for m in missing)
    assert any("nixl==1.5.1" in m for m in missing)
    ready = PlatformReport(
        python="/x/bin/python",
        python_found=True,
        vllm_importable=True,
        vllm_version="0.32.0",
        vllm_dist_version="0.32.0+cpu",
        vllm_bin="/x/bin/vllm",
        nixl_importable=True,
        avx2=True,
        cores=2,
        memory_available_gib=20,
    )
    assert what_is_missing(ready) == []
    assert any("one core per instance" in m for m in what_is_missing(PlatformReport(**{**ready.__dict__, "cores": 1})))


def test_doctor_json_on_this_machine(tmp_path: Path) -> None:
    app = typer.Typer()
    doctor.register(app)

    @app.callback()
    def root() -> None:
        pass

    result = CliRunner().invoke(app, ["doctor", "--vllm-venv", sys.prefix, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["python"] == str(Path(sys.prefix) / "bin" / "python") and report["python_found"]
    assert report["cores"] >= 1 and report["memory_total_gib"] > 0 and report["device"] in ("cpu", "cuda")
    assert isinstance(report["missing"], list)
    if not report["vllm_importable"]:
        assert any("make vllm-cpu" in m for m in report["missing"])
    missing_venv = CliRunner().invoke(app, ["doctor", "--vllm-venv", str(tmp_path / "none"), "--json"])
    assert missing_venv.exit_code == 0 and not json.loads(missing_venv.stdout)["python_found"]

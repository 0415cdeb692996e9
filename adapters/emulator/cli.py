"""The `emulate` command (shared by `sibyl-console emulate` and `python -m adapters.emulator`)."""

from __future__ import annotations

from typing import Annotated

import typer

from adapters.emulator.faults import Faults
from adapters.emulator.server import run
from adapters.emulator.settings import InstanceSettings
from core.errors import ConfigError
from core.perf import get_profile


def emulate(
    role: Annotated[str, typer.Option(help="prefill | decode | both")] = "both",
    port: Annotated[int, typer.Option(help="HTTP port (instance i of --instances uses port+i)")] = 8100,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    profile: Annotated[str, typer.Option(help="timing profile name or .json file")] = "cpu-tiny-llama",
    model: Annotated[str, typer.Option(help="served model name")] = "sibyl-model",
    max_num_seqs: Annotated[int | None, typer.Option(help="running slots (profile's if unset)")] = None,
    kv_capacity_tokens: Annotated[int | None, typer.Option(help="KV cache size in tokens (profile's if unset)")] = None,
    instances: Annotated[int, typer.Option(min=1, help="independent instances in this process")] = 1,
    output_len_dist: Annotated[str, typer.Option(help="output length without ignore_eos: uniform:A:B | fixed:N | exp:MEAN")] = "uniform:1:256",
    seed: Annotated[int, typer.Option(help="seed of output lengths and fault draws")] = 0,
    scheduling_policy: Annotated[str, typer.Option(help="fcfs | priority (lower `priority` first)")] = "fcfs",
    kv_lease_s: Annotated[float, typer.Option(help="how long a prefill instance holds KV for a pull")] = 30.0,
    kv_handshake_timeout_s: Annotated[float, typer.Option(help="decode side: give up reaching the prefill side after")] = 5.0,
    kv_load_failure_policy: Annotated[str, typer.Option(help="decode side when a pull fails: fail (500) | recompute")] = "fail",
    fail_rate: Annotated[float, typer.Option(help="fault: share of requests to fail")] = 0.0,
    fail_status: Annotated[int, typer.Option(help="fault: HTTP status of failed requests")] = 503,
    slowdown: Annotated[float, typer.Option(help="fault: multiply all step times")] = 1.0,
    hang: Annotated[bool, typer.Option(help="fault: accept requests, never answer")] = False,
    admin_token: Annotated[str | None, typer.Option(help="require this bearer token on /admin/*")] = None,
) -> None:
    """A GPU-free vLLM stand-in: vLLM 0.32's HTTP API, metrics and P/D protocol, timed by a profile.

    Serves POST /v1/completions and /v1/chat/completions (streaming and not), GET /v1/models,
    /health, /ping, /version, /load, /metrics (vLLM names and labels). Prompts: text counts as
    ceil(UTF-8 bytes / 4) tokens, token-id lists as their length, chat adds 4 tokens per message.
    Output token i is the text " t<i>". Without ignore_eos the length is drawn from
    --output-len-dist (seeded) and clamped to [min_tokens, max_tokens].

    P/D: a request with kv_transfer_params.do_remote_decode runs prefill only and answers with
    kv_transfer_params naming this instance (remote_host/remote_port = its HTTP address); the KV
    is held for --kv-lease-s. A decode request with do_remote_prefill pulls it with a real
    POST /kv/pull to that address, which takes the profile's KV-transfer time.

    Fault injection: the flags above, or at run time GET/PUT /admin/faults with
    {"fail_rate", "fail_status", "slowdown", "hang", "unhealthy"} and POST /admin/exit (the
    process exits with code 3, like a crash; with --instances N all of them go).

    Examples:
      sibyl-console emulate --role prefill --port 8100 --profile h20-qwen3-32b
      sibyl-console emulate --role decode --port 8200 --instances 4
      curl -X PUT localhost:8200/admin/faults -d '{"slowdown": 3}'
    """
    if role not in ("prefill", "decode", "both"):
        raise ConfigError(f"--role {role!r}: expected prefill, decode or both")
    if scheduling_policy not in ("fcfs", "priority"):
        raise ConfigError(f"--scheduling-policy {scheduling_policy!r}: expected fcfs or priority")
    if kv_load_failure_policy not in ("fail", "recompute"):
        raise ConfigError(f"--kv-load-failure-policy {kv_load_failure_policy!r}: expected fail or recompute")
    try:
        faults = Faults(fail_rate=fail_rate, fail_status=fail_status, slowdown=slowdown, hang=hang)
    except ValueError as e:
        raise ConfigError(f"bad fault flags: {e}") from None
    from adapters.emulator.settings import OutputLengths

    OutputLengths(output_len_dist, seed)  # validate early
    base = InstanceSettings(
        role=role, port=port, host=host, profile=get_profile(profile), model=model, max_num_seqs=max_num_seqs,  # type: ignore[arg-type]
        kv_capacity_tokens=kv_capacity_tokens, output_len_dist=output_len_dist, seed=seed, kv_lease_s=kv_lease_s,
        kv_handshake_timeout_s=kv_handshake_timeout_s, kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
        scheduling_policy=scheduling_policy, admin_token=admin_token, faults=faults,  # type: ignore[arg-type]
    )
    run(base, instances)

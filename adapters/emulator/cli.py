"""The `emulate` command (shared by `sibyl-console emulate` and `python -m adapters.emulator`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from adapters.emulator.faults import FaultConfig
from adapters.emulator.settings import InstanceSettings, LoraSettings, OutputLengths, runtime_updating_allowed
from adapters.ports import is_loopback
from core.errors import ConfigError
from core.perf import get_profile, profile_names

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The --max-lora-rank values vLLM 0.32 accepts (its MaxLoRARanks)."""

HELP = """Run GPU-free stand-ins for vLLM 0.32: its HTTP API, metrics and P/D protocol, timed by a core.perf profile.

API: POST /v1/completions and /v1/chat/completions (streaming or not, stream_options.include_usage, text or token-id \
prompts, max_tokens, ignore_eos, min_tokens, priority, seed, kv_transfer_params); GET /v1/models, /health, /ping, \
/version, /load, /metrics (vLLM's names, labels and buckets); POST /tokenize.

Tokens: a token-id prompt counts as its length; text counts as ceil(UTF-8 bytes / 4) tokens; chat counts its messages' \
text plus 4 tokens per message and 3 for the reply. Output token i is the text " t<i>". With ignore_eos a request gets \
exactly max_tokens; otherwise a length drawn from --output-len-dist (seeded; a request's `seed` field makes its draw \
reproducible), kept between min_tokens and max_tokens, finish "stop". A prompt that fits but leaves less room than \
max_tokens is cut short with finish "length".

Prefix caching (vLLM's automatic prefix caching, on unless --no-enable-prefix-caching): full KV blocks of --block-size \
tokens are keyed by a hash chain over the prompt's token ids (text prompts get stand-in ids, as POST /tokenize shows); \
a request reuses its longest cached prefix and prefills only the rest; freed blocks stay cached and are evicted LRU. \
POST /reset_prefix_cache drops the cache ({"success": false} while blocks are in use). --kv-events-config publishes \
the cache's events in vLLM's ZMQ format, with its replay socket.

Engine: continuous batching with --max-num-seqs slots and a FIFO (or priority) waiting queue, chunked prefill within \
--max-num-batched-tokens, KV in blocks of the profile's block size, preemption by recompute. A step of B sequences \
holding K KV tokens lasts step_time(B, K) plus the prefill of the prompt chunks it carries; each token is sent when \
its step ends.

P/D (vLLM's NIXL pull protocol): a request with kv_transfer_params.do_remote_decode runs prefill only and answers one \
token plus kv_transfer_params naming this instance (remote_host and remote_port are its own HTTP address); its blocks \
stay allocated for --kv-lease-s. A decode request carrying those params pulls them with a real POST /kv/pull to that \
address, which takes the profile's KV-transfer time. Nothing listening there: 500 after --kv-handshake-timeout-s, or \
with --kv-load-failure-policy recompute (or that key in kv_transfer_params) the prompt is computed locally. Expired \
blocks or a lost prefill engine: 500 at once.

LoRA (vLLM's flags): --enable-lora serves adapters as models; with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true in the \
environment, POST /v1/load_lora_adapter {"lora_name", "lora_path"} (a directory with a PEFT adapter_config.json) and \
/v1/unload_lora_adapter {"lora_name"} answer as vLLM's. /v1/models lists loaded adapters with their `parent`; a \
request whose `model` is one runs under it (its prefix-cache keys and KV events carry its name). --max-cpu-loras \
adapters stay resident (LRU); a load or a reload of an evicted one stalls the engine for the profile's lora_load_s; at \
most --max-loras distinct adapters run in one step, each adding lora_per_adapter_step_s; vllm:lora_requests_info \
shows the running and waiting adapters.

Faults: the flags below, or at run time GET/PUT /admin/faults with {"fail_rate", "fail_status", "slowdown", "hang", \
"kv_pull_hang", "unhealthy", "exit_after_requests", "exit_after_s"} and POST /admin/exit (the process exits with \
status 3 like a crash; with --instances N all of them go). GET /admin/info and /admin/steps show the instance and its \
step log. --admin-token protects /admin/.

Examples:

  sibyl-console emulate --role prefill --port 8100 --profile h20-qwen3-32b
  sibyl-console emulate --role decode --port 8200 --instances 4
  sibyl-console emulate --port 8300 --output-len-dist exp:200 --seed 7
  curl -X PUT localhost:8200/admin/faults -d '{"slowdown": 3}'
  curl -X PUT localhost:8200/admin/faults -d '{"fail_rate": 0.2}'
  curl -X POST localhost:8200/admin/exit
"""


def emulate(
    role: Annotated[
        str,
        typer.Option(help="prefill | decode | both (a label: like vLLM's kv_both, every instance serves both legs)"),
    ] = "both",
    port: Annotated[int, typer.Option(help="HTTP port (instance i of --instances uses port+i)")] = 8100,
    host: Annotated[
        str, typer.Option(help="address to bind (also advertised as remote_host for KV pulls)")
    ] = "127.0.0.1",
    profile: Annotated[
        str, typer.Option(help="timing profile: a built-in name (see below) or a profile .json file")
    ] = "cpu-tiny-llama",
    model: Annotated[str, typer.Option(help="served model name")] = "sibyl-model",
    max_num_seqs: Annotated[int | None, typer.Option(min=1, help="running slots (profile's if unset)")] = None,
    kv_capacity_tokens: Annotated[
        int | None, typer.Option(min=1, help="KV cache size in tokens (profile's if unset)")
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(min=1, help="token budget per step, chunked prefill [default: the profile's]")
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option(min=2, help="context length (profile's if unset; cut to the KV capacity)")
    ] = None,
    instances: Annotated[
        int, typer.Option(min=1, help="independent instances in this process, on consecutive ports")
    ] = 1,
    output_len_dist: Annotated[
        str, typer.Option(help="output length without ignore_eos: uniform:A:B | fixed:N | exp:MEAN | normal:MEAN:STD")
    ] = "uniform:1:256",
    seed: Annotated[int, typer.Option(help="seed of output lengths and fault draws (instance i uses seed+i)")] = 0,
    scheduling_policy: Annotated[
        str, typer.Option(help="fcfs | priority (lower `priority` first, ties by arrival)")
    ] = "fcfs",
    kv_lease_s: Annotated[float, typer.Option(min=0.001, help="prefill side: how long KV waits to be pulled")] = 30.0,
    kv_handshake_timeout_s: Annotated[
        float, typer.Option(min=0.0, help="decode side: give up reaching a prefill side after")
    ] = 5.0,
    kv_load_failure_policy: Annotated[
        str, typer.Option(help="decode side when a pull fails: fail (500) | recompute")
    ] = "fail",
    fail_rate: Annotated[float, typer.Option(help="fault: share of generation requests to fail")] = 0.0,
    fail_status: Annotated[int, typer.Option(help="fault: HTTP status of failed requests")] = 503,
    slowdown: Annotated[float, typer.Option(help="fault: multiply all step and KV-transfer times")] = 1.0,
    hang: Annotated[bool, typer.Option(help="fault: accept requests, answer none until cleared")] = False,
    unhealthy: Annotated[bool, typer.Option(help="fault: /health answers 503")] = False,
    exit_after_requests: Annotated[
        int | None, typer.Option(help="fault: exit when the Nth generation request arrives")
    ] = None,
    exit_after_s: Annotated[float | None, typer.Option(help="fault: exit this many seconds after start")] = None,
    admin_token: Annotated[str | None, typer.Option(help="require `Authorization: Bearer TOKEN` on /admin/*")] = None,
    writer_threads: Annotated[
        int, typer.Option(min=1, help="threads writing a step's tokens when 64+ streams release at once")
    ] = 2,
    data_parallel_size: Annotated[
        int,
        typer.Option(
            min=1,
            max=256,
            help="ranks of a data-parallel group that step together behind a barrier "
            "(each with --max-num-seqs slots and its own KV); a request picks one with the X-data-parallel-rank header",
        ),
    ] = 1,
    block_size: Annotated[
        int | None, typer.Option(min=1, help="tokens per KV block, like vLLM's --block-size [default: the profile's]")
    ] = None,
    enable_prefix_caching: Annotated[
        bool,
        typer.Option(
            "--enable-prefix-caching/--no-enable-prefix-caching",
            help="automatic prefix caching of full blocks (vLLM's default: on)",
        ),
    ] = True,
    kv_events_config: Annotated[
        str | None,
        typer.Option(
            help="vLLM's --kv-events-config JSON: publish BlockStored/BlockRemoved/AllBlocksCleared over ZMQ, e.g. "
            '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' '
            "(with --instances N, instance i offsets the ports by i)"
        ),
    ] = None,
    enable_prompt_tokens_details: Annotated[
        bool, typer.Option(help="report usage.prompt_tokens_details.cached_tokens, like vLLM's flag")
    ] = False,
    otlp_traces_endpoint: Annotated[
        str | None,
        typer.Option(
            help="like vLLM's flag: each request ends with an `llm_request` span, a child of its traceparent, exported "
            "to this OTLP receiver (needs the `tracing` extra)"
        ),
    ] = None,
    otlp_traces_protocol: Annotated[
        str, typer.Option(help="http/protobuf (an http://HOST:PORT endpoint gets /v1/traces) | grpc")
    ] = "http/protobuf",
    host_board: Annotated[
        Path | None,
        typer.Option(
            help="a host board file the instances on this host share: each writes what it streams, and a prefill "
            "step takes the profile's host_stretch of the host's total longer (the `emulator` backend sets it)"
        ),
    ] = None,
    host_slot: Annotated[
        int, typer.Option(min=0, help="this instance's slot on --host-board (instance i of --instances: slot+i)")
    ] = 0,
    enable_lora: Annotated[
        bool, typer.Option("--enable-lora", help="serve LoRA adapters as models, like vLLM's flag")
    ] = False,
    max_loras: Annotated[int, typer.Option(min=1, help="most distinct LoRA adapters in one step")] = 1,
    max_lora_rank: Annotated[
        int, typer.Option(help="largest adapter rank a load accepts: one of " + ", ".join(map(str, LORA_RANKS)))
    ] = 16,
    max_cpu_loras: Annotated[
        int | None, typer.Option(min=1, help="adapters kept loaded, evicted LRU (>= --max-loras) [default: max-loras]")
    ] = None,
) -> None:
    """Run GPU-free stand-ins for vLLM 0.32 (see HELP)."""
    if role not in ("prefill", "decode", "both"):
        raise ConfigError(f"--role {role!r}: expected prefill, decode or both")
    if scheduling_policy not in ("fcfs", "priority"):
        raise ConfigError(f"--scheduling-policy {scheduling_policy!r}: expected fcfs or priority")
    if otlp_traces_protocol not in ("http/protobuf", "grpc"):
        raise ConfigError(f"--otlp-traces-protocol {otlp_traces_protocol!r}: expected http/protobuf or grpc")
    if kv_load_failure_policy not in ("fail", "recompute"):
        raise ConfigError(f"--kv-load-failure-policy {kv_load_failure_policy!r}: expected fail or recompute")
    if max_lora_rank not in LORA_RANKS:
        raise ConfigError(f"--max-lora-rank {max_lora_rank}: expected one of {', '.join(map(str, LORA_RANKS))}")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise ConfigError(f"--max-cpu-loras ({max_cpu_loras}) must be >= --max-loras ({max_loras})")
    try:
        faults = FaultConfig(
            fail_rate=fail_rate,
            fail_status=fail_status,
            slowdown=slowdown,
            hang=hang,
            unhealthy=unhealthy,
            exit_after_requests=exit_after_requests,
            exit_after_s=exit_after_s,
        )
    except ValueError as e:
        raise ConfigError(f"bad fault flags: {e}") from None
    OutputLengths(output_len_dist, seed)  # validate before starting anything
    from adapters.vllm.kv_wire import KVEventsConfig

    kv_events = KVEventsConfig.parse(kv_events_config)
    if not is_loopback(host) and not admin_token:
        print(
            f"emulate: warning: bound to {host} without --admin-token: "
            "anyone who can reach it can inject faults or stop it "
            "through /admin/ (bind 127.0.0.1, or set --admin-token)",
            file=sys.stderr,
        )
    base = InstanceSettings(
        role=role,  # type: ignore[arg-type]
        port=port,
        host=host,
        profile=get_profile(profile),
        model=model,
        max_num_seqs=max_num_seqs,
        kv_capacity_tokens=kv_capacity_tokens,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        output_len_dist=output_len_dist,
        seed=seed,
        kv_lease_s=kv_lease_s,
        kv_handshake_timeout_s=kv_handshake_timeout_s,
        kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
        scheduling_policy=scheduling_policy,  # type: ignore[arg-type]
        admin_token=admin_token,
        faults=faults,
        writer_threads=writer_threads,
        data_parallel_size=data_parallel_size,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        kv_events=kv_events,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        otlp_traces_endpoint=otlp_traces_endpoint,
        otlp_traces_protocol=otlp_traces_protocol,  # type: ignore[arg-type]
        host_board=str(host_board) if host_board else None,
        host_slot=host_slot,
        lora=LoraSettings(
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            allow_runtime_updating=runtime_updating_allowed(),
        ),
    )
    from adapters.emulator.server import run  # uvicorn and the app load only when serving

    run(base, instances)


emulate.__doc__ = HELP + "\nProfiles: " + ", ".join(profile_names()) + "\n"

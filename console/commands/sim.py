"""`sibyl-console sim`: simulate a trace offline under several routing policies and compare them."""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from console.commands.options import DbOpt, ParamOpt, ParamsJsonOpt
from console.commands.params import params_for, policy_params
from core.errors import ConfigError

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from core.sim.cluster import CacheParams
    from core.types import PolicyKind

# The simulator, the trace readers and rich load inside the command (not for `--help` or other commands).

FORMATS = "auto|mooncake|azure|burstgpt|servegen"


def _load_trace(
    trace: Path | None,
    fmt: str,
    workload: str,
    requests: int,
    rate: float | None,
    rate_scale: float,
    limit: int | None,
    seed: int,
    burstiness: float,
) -> Any:
    from core.traces import read_trace, synthetic_trace

    if trace is not None:
        t = read_trace(trace, fmt, seed=seed, limit=limit)
        if rate is not None:
            t = t.with_rate(rate)
    else:
        t = synthetic_trace(
            workload,
            requests=limit or requests,
            rate=rate or 10.0,
            seed=seed,
            burstiness=burstiness,
        )
    if rate_scale != 1.0:
        if rate_scale <= 0:
            raise ConfigError("--rate-scale must be > 0")
        t = t.scale_time(1.0 / rate_scale)
    if limit is not None and len(t) > limit:
        t = t.window(limit=limit)
    if len(t) == 0:
        raise ConfigError("the workload has no requests")
    return t


def with_lora_mix(t: Any, adapters: int | None, skew: float, seed: int) -> Any:
    """The trace with a synthetic LoRA mix (`--lora-adapters N --lora-skew S`: Zipf(S) over N adapter names,
    seeded by --seed) replacing any `lora` column it has; unchanged without --lora-adapters."""
    if adapters is None:
        return t
    from core.traces.lora import zipf_mix

    mix = zipf_mix(len(t), adapters, skew, seed)
    return t.with_lora(mix, f"lora mix: Zipf({skew:g}) over {adapters} adapters, seed {seed}")


LoraAdaptersOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="give each request one of N LoRA adapters (lora-00 ... ), Zipf-distributed by --lora-skew, seeded "
        "by --seed; replaces a trace's `lora` column",
    ),
]
LoraSkewOpt = Annotated[
    float, typer.Option(min=0.0, help="Zipf exponent of --lora-adapters (0: uniform; 1: the k-th adapter ∝ 1/k)")
]


def _advance(progress: Progress, task: TaskID, _policy: str, done: int, _total: int) -> None:
    progress.update(task, completed=done)


def _policy_list(
    policies: list[str],
    params: list[str],
    others: dict[PolicyKind, str] | None = None,
    params_json: list[str] | None = None,
) -> tuple[list[tuple[str, dict[str, Any]]], dict[PolicyKind, tuple[str, dict[str, Any]]]]:
    """Routing policies to compare, and the queue/reschedule/scaling policy every run uses.

    `--param name.key=value` (`--params-json 'name={...}'`) goes to the policy called `name` (of
    any kind); an unprefixed `key=value` (`{...}`) goes to every routing policy.
    """
    from console.offline.simulate import validate_policies

    assigned = policy_params(params, params_json or ())
    names = policies or ["prefix_aware", "sibyl", "least_load", "round_robin"]
    other_names = dict(others or {})
    unknown = set(assigned) - set(names) - set(other_names.values()) - {""}
    if unknown:
        running = names + list(other_names.values())
        raise ConfigError(
            f"--param names policies not being run: {', '.join(sorted(unknown))}; running: {', '.join(running)}"
        )
    out = [(n, params_for(assigned, n)) for n in names]
    kinds = {k: (n, dict(assigned.get(n, {}))) for k, n in other_names.items()}
    validate_policies(out, kinds)
    return out, kinds


def _cache_params(
    t: Any, on: bool, block_size: int | None, hash_block_tokens: int, cache_blocks: int | None, source: str
) -> tuple[CacheParams | None, list[str] | None]:
    """The cache model of a run and the sessions it routes by: None for a trace without prefix
    hashes (nothing could be shared, so the run is what it always was)."""
    from console.offline.simulate import PREFIX_SOURCES
    from core.sim.cluster import CacheParams

    if source not in PREFIX_SOURCES:
        raise ConfigError(f"--prefix-source {source!r}: expected {' or '.join(PREFIX_SOURCES)}")
    if block_size is not None and block_size < 1:
        raise ConfigError("--block-size must be >= 1")
    if hash_block_tokens < 1:
        raise ConfigError("--hash-block-tokens must be >= 1")
    if cache_blocks is not None and cache_blocks < 1:
        raise ConfigError("--cache-blocks must be >= 1")
    if getattr(t, "hash_ids", None) is None:
        return None, None
    if not on:
        return CacheParams(enabled=False), None
    sessions = t.with_sessions().session
    return (
        CacheParams(block_size=block_size, capacity_blocks=cache_blocks, hash_block_tokens=hash_block_tokens),
        [str(x) for x in sessions.tolist()],
    )


def sim(
    trace: Annotated[
        Path | None,
        typer.Argument(help="trace file or ServeGen folder; omit for a synthetic --workload"),
    ] = None,
    format: Annotated[str, typer.Option("--format", help=f"trace format: {FORMATS}")] = "auto",
    workload: Annotated[
        str,
        typer.Option(help="synthetic workload when no TRACE: random|reasoning-chat|reasoning-code"),
    ] = "reasoning-chat",
    requests: Annotated[int, typer.Option(min=1, help="synthetic request count")] = 2000,
    rate: Annotated[float | None, typer.Option(help="arrival rate req/s (synthetic; or rescales a trace)")] = None,
    burstiness: Annotated[float, typer.Option(help="gamma burstiness of synthetic arrivals (1 = Poisson)")] = 1.0,
    rate_scale: Annotated[float, typer.Option(help="multiply the arrival rate by X")] = 1.0,
    limit: Annotated[int | None, typer.Option(min=1, help="use at most N requests")] = None,
    cluster: Annotated[str, typer.Option(help="instances as <P>P<D>D")] = "4P16D",
    profile: Annotated[str, typer.Option(help="performance profile name or .json path")] = "h20-qwen3-32b",
    mode: Annotated[str, typer.Option(help="decode model: ps (processor sharing) | iteration")] = "ps",
    policy: Annotated[
        list[str],
        typer.Option(
            "--policy", help="routing policy to run (repeat; default prefix_aware, sibyl, least_load, round_robin)"
        ),
    ] = [],  # noqa: B006
    param: ParamOpt = [],  # noqa: B006
    params_json: ParamsJsonOpt = [],  # noqa: B006
    queue: Annotated[str, typer.Option("--queue", help="queue (admission) policy: fcfs | priority")] = "fcfs",
    scaling: Annotated[
        str,
        typer.Option(
            "--scaling", help="scaling policy: static | threshold | hyperflexis (see `policy list --kind scaling`)"
        ),
    ] = "static",
    reschedule: Annotated[
        str,
        typer.Option(
            "--reschedule",
            help="reschedule policy: none | current_load | ares | ares_oracle (see `policy list --kind reschedule`)",
        ),
    ] = "none",
    seed: Annotated[int, typer.Option(help="seed for synthetic/ServeGen sampling")] = 0,
    slo_ttft_ms: Annotated[float, typer.Option(help="TTFT SLO in ms")] = 2000.0,
    slo_tpot_ms: Annotated[float, typer.Option(help="TPOT SLO in ms")] = 100.0,
    shadow: Annotated[bool, typer.Option(help="score the other policies in shadow mode")] = True,
    prefix_cache: Annotated[
        bool,
        typer.Option(
            "--prefix-cache/--no-prefix-cache",
            help="model each instance's prefix cache (on for traces with prefix hashes, e.g. Mooncake; "
            "other traces never share a prefix)",
        ),
    ] = True,
    block_size: Annotated[
        int | None, typer.Option(help="tokens per KV block of the modelled cache (default: the profile's)")
    ] = None,
    hash_block_tokens: Annotated[int, typer.Option(help="tokens per trace hash block (Mooncake: 512)")] = 512,
    cache_blocks: Annotated[
        int | None,
        typer.Option(help="KV blocks cached per instance (default: the profile's KV capacity)"),
    ] = None,
    prefix_source: Annotated[
        str,
        typer.Option(
            help="what prefix-aware policies read: precise (the exact caches, as KV events give "
            "them) | approximate (the router's own past decisions)"
        ),
    ] = "precise",
    lora_adapters: LoraAdaptersOpt = None,
    lora_skew: LoraSkewOpt = 1.0,
    max_loras: Annotated[
        int,
        typer.Option(
            min=1,
            help="LoRA adapter slots of each simulated instance (vLLM's --max-loras; adapters one batch runs "
            "and the instance keeps, least recently used evicted); only with adapters",
        ),
    ] = 4,
    db: DbOpt = None,
    no_db: Annotated[bool, typer.Option("--no-db", help="do not record the runs")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print a JSON list, one object per policy")] = False,
) -> None:
    """Simulate a workload on a P/D cluster under each --policy, on identical arrivals.

    Examples:
      sibyl-console sim --workload reasoning-chat --requests 5000 --rate 12 --cluster 8P64D
      sibyl-console sim ../shared/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv --limit 2000 \\
          --cluster 4P16D --policy sibyl --policy least_load --param least_load.by=tokens --json
      sibyl-console sim ../shared/traces/mooncake_fast25/conversation_trace.jsonl --limit 3000 \
          --rate 6.5 --cluster 4P4D --profile roofline-h100-qwen2.5-7b --policy least_load \
          --policy prefix_aware --prefix-source precise

    A trace with prefix hashes (Mooncake) gives every instance a prefix cache (off with
    --no-prefix-cache): a prefill computes only what its instance has not cached, the decode
    instance pulls only the blocks it lacks; the table adds the hit rate and the KV moved.

    Requests under LoRA adapters (a trace's `lora` column, or --lora-adapters N --lora-skew S) make each
    instance hold at most --max-loras adapters: loading one stalls the instance for the profile's
    lora_load_s, and each distinct adapter in a step adds lora_per_adapter_step_s. Wrap a routing
    policy in lora_affinity (--policy lora_affinity --param lora_affinity.routing=sibyl) to route by
    residency; the JSON adds adapter loads (per minute), hits and evictions.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from console.commands.sim_table import results_table
    from console.offline.simulate import SimPlan, json_safe, run_one, store_result
    from core.cluster_spec import parse_cluster
    from core.perf import get_profile
    from core.slo import SLOClass
    from core.types import PolicyKind

    if mode not in ("ps", "iteration"):
        raise ConfigError(f"--mode {mode!r}: expected ps or iteration")
    n_prefill, n_decode = parse_cluster(cluster)
    prof = get_profile(profile)
    policies, kinds = _policy_list(
        policy,
        param,
        {PolicyKind.QUEUE: queue, PolicyKind.RESCHEDULE: reschedule, PolicyKind.SCALING: scaling},
        params_json,
    )
    t = _load_trace(trace, format, workload, requests, rate, rate_scale, limit, seed, burstiness)
    t = with_lora_mix(t, lora_adapters, lora_skew, seed)
    cache, sessions = _cache_params(t, prefix_cache, block_size, hash_block_tokens, cache_blocks, prefix_source)
    plan = SimPlan(
        arrivals=t.arrivals,
        prompt_tokens=t.prompt_tokens,
        output_tokens=t.output_tokens,
        workload=t.name,
        profile=prof,
        n_prefill=n_prefill,
        n_decode=n_decode,
        mode=mode,  # type: ignore[arg-type]
        policies=policies,
        slo=SLOClass(ttft_s=slo_ttft_ms / 1000, tpot_s=slo_tpot_ms / 1000),
        seed=seed,
        shadow=shadow,
        queue=kinds[PolicyKind.QUEUE],
        reschedule=kinds[PolicyKind.RESCHEDULE],
        scaling=kinds[PolicyKind.SCALING],
        priorities=getattr(t, "priority", None),
        hash_ids=getattr(t, "hash_ids", None) if cache is not None else None,
        sessions=sessions,
        cache=cache,
        prefix_source=prefix_source,  # type: ignore[arg-type]
        lora=t.lora,
        max_loras=max_loras,
    )
    store = None
    if not no_db:
        from adapters.store import RunStore

        store = RunStore(db)
        store.mark_interrupted_runs()
    err = Console(stderr=True)
    rows: list[dict[str, Any]] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=as_json,
    ) as progress:
        for name, params in policies:
            task = progress.add_task(f"{name:>12}", total=len(plan.arrivals))
            run_id = None
            if store is not None:
                run_id = store.create_run(
                    kind="sim",
                    backend="sim",
                    cluster=plan.cluster,
                    workload=t.source or t.name,
                    seed=seed,
                    policy=name,
                    config={
                        "profile": prof.name,
                        "mode": mode,
                        "policy": name,
                        "params": params,
                        "queue": {"name": plan.queue[0], "params": plan.queue[1]},
                        "reschedule": {"name": plan.reschedule[0], "params": plan.reschedule[1]},
                        "scaling": {"name": plan.scaling[0], "params": plan.scaling[1]},
                        "slo": plan.slo.model_dump(),
                        "requests": len(plan.arrivals),
                        **({} if t.lora is None else {"max_loras": max_loras, "adapters": len(set(t.lora) - {None})}),
                        **(
                            {}
                            if cache is None
                            else {"prefix_cache": {**dataclasses.asdict(cache), "source": prefix_source}}
                        ),
                    },
                )
            try:
                row, result = run_one(
                    plan,
                    name,
                    params,
                    partial(_advance, progress, task),
                )
            except BaseException:
                if store is not None and run_id is not None:
                    store.finish_run(run_id, status="failed")
                raise
            row["run_id"] = run_id
            if store is not None and run_id is not None:
                store_result(store, run_id, result, plan.slo, row)
            rows.append(row)
    if as_json:
        typer.echo(json.dumps(json_safe(rows), indent=2))
    else:
        out = Console()
        out.print(results_table(rows, out.width))


def register(app: typer.Typer) -> None:
    app.command("sim")(sim)

"""`sibyl-console bench`: measure the dispatcher's routing and rank decision latency."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from console.commands.options import ParamOpt, ParamsJsonOpt
from console.commands.params import params_for, policy_params
from core.errors import PolicyError

# The dispatcher, the policies and rich load inside the commands.


def _print_latencies(title: str, count_label: str, count_key: str, rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("policy", count_label, "mean µs", "p50 µs", "p99 µs", "max µs"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    for r in rows:
        table.add_row(
            str(r["policy"]), str(r[count_key]), *(f"{r[k]:.1f}" for k in ("mean_us", "p50_us", "p99_us", "max_us"))
        )
    Console().print(table)


bench_app = typer.Typer(help="Benchmarks of the console's own hot paths.", no_args_is_help=True)


@bench_app.command("decision")
def decision(
    policy: Annotated[
        list[str], typer.Option("--policy", help="routing policy, optionally NAME:key=value,... (repeat to compare)")
    ] = ["sibyl"],  # noqa: B006
    param: ParamOpt = [],  # noqa: B006
    params_json: ParamsJsonOpt = [],  # noqa: B006
    decode_instances: Annotated[int, typer.Option(min=1)] = 64,
    prefill_instances: Annotated[int, typer.Option(min=1)] = 4,
    running_per_instance: Annotated[int, typer.Option(min=0)] = 64,
    pending_per_instance: Annotated[int, typer.Option(min=0)] = 4,
    iterations: Annotated[int, typer.Option(min=10)] = 3000,
    profile: Annotated[str, typer.Option()] = "h20-qwen3-32b",
    prefix_tokens: Annotated[
        int,
        typer.Option(
            min=0,
            help="requests carry the block keys of prompts this long, and every prefill instance's cache is "
            "known from KV events (each holding those prompts to a different depth): the prefix scorer's "
            "lookup is timed too (0: no prefix keys)",
        ),
    ] = 0,
    prefix_blocks: Annotated[
        int, typer.Option(min=1, help="cached blocks per prefill instance, with --prefix-tokens")
    ] = 100_000,
    as_json: Annotated[
        bool, typer.Option("--json", help="print JSON (one object, or a list for several policies)")
    ] = False,
) -> None:
    """Time one routing decision on a loaded cluster (p50/p99 in microseconds).

    Example: sibyl-console bench decision --policy sibyl --decode-instances 64 \\
        --running-per-instance 64 --pending-per-instance 4 --json
    Compare settings of one policy: --policy sibyl --policy sibyl:horizon=lifetime
    With the prefix scorer: --policy prefix_aware --prefill-instances 64 --prefix-tokens 32768
    """
    from console.offline.benchmarking import add_prefix_caches, decision_latency, loaded_dispatcher
    from core.perf import get_profile
    from core.policies import parse_policy_spec

    prof = get_profile(profile)
    assigned = policy_params(param, params_json)
    rows = []
    for spec in policy:
        try:
            name, inline = parse_policy_spec(spec)
        except PolicyError as e:
            raise typer.BadParameter(str(e)) from None
        params = {**params_for(assigned, name), **inline}
        d = loaded_dispatcher(
            prof,
            name,
            params,
            prefill_instances=prefill_instances,
            decode_instances=decode_instances,
            running_per_instance=running_per_instance,
            pending_per_instance=pending_per_instance,
        )
        prompts = add_prefix_caches(d, prefix_tokens, prefix_blocks) if prefix_tokens else None
        rows.append(
            {
                "policy": spec,
                "params": params,
                "decode_instances": decode_instances,
                "prefill_instances": prefill_instances,
                "prefix_tokens": prefix_tokens,
                **decision_latency(d, iterations, prefix_prompts=prompts),
            }
        )
    if as_json:
        typer.echo(json.dumps(rows[0] if len(rows) == 1 else rows, indent=2))
        return
    _print_latencies(
        f"routing decision latency: {prefill_instances} prefill, {decode_instances} decode × "
        f"{running_per_instance} running + {pending_per_instance} pending"
        + (
            f"; prefix lookup of {prefix_tokens}-token prompts, {prefix_blocks} blocks cached per prefill"
            if prefix_tokens
            else ""
        ),
        "tracked",
        "tracked_requests",
        rows,
    )


@bench_app.command("rank")
def rank(
    policy: Annotated[
        list[str],
        typer.Option(
            "--policy", help="rank policy fcfs | jsq | bf_io, optionally NAME:key=value,... (repeat to compare)"
        ),
    ] = ["bf_io"],  # noqa: B006
    ranks: Annotated[int, typer.Option(min=1, help="data-parallel ranks G")] = 64,
    slots: Annotated[int, typer.Option(min=1, help="running slots per rank B")] = 72,
    waiting: Annotated[int, typer.Option(min=1, help="requests in the central pool")] = 256,
    free_per_rank: Annotated[int, typer.Option(min=0, help="free slots per rank at the decision")] = 4,
    rounds: Annotated[int, typer.Option(min=10, help="random states timed")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Time one admission round of a data-parallel rank policy (BF-IO's target: ≤ 1 ms at 64 ranks × 256 waiting).

    Example: sibyl-console bench rank --policy bf_io --policy bf_io:horizon=40 --policy jsq
    """
    from console.offline.benchmarking import rank_decision_latency
    from core.policies import parse_policy_spec

    rows = []
    for spec in policy:
        try:
            name, inline = parse_policy_spec(spec)
            rows.append(
                {
                    "policy": spec,
                    **rank_decision_latency(
                        name,
                        dict(inline),
                        ranks=ranks,
                        slots=slots,
                        waiting=waiting,
                        free_per_rank=free_per_rank,
                        states=rounds,
                    ),
                }
            )
        except (PolicyError, ValueError, TypeError) as e:
            raise typer.BadParameter(f"--policy {spec!r}: {e}") from None
    if as_json:
        typer.echo(json.dumps(rows[0] if len(rows) == 1 else rows, indent=2))
        return
    _print_latencies(
        f"rank decision latency: {ranks} ranks × {slots} slots ({free_per_rank} free each), {waiting} waiting",
        "admitted",
        "admitted",
        rows,
    )


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")

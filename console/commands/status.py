"""`sibyl-console status` and `sibyl-console policy ...`: scriptable views of a running console."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from console.commands.options import JsonOpt, ParamOpt, ParamsJsonOpt, TokenOpt, UrlOpt
from console.commands.params import params_for, policy_params
from core.errors import ConfigError

if TYPE_CHECKING:
    from rich.table import Table

    from console.control_client import ControlClient
    from console.live.state import ConsoleState, QueueState

# What a command needs is imported inside it (rich, httpx, the state model, the policy registry):
# `--help`, `scale` or `policy set` then load none of what `status` or `policy list` need.

policy_app = typer.Typer(help="List and hot-swap the console's policies.", no_args_is_help=True)


def _control(url: str | None, token: str | None) -> ControlClient:
    """A client of the console's control API (httpx loads only when a command calls the console)."""
    from console.control_client import ControlClient

    return ControlClient(url, token)


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(x: Any) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def only_pool(s: ConsoleState, name: str) -> ConsoleState:
    """The state with only pool `name`'s instances, pool entry and queue (its admission and refusals; the
    rest is the console's, unchanged);
    a ConfigError naming the pools when the console runs none of that name."""
    pools = s.pools or {}
    if name not in pools:
        raise ConfigError(f"no pool {name!r}; pools: {', '.join(pools) or '(the console reports none)'}")
    members = set(pools[name].instances)
    kept = [i for i in s.instances if i.pool == name or (i.pool is None and i.id in members)]
    queue = pools[name].queue if pools[name].queue is not None else s.queue
    return s.model_copy(update={"instances": kept, "pools": {name: pools[name]}, "queue": queue})


def status(
    pool: Annotated[
        str | None,
        typer.Option(
            "--pool",
            help="only this pool's instances, policies and adapters (one pool per base model); the queue, "
            "tenant and SLO figures stay the whole console's",
        ),
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show instances, active policies and SLO attainment of a running console.

    Examples:
      sibyl-console status --json | jq '.instances[] | select(.healthy | not)'
      sibyl-console status --pool B      (one pool of a console with several: its instances, e.g. B.p0)
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from console.live.state import ConsoleState

    client = _control(url, token)
    s = ConsoleState.model_validate(client.state())
    every_pool = list(s.pools or {})
    if pool is not None:
        s = only_pool(s, pool)
    if as_json:
        typer.echo(json.dumps(s.to_json(), indent=2))
        return
    con = Console()
    req = s.requests
    con.print(
        f"run [bold]{s.run_id}[/]  backend {s.backend}  cluster {s.cluster}  up {s.uptime_s:.0f}s  "
        f"requests {req.total} ({req.in_flight} in flight, {req.failed} failed)"
    )
    pools = s.pools or {}
    if len(pools) > 1 or pool is not None:  # each pool its own policies
        for name, p in pools.items():
            listed = ", ".join(f"{k}={v.name}{v.params or ''}" for k, v in p.policies.items())
            con.print(f"pool {name} ({p.model}, {p.cluster or '-'}) policies: {listed}")
    else:
        con.print("policies: " + ", ".join(f"{k}={v.name}{v.params or ''}" for k, v in s.policies.items()))
    t = Table()
    by_pool = len(pools) > 1 or any(p.adapters for p in pools.values())
    columns = ("id", "role", "healthy", "running", "waiting", "backlog", "KV", "tok/s", "load", "url")
    for col in ("pool",) * by_pool + columns:
        t.add_column(col)
    order = list(pools)
    for i in sorted(s.instances, key=lambda r: order.index(r.pool) if r.pool in order else len(order)):
        t.add_row(
            *(i.pool or "-",) * by_pool,
            i.id,
            i.role,
            "yes" if i.healthy else "[red]DOWN[/]",
            str(i.running),
            str(i.waiting),
            "-" if i.backlog_s is None else f"{i.backlog_s:.2f} s",
            _pct(i.kv_usage),
            f"{i.tokens_per_s or 0.0:.0f}",
            "-" if i.projected_load is None else f"{i.projected_load:.0f}",
            i.url,
        )
    con.print(t)
    for name, p in pools.items():
        if p.adapters:
            held = "; ".join(f"{a} on {', '.join(v['instances']) or '-'}" for a, v in p.adapters.items())
            c = p.lora_counts
            con.print(
                f"pool {name} ({p.model}) adapters: {escape(held)}  \\[hits {c.get('hits', 0)}, "  # \\[: not markup
                f"misses {c.get('misses', 0)}, loads {c.get('loads', 0)}, evictions {c.get('evictions', 0)}]"
            )
    w, r = s.slo.window, s.slo.run
    calibrated = any(i.calibration is not None for i in s.instances)
    if pool is not None:  # the pool's own figures first, then the console's (the state keeps those per console)
        if calibrated:
            con.print(_calibration_table(s))
        if len(every_pool) > 1:
            con.print(f"below: pool {pool}'s queue, admission and refusals; tenants and SLO attainment of all pools")
    if s.queue is not None:
        q = s.queue
        con.print(queue_line(q))
        if q.refusals is not None:
            con.print(refusals_line(q.refusals))
    if calibrated and pool is None:
        con.print(_calibration_table(s))
    if s.tenants is not None and s.tenants.required:
        con.print(_tenant_table(s))
    con.print(
        f"SLO last {s.slo.window_s:.0f}s: attainment {_pct(w.attainment)}  TTFT "
        f"p50/p99 {_ms(w.ttft_p50)}/{_ms(w.ttft_p99)} ms  TPOT p50/p99 "
        f"{_ms(w.tpot_p50)}/{_ms(w.tpot_p99)} ms   run: attainment {_pct(r.attainment)}"
    )


def queue_line(q: QueueState) -> str:
    """The gateway's queue and SLO admission's limits in force (its margin among them)."""
    a = q.admission
    held = (
        f"queue {q.depth} held (max {q.max_queued}, ttl {q.ttl_s:g} s)"
        if q.ttl_s is not None
        else f"queue {q.depth} held"
    )
    if a:
        held += (
            f"; SLO admission: {a['decode_slots']} decode slots per instance, "
            f"~{a['prefill_s_per_request']:g} s prefill per request, wait bound {a['wait_bound_s']:g} "
            f"s (TTFT + {a['extra_wait_s']:g} s); shed {a['shed']}, expired {a['expired']}"
        )
        if a.get("local_prefill"):
            held += f"; prefill on decode: {a['served_on_decode']} served there"
        if a.get("ttft_attainment_goal", 1.0) < 1.0:  # the margin moves: where it stands now
            held += (
                f"; margin {a['margin']:g} (headroom {a['headroom']:g} to 1, for "
                f"{a['ttft_attainment_goal']:.0%} of the admitted within TTFT)"
            )
    else:
        held += f"; SLO admission off ({q.max_in_flight_per_instance} in flight per decode instance)"
    return held


def refusals_line(refusals: dict[str, Any]) -> str:
    """Admission's refusals by cause, each with the last one's projected start against its bound."""
    parts = []
    for cause, r in refusals.items():
        if not r.count:
            continue
        label = "KV cache full" if cause == "kv" else cause.replace("_", " ")
        if cause == "tenant_limit":
            parts.append(f"{label} {r.count}")
        else:
            parts.append(f"{label} {r.count} (last projected {r.last_projected_s:.2f} s against {r.bound_s:.2f} s)")
    return "refused by cause: " + ("; ".join(parts) if parts else "none")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _calibration_table(s: ConsoleState) -> Table:
    """Per instance and fitted term: the value it is projected with, its prior, residual, samples, age and source."""
    from rich.table import Table

    t = Table(title="online calibration (the profile is the prior; a term the data cannot identify keeps it)")
    for col in ("instance", "term", "value", "prior", "residual", "samples", "age", "source"):
        t.add_column(col)
    for i in s.instances:
        c = i.calibration
        if c is None:
            continue
        checks = ", ".join(
            f"{kind} measured {v.measured_s * 1000:.1f} ms, projected {v.projected_s * 1000:.1f} ms"
            for kind, v in c.check.items()
        )
        source = "calibrated" if c.calibrated else "peers' terms" if c.from_peers else "prior"
        head = f"{i.id} ({source}, refit {c.fitted_age_s or 0:.0f} s ago)"
        t.add_row(head, "", "", "", "", "", "", checks or "-")
        for name, term in c.terms.items():
            fitted = term.source.startswith("fit")
            t.add_row(
                "",
                name,
                _num(term.value),
                _num(term.prior),
                "-" if term.residual is None else f"{term.residual:.0%}",
                str(term.samples),
                "-" if term.age_s is None else f"{term.age_s:.0f} s",
                term.source if fitted else f"[dim]{term.source}[/]",
            )
    return t


def _tenant_table(s: ConsoleState) -> Table:
    """One row per tenant: in flight / its limit, tokens left / per minute, requests by outcome."""
    from rich.table import Table

    ts = s.tenants
    assert ts is not None
    title = f"tenants ({ts.keys_file}; {ts.unauthorized} refused with 401)"
    if ts.last_error:
        title += f"\n[red]last reload failed, previous table in force:[/] {ts.last_error}"
    t = Table(title=title)
    for col in ("tenant", "in flight", "tokens/min", "met", "missed", "failed", "limited", "attain"):
        t.add_column(col)
    for name, r in ts.tenants.items():
        n = r.requests
        done = n.get("met", 0) + n.get("missed", 0) + n.get("failed", 0)
        t.add_row(
            name,
            f"{r.in_flight}/{'-' if r.max_in_flight is None else r.max_in_flight}",
            "-" if r.tokens_per_minute is None else f"{r.tokens_available}/{r.tokens_per_minute}",
            *(str(n.get(k, 0)) for k in ("met", "missed", "failed", "limited")),
            _pct(n.get("met", 0) / done if done else None),
        )
    return t


@policy_app.command("list")
def policy_list(
    kind: Annotated[
        str | None, typer.Option("--kind", help="only this kind: routing | queue | reschedule | scaling | rank")
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every installed policy of every kind with its params; `*` marks the active ones when a console runs.

    Works without a running console (from the registry). Examples:
      sibyl-console policy list
      sibyl-console policy list --kind scaling --json
    """
    from rich.console import Console
    from rich.table import Table

    from console.live.discovery import local_running
    from core.policies.registry import catalog

    active: dict[str, Any] = {}
    if url or token or local_running():
        active = _control(url, token).policies()["active"]
    available = [p for p in catalog() if kind is None or p["kind"] == kind]
    if kind is not None and not available:
        raise ConfigError(f"unknown policy kind {kind!r}; kinds: routing, queue, reschedule, scaling, rank")
    if as_json:
        typer.echo(json.dumps({"active": active, "available": available}, indent=2))
        return
    t = Table(title="policies" + (" (* = active)" if active else " (no console running)"))
    for col in ("kind", "name", "params (defaults)", "summary"):
        t.add_column(col)
    for spec in available:
        on = active.get(spec["kind"], {}).get("name") == spec["name"]
        summary = spec["summary"] + ("  (simulator only)" if spec.get("sim_only") else "")
        t.add_row(spec["kind"], ("* " if on else "  ") + spec["name"], json.dumps(spec["defaults"]), summary)
    Console().print(t)


@policy_app.command("set")
def policy_set(
    kind: Annotated[str, typer.Argument(help="routing | queue | reschedule | scaling | rank")],
    name: Annotated[str, typer.Argument(help="policy name (see `policy list`)")],
    param: ParamOpt = [],  # noqa: B006
    params_json: ParamsJsonOpt = [],  # noqa: B006
    pool: Annotated[
        str | None, typer.Option("--pool", help="the pool whose policy to swap (default: the only one)")
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Hot-swap a policy of one pool while traffic flows; the swap is recorded with source `cli`.

    Params are validated before the swap; a periodic policy the backend cannot carry out
    (e.g. a scaling policy on attached instances) is refused with the reason.

    Examples:
      sibyl-console policy set routing least_load --param by=tokens
      sibyl-console policy set routing lora_affinity --param routing=least_load --pool llama-8b
      sibyl-console policy set queue priority --param max_in_flight_per_instance=32
      sibyl-console policy set scaling threshold --param max_decode=8
      sibyl-console policy set routing prefix_aware --param decode_params={} --param balance_s=2
      sibyl-console policy set queue fcfs --params-json "$(sibyl-console status --json | jq -c .policies.queue.params)"
    """
    params = params_for(policy_params(param, params_json), name)
    ev = _control(url, token).set_policy(kind, name, params, pool=pool)
    if as_json:
        typer.echo(json.dumps(ev))
    else:
        where = f" (pool {ev['pool']})" if pool is not None and ev.get("pool") else ""
        typer.echo(f"{ev['kind']}{where}: {ev['old']} -> {ev['new']} {ev['params'] or ''}")


def scale(
    role: Annotated[str, typer.Argument(help="prefill | decode")],
    delta: Annotated[
        int,
        typer.Argument(help="instances to add (negative: remove; routing stops at once, the process after draining)"),
    ],
    pool: Annotated[
        str | None, typer.Option("--pool", help="the pool to scale (one per base model; default: the only one)")
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Add or remove instances of one pool of a running console (backends that declare scale: emulator, sim, vllm).

    Examples: sibyl-console scale decode 2      sibyl-console scale decode -- -1
              sibyl-console scale prefill 1 --pool B
    """
    result = _control(url, token).scale(role, delta, pool=pool)
    where = f" (pool {result['pool']})" if pool is not None and result.get("pool") else ""
    typer.echo(json.dumps(result) if as_json else f"{role}{where} {delta:+d}: {', '.join(result['instances'])}")


def flip(
    instance: Annotated[str, typer.Argument(help="instance id, e.g. d3 (see `status`)")],
    role: Annotated[str, typer.Argument(help="the role it serves from now on: prefill | decode")],
    pool: Annotated[
        str | None, typer.Option("--pool", help="the instance's pool (default: the pool the instance serves)")
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Flip an instance between prefill and decode (backends that declare role_flip: emulator, sim,
    vLLM with kv_role=kv_both). New requests follow the new role at once; requests already on
    the instance finish where they are.

    Examples: sibyl-console flip d3 prefill      sibyl-console flip B.d1 prefill   (ids are unique across pools)
    """
    result = _control(url, token).flip(instance, role, pool=pool)
    typer.echo(json.dumps(result) if as_json else f"{result['instance']} now serves {result['role']}")


def migrate(
    request_id: Annotated[
        str, typer.Argument(help="the request's id (its X-Request-Id; see the event log or `runs requests`)")
    ],
    target: Annotated[str, typer.Argument(help="the decode instance to continue it on, e.g. d2")],
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Move a streaming request that is decoding to another decode instance, its client's stream
    continuing there (backends that declare migration: the emulator; real vLLM cannot move a
    running request and says so). The KV is copied in stages while it keeps decoding.

    Example: sibyl-console migrate 5f0c… d2
    """
    r = _control(url, token).migrate(request_id, target)
    typer.echo(
        json.dumps(r)
        if as_json
        else f"{r['request_id']}: {r['source']} → {r['target']} in {r['stages']} stages, "
        f"{r['tokens']} KV tokens, frozen {r['frozen_ms']:.1f} ms"
    )


def register(app: typer.Typer) -> None:
    from console.commands.policy_canary import canary

    policy_app.command("canary")(canary)
    app.command("status")(status)
    app.command("scale")(scale)
    app.command("flip")(flip)
    app.command("migrate")(migrate)
    app.add_typer(policy_app, name="policy")

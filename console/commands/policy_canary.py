"""`sibyl-console policy canary`: route a share of traffic under a candidate policy, compare the arms, end by a rule."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import typer

from console.commands.options import JsonOpt, ParamOpt, ParamsJsonOpt, TokenOpt, UrlOpt
from console.commands.params import params_for, policy_params
from core.errors import ConfigError

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|m|h)?\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """`300`, `300s`, `5m` or `1.5h` → seconds; anything else (or 0) is a ConfigError."""
    m = _DURATION.match(text)
    if m is None or not float(m.group(1)) > 0:
        raise ConfigError(f"--for {text!r}: expected a positive duration like 300, 90s, 5m or 1h")
    return float(m.group(1)) * _UNIT_S[m.group(2) or "s"]


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:+.1%}"


def describe(canary: dict[str, Any]) -> list[str]:
    """The running canary and the last one that ended, in lines."""
    lines = []
    running, last = canary.get("running"), canary.get("last")
    for what, c in (("running", running), ("last", last)):
        if c is None:
            continue
        plan = c["plan"]
        pool = f" of pool {c['pool']}" if c.get("pool") else ""
        head = (
            f"{what}: {c['id']} {plan['kind']} {plan['name']} {plan['params'] or ''} on {plan['share']:.0%}{pool} "
            f"for {plan['duration_s']:g} s [{c['source']}], {c['elapsed_s']:.0f} s in; finished "
            f"{c['finished']['canary']} canary, {c['finished']['control']} control"
        )
        lines.append(head)
        if c.get("decision"):
            lines.append(f"  verdict: {c['decision']}: {c['reason']}")
        reading = c.get("reading")
        if reading:
            lines.append(f"  reading: {reading['decision']}: {reading['reason']}")
            for f in reading["figures"]:
                lines.append(
                    f"    {f['figure']:<10} canary {f['canary']:.4g}  control {f['control']:.4g}  "
                    f"difference {_pct(f['difference'])} [{_pct(f['low'])}, {_pct(f['high'])}]  {f['direction']}"
                )
    return lines or ["no canary has run on this console"]


def canary(
    kind: Annotated[str | None, typer.Argument(help="routing | rank (decided request by request)")] = None,
    name: Annotated[str | None, typer.Argument(help="the candidate policy (see `policy list`)")] = None,
    param: ParamOpt = [],  # noqa: B006
    params_json: ParamsJsonOpt = [],  # noqa: B006
    share: Annotated[str, typer.Option("--share", help="share of traffic in the canary arm, in (0, 50%]")] = "10%",
    duration: Annotated[str, typer.Option("--for", help="how long before the verdict: 300, 90s, 5m, 1h")] = "5m",
    pool: Annotated[
        str | None, typer.Option("--pool", help="the pool to canary on (one per base model; default: the first pool)")
    ] = None,
    stop: Annotated[bool, typer.Option("--stop", help="end the running canary (the active policy stays)")] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Route a share of new requests under a candidate policy and compare the two arms live.

    The share is hashed by session, else tenant, else request id, so a conversation stays in one arm.
    With several pools it runs on --pool's requests (default: the first pool's); one canary runs at a
    time. At the end: promote (the candidate is swapped in on that pool, source `canary`), rollback,
    equal or inconclusive; stopped early it ends interrupted. Without KIND and NAME it shows the canary.

    Examples:
      sibyl-console policy canary routing prefix_aware --share 10% --for 5m
      sibyl-console policy canary routing least_load --param by=tokens --share 0.2 --for 10m
      sibyl-console policy canary routing least_load --pool B --share 10% --for 5m
      sibyl-console policy canary            # the running canary's latest reading
      sibyl-console policy canary --stop
    """
    from console.control_client import ControlClient

    client = ControlClient(url, token)
    if stop:
        result = client.stop_canary()
        typer.echo(json.dumps(result) if as_json else f"{result['id']} ended: {result['decision']}: {result['reason']}")
        return
    if kind is None or name is None:
        if kind is not None:
            raise ConfigError("policy canary: give both KIND and NAME (or neither, to see the canary)")
        state = client.canary()
        typer.echo(json.dumps(state, indent=2) if as_json else "\n".join(describe(state)))
        return
    seconds = parse_duration(duration)
    params = params_for(policy_params(param, params_json), name)
    started = client.start_canary(kind, name, params, share, seconds, pool=pool)
    if as_json:
        typer.echo(json.dumps(started))
        return
    plan = started["plan"]
    typer.echo(
        f"canary {started['id']}: {plan['kind']} {plan['name']} on {plan['share']:.0%} of pool {started['pool']}'s "
        f"requests for {plan['duration_s']:g} s (`sibyl-console policy canary` shows its readings)"
    )

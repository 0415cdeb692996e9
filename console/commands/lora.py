"""`sibyl-console lora ...`: list, add and remove the LoRA adapters of a running console's pools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from console.commands.options import JsonOpt, TokenOpt, UrlOpt

if TYPE_CHECKING:
    from console.control_client import ControlClient

app = typer.Typer(help="LoRA adapters served under the pools' base models.", no_args_is_help=True)

PoolOpt = Annotated[
    str | None, typer.Option("--pool", help="the pool (one per base model; default: the only one)")
]


def _client(url: str | None, token: str | None) -> ControlClient:
    from console.control_client import ControlClient  # httpx loads only when a command calls the console

    return ControlClient(url, token)


@app.command("list")
def list_(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Every pool's adapters: where each is loaded, requests running under it, and the pool's counts.

    Example: sibyl-console lora list
    """
    pools = _client(url, token).lora()["pools"]
    if as_json:
        typer.echo(json.dumps(pools, indent=2))
        return
    for name, pool in pools.items():
        c = pool["counts"]
        typer.echo(
            f"pool {name} (model {pool['model']}, max {pool['max_loras']} per instance): hits {c['hits']}, "
            f"misses {c['misses']}, loads {c['loads']}, evictions {c['evictions']}, failed loads {c['load_failures']}"
        )
        for adapter, a in pool["adapters"].items():
            where = ", ".join(a["instances"]) or "no instance yet"
            typer.echo(f"  {adapter}  {a['path']}  on {where}  ({a['in_flight']} running)")
        if not pool["adapters"]:
            typer.echo("  no adapters")


@app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="the adapter's name: what clients put in `model`")],
    path: Annotated[Path, typer.Argument(help="the adapter's directory (PEFT: adapter_config.json + weights)")],
    pool: PoolOpt = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Register an adapter with a pool and load it on one prefill and one decode instance there.

    A directory without adapter_config.json is refused before any instance is touched; an instance that
    refuses it is named with vLLM's message. Requests naming it load it where they run.

    Example: sibyl-console lora add sql-expert ./adapters/sql --pool llama-8b
    """
    local = path.expanduser().absolute()
    # the console checks the path on its own host (a remote console's path need not exist here)
    r = _client(url, token).add_lora(name, str(local) if local.exists() else str(path), pool)
    if as_json:
        typer.echo(json.dumps(r))
        return
    typer.echo(f"{r['adapter']} added to pool {r['pool']}: loaded on {', '.join(r['loaded_on']) or 'no instance'}")
    for e in r["errors"]:
        typer.echo(f"  {e}", err=True)


@app.command("remove")
def remove(
    name: Annotated[str, typer.Argument(help="the adapter's name")],
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Unregister an adapter (requests naming it get 404) and unload it from every instance holding it.

    Example: sibyl-console lora remove sql-expert
    """
    r = _client(url, token).remove_lora(name)
    if as_json:
        typer.echo(json.dumps(r))
        return
    typer.echo(f"{r['adapter']} removed from pool {r['pool']}: unloaded from {', '.join(r['unloaded_from']) or '-'}")
    for e in r["errors"]:
        typer.echo(f"  {e}", err=True)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="lora")

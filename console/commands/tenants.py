"""`sibyl-console tenants ...`: write the tenants' keys file (hashed keys) and reload it in a running console."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Annotated

import typer

from console.commands.options import JsonOpt, TokenOpt, UrlOpt
from core.errors import ConfigError

app = typer.Typer(help="API keys and per-tenant limits of /v1 (the keys file).", no_args_is_help=True)


@app.command("hash")
def hash_(
    key: Annotated[str, typer.Argument(help="the API key a tenant will send (Authorization: Bearer KEY)")],
) -> None:
    """Print the sha256 of KEY, the `key_sha256` the keys file stores instead of the key.

    Example: sibyl-console tenants hash sk-team-a-…
    """
    from core.tenants import hash_key  # loads the tenants' models: only for this command

    typer.echo(hash_key(key))


@app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="the tenant's name (its label in /metrics, status and the run store)")],
    file: Annotated[Path, typer.Option("--file", "-f", help="the keys file (.toml), created if missing")],
    key: Annotated[
        str | None, typer.Option("--key", help="its API key (default: a new random one, printed once)")
    ] = None,
    max_in_flight: Annotated[
        int | None, typer.Option("--max-in-flight", min=1, help="its requests in the gateway at once")
    ] = None,
    tokens_per_minute: Annotated[
        int | None,
        typer.Option("--tokens-per-minute", min=1, help="prompt + max_tokens it may start per minute"),
    ] = None,
    priority: Annotated[
        int | None, typer.Option(help="the earliest priority band of its requests (lower runs earlier)")
    ] = None,
    weight: Annotated[
        float | None, typer.Option(min=0.001, help="its share when held requests are released (default 1)")
    ] = None,
) -> None:
    """Add a tenant to a keys file: only the key's sha256 is written; the key is printed once.

    A running console re-reads the file within a second (or `sibyl-console tenants reload`).

    Examples:
      sibyl-console tenants add team-a --file tenants.toml --max-in-flight 16 --tokens-per-minute 200000
      sibyl-console up --tenants tenants.toml
    """
    from console.live.tenants import keys_file_line, read_keys_file

    if file.suffix != ".toml":
        raise ConfigError(f"{file}: `tenants add` writes TOML (.toml); edit a YAML keys file by hand")
    if file.exists() and name in read_keys_file(file):
        raise ConfigError(f"{file}: tenant {name!r} is already there; edit its table to change it")
    new_key = key or "sk-sibyl-" + secrets.token_urlsafe(32)
    table = keys_file_line(
        name,
        new_key,
        max_in_flight=max_in_flight,
        tokens_per_minute=tokens_per_minute,
        priority=priority,
        weight=weight,
    )
    old = file.read_text() if file.exists() else ""
    text = old + ("\n" if old and not old.endswith("\n\n") else "") + table
    tmp = file.with_name(f".{file.stem}.{os.getpid()}.tmp.toml")  # .toml: read back as the console will
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    try:
        read_keys_file(tmp)
    except ConfigError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, file)  # one rename: a console watching the file never reads half of it
    typer.echo(f"added tenant {name!r} to {file}")
    if key is None:
        typer.echo(f"its API key (shown once, stored only as its sha256): {new_key}")


@app.command("reload")
def reload(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Make a running console re-read its keys file now (it also does when the file changes).

    A file that does not load leaves the table in force; the error names the file, line and field.
    """
    from console.control_client import ControlClient

    result = ControlClient(url, token).reload_tenants()
    typer.echo(json.dumps(result) if as_json else f"reloaded: {', '.join(result['tenants'])}")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="tenants")

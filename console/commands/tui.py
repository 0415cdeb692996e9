"""`sibyl-console tui`: attach the live dashboard to a running console, local or remote."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from console.commands.options import TokenOpt, UrlOpt
from console.live.discovery import locate


def tui(
    url: UrlOpt = None,
    token: TokenOpt = None,
    run: Annotated[
        str | None, typer.Option(help="attach to the local console of this run (default: the latest one started here)")
    ] = None,
) -> None:
    """Watch and steer a running console through its control API; quitting leaves it running.

    Without --url it finds the console started on this machine by `sibyl-console up` (or `up
    --detach`, or one left running when its dashboard quit); `sibyl-console down` stops it.

    Examples:
      sibyl-console tui
      sibyl-console tui --run r-20261125-142000-1a2b
      sibyl-console tui --url http://10.0.0.5:8000 --token "$SIBYL_TOKEN"
    """
    address = locate(url, token, run=run)
    from console.tui.launch import run_dashboard  # Textual loads only when a dashboard runs

    asyncio.run(run_dashboard(address.url, address.token, owns_cluster=False))


def register(app: typer.Typer) -> None:
    app.command("tui")(tui)

"""`sibyl-console tui`: attach the live dashboard to a running console, local or remote."""

from __future__ import annotations

import asyncio

import typer

from console.commands.status import TokenOpt, UrlOpt
from console.discovery import locate


def tui(url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Watch and steer a running console through its control API; quitting leaves it running.

    Without --url it finds the console started on this machine by `sibyl-console up`.

    Examples:
      sibyl-console tui
      sibyl-console tui --url http://10.0.0.5:8000 --token "$SIBYL_TOKEN"
    """
    address = locate(url, token)
    from console.tui.launch import run_dashboard  # Textual loads only when a dashboard runs

    asyncio.run(run_dashboard(address.url, address.token, owns_cluster=False))


def register(app: typer.Typer) -> None:
    app.command("tui")(tui)

"""`sibyl-console down`: stop a console running on this machine (drain, stop its instances, close the run)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from console.errors import ConsoleError
from console.live.discovery import ConsoleAddress, locate, running


def down(
    run: Annotated[
        str | None,
        typer.Argument(metavar="RUN", help="the run id of the console to stop (default: the latest one started here)"),
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="stop every console running on this machine")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for each console to drain and stop")] = 120.0,
) -> None:
    """Stop a local console as SIGTERM does: in-flight requests drain (up to its drain_timeout_s), the
    instances it launched stop, its run is closed. Waits until the process is gone.

    Examples:
      sibyl-console down
      sibyl-console down r-20261125-142000-1a2b
      sibyl-console down --all
    """
    from console.server_process import stop_local

    if all_ and run is not None:
        raise ConsoleError("give a RUN or --all, not both")
    targets: list[ConsoleAddress] = running() if all_ else [locate(run=run)]
    out = Console(stderr=True)
    if not targets:
        out.print("no console is running on this machine")
        return
    failed = []
    for address in targets:
        what = f"stopping run {address.run_id} (pid {address.pid})..."
        with out.status(what) as status:
            gone = stop_local(address, timeout, lambda t: status.update(f"{what} {t:.0f} s"))  # noqa: B023 (used at once)
        if gone:
            out.print(f"stopped run {address.run_id}{_final_status(address)}")
        else:
            failed.append(address)
            out.print(f"[red]run {address.run_id} (pid {address.pid}) is still stopping after {timeout:g} s[/]")
    if failed:
        raise typer.Exit(1)


def _final_status(address: ConsoleAddress) -> str:
    if address.db is None or address.run_id is None:
        return ""
    from adapters.store import RunStore

    store = RunStore(address.db)
    try:
        return f" ({store.get_run(address.run_id).status})"
    finally:
        store.close()


def register(app: typer.Typer) -> None:
    app.command("down")(down)

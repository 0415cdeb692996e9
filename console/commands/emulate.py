"""`sibyl-console emulate`: run emulated vLLM instances (GPU-free stand-ins)."""

from __future__ import annotations

import typer

SUMMARY = "Run GPU-free stand-ins for vLLM 0.32: its HTTP API, metrics and P/D protocol, timed by a core.perf profile."
"""The command's line in the root --help (the full help, with the profiles, is `emulate --help`)."""


def register(app: typer.Typer) -> None:
    from adapters.emulator.cli import emulate  # its settings load the profiles (NumPy): only when it runs

    app.command("emulate")(emulate)


def register_listing(app: typer.Typer) -> None:
    """Only the command's name and summary, for the root --help (which lists every command and runs none)."""

    @app.command("emulate", help=SUMMARY)
    def emulate() -> None:  # never runs: a call to `emulate` registers the real command instead
        raise typer.Exit(2)

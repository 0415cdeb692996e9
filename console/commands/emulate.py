"""`sibyl-console emulate`: run emulated vLLM instances (GPU-free stand-ins)."""

from __future__ import annotations

import typer

from adapters.emulator.cli import emulate


def register(app: typer.Typer) -> None:
    app.command("emulate")(emulate)

"""The `sibyl-console` command: a thin Typer root that registers one module per noun."""

from __future__ import annotations

import sys

import typer

from core.errors import SibylError

app = typer.Typer(
    name="sibyl-console",
    help="Operator console for prefill/decode-disaggregated LLM serving on vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_commands() -> None:
    from console.commands import (
        bench,
        calibrate,
        doctor,
        emulate,
        replay,
        runs,
        sim,
        status,
        sweep,
        train_predictor,
        tui,
        up,
    )

    for module in (up, status, tui, replay, sim, sweep, emulate, runs, calibrate, bench, doctor, train_predictor):
        module.register(app)


def main() -> None:
    """Entry point: run the app; a SibylError becomes one line on stderr and exit code 2."""
    _register_commands()
    try:
        app()
    except SibylError as e:
        print(f"sibyl-console: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

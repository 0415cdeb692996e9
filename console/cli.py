"""The `sibyl-console` command: a thin Typer root that registers one module per noun."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

import typer

from core.errors import SibylError

app = typer.Typer(
    name="sibyl-console",
    help="Operator console for prefill/decode-disaggregated LLM serving on vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

MODULES = (
    "up",
    "down",
    "status",
    "advise",
    "tenants",
    "lora",
    "tui",
    "replay",
    "sim",
    "sweep",
    "emulate",
    "runs",
    "calibrate",
    "bench",
    "doctor",
    "train_predictor",
)
"""console.commands modules, in the order `--help` lists their commands."""
COMMANDS = {
    "serve": "up",
    "scale": "status",
    "flip": "status",
    "migrate": "status",
    "policy": "status",
    "train-predictor": "train_predictor",
}
"""Commands whose module is not named after them."""
_registered: set[str] = set()


@app.callback()
def _root() -> None:
    """Keeps the app a command group when a call registers only one command (its help is the app's)."""


def _register_commands(argv: Sequence[str] | None = None) -> None:
    """Register the command modules (each once). When `argv` starts with a command, only that
    command's module is imported, so a call loads what it runs (`status` does not import the run
    store or the simulator); no command, an option first or an unknown name registers them all."""
    first = argv[0] if argv else ""
    wanted = COMMANDS.get(first, first)
    listing = wanted not in MODULES  # the root --help (or a typo): names and summaries, nothing runs
    for name in MODULES if listing else (wanted,):
        if name not in _registered:
            module = importlib.import_module(f"console.commands.{name}")
            getattr(module, "register_listing", module.register)(app) if listing else module.register(app)
            _registered.add(name)


def main() -> None:
    """Entry point: run the app; a SibylError becomes one line on stderr and exit code 2."""
    _register_commands(sys.argv[1:])
    try:
        app()
    except SibylError as e:
        print(f"sibyl-console: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

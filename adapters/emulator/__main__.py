"""`python -m adapters.emulator ...`: the emulate command without the full CLI."""

import sys

import typer

from adapters.emulator.cli import emulate
from core.errors import SibylError

if __name__ == "__main__":
    try:
        typer.run(emulate)
    except SibylError as e:
        print(f"sibyl-console emulate: error: {e}", file=sys.stderr)
        sys.exit(2)

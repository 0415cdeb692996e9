"""The CLI options several commands share, as `Annotated` aliases (one help text per option)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

UrlOpt = Annotated[str | None, typer.Option("--url", help="console URL (default: the local console)")]
TokenOpt = Annotated[
    str | None, typer.Option("--token", help="control token (default: SIBYL_TOKEN or the local token file)")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]
DbOpt = Annotated[Path | None, typer.Option("--db", help="run store (default: user data dir; env SIBYL_DB)")]
ParamOpt = Annotated[
    list[str],
    typer.Option(
        "--param",
        help="key=value, or policy.key=value for the policy of that name (repeat); a value may be JSON "
        "({}, [1, 2], null; None is null too)",
    ),
]
ParamsJsonOpt = Annotated[
    list[str],
    typer.Option(
        "--params-json",
        help="params as one JSON object: '{...}' (where key=value goes) or 'policy={...}' (repeat; "
        "what `status --json` and `policy list --json` print; --param wins over it)",
    ),
]

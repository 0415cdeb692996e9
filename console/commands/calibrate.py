"""`sibyl-console calibrate`: fit a performance profile from a recorded live run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from console.commands.runs import DbOpt, JsonOpt, open_store
from core.perf import save_profile_file


def calibrate_cmd(
    run: Annotated[str, typer.Argument(help="run id (or a unique prefix) of a live run")],
    out: Annotated[Path | None, typer.Option("--out", help="write the fitted profile JSON here (usable by sim/emulate --profile)")] = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Fit prefill time vs prompt tokens and decode step time vs batch from a live run.

    Example: sibyl-console calibrate r-20261122-1101 --out fitted.json && sibyl-console sim --profile fitted.json
    """
    from console.calibration import calibrate

    profile, report = calibrate(open_store(db), run)
    if out is not None:
        save_profile_file(profile, out)
    if as_json:
        typer.echo(json.dumps({**report, "out": str(out) if out else None}, indent=2))
        return
    t = Table(title=f"calibrated from {report['run_id']} ({report['prefills']} prefills, {report['decodes']} decodes, batch {report['batch_range'][0]:.1f}-{report['batch_range'][1]:.1f})")
    for col in ("parameter", "fitted", f"profile {report['base']}"):
        t.add_column(col, justify="right" if col != "parameter" else "left")
    for k, v in report["fitted"].items():
        t.add_row(k, f"{v:.6g}", f"{report['base_values'][k]:.6g}")
    Console().print(t)
    if out is not None:
        typer.echo(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate_cmd)

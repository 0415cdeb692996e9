"""`sibyl-console calibrate`: fit a performance profile from a recorded live run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from console.commands.options import DbOpt, JsonOpt


def _num(v: Any) -> str:
    return "-" if v is None else str(v) if isinstance(v, int) else f"{v:.4g}"


def calibrate_cmd(
    run: Annotated[
        list[str],
        typer.Argument(
            help="run id (or a unique prefix) of a live run, or of replay runs one console served "
            "(then only those replays' requests are used, together)"
        ),
    ],
    out: Annotated[
        Path | None, typer.Option("--out", help="write the fitted profile JSON here (usable by sim/emulate --profile)")
    ] = None,
    base: Annotated[
        str | None,
        typer.Option("--base", help="profile (name or .json) whose values are the priors (default: the run's profile)"),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="name of the written profile (default: calibrated-RUN)")
    ] = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Fit prefill, decode step (batch and resident KV) and KV transfer times from a live run.

    Every term is fitted from the run or left at its prior with the reason; the table shows each
    term's source and fit quality (relative RMS residual of its regression, samples used/all, and
    ±: its 1σ uncertainty as a share of a typical target), and the written profile keeps them in
    its `fit` field.

    Example: sibyl-console calibrate r-20261122-1101 --out fitted.json && sibyl-console sim --profile fitted.json
    """
    from rich.console import Console
    from rich.table import Table

    from console.commands.runs import open_store
    from console.offline.calibration import calibrate
    from core.perf import get_profile, save_profile_file

    profile, report = calibrate(open_store(db), run, get_profile(base) if base else None)
    if name:
        profile = profile.model_copy(update={"name": name})
    if out is not None:
        save_profile_file(profile, out)
    if as_json:
        typer.echo(json.dumps({**report, "out": str(out) if out else None}, indent=2))
        return
    b, k = report["batch_range"], report["kv_range"]
    t = Table(
        title=(
            f"calibrated from {report['run_id']}: {report['prefills']} prefills, {report['decodes']} decodes "
            f"(batch {b[0]:.1f}-{b[1]:.1f}, KV {k[0]:.0f}-{k[1]:.0f} tokens), {report['handoffs']} KV handoffs"
        )
    )
    for col in ("term", "value", f"prior ({report['base']})", "source", "rel. residual", "samples", "±"):
        t.add_column(col, justify="left" if col in ("term", "source") else "right", overflow="fold")
    for name, q in report["terms"].items():
        samples = (
            "-" if q["samples"] is None else f"{q['used'] if q['used'] is not None else q['samples']}/{q['samples']}"
        )
        t.add_row(
            name,
            _num(q["value"]),
            _num(q["prior"]),
            q["source"],
            "-" if q["rel_rms"] is None else f"{q['rel_rms']:.1%}",
            samples,
            "-" if q["rel_se"] is None else f"{q['rel_se']:.1%}",
        )
    Console().print(t)
    if out is not None:
        typer.echo(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate_cmd)

"""`sibyl-console sweep CONFIG`: run a grid of simulations on Ray into the run store, resumably."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from console.commands.options import DbOpt

if TYPE_CHECKING:
    from rich.table import Table

    from console.offline.sweep import PointOutcome
    from console.offline.sweep_config import Point

# The sweep machinery (Ray, the simulator, the run store) and rich load inside the command.


def _fmt(key: str, spread: dict[str, float | None]) -> str:
    mean, std = spread["mean"], spread["std"]
    if mean is None:
        return "-"
    if key == "slo_attainment":
        return f"{mean:.1%}" + ("" if std is None else f" ± {std:.1%}")
    return f"{mean * 1000:.1f}" + ("" if std is None else f" ± {std * 1000:.1f}")


def _tables(table: list[dict[str, Any]]) -> list[Table]:
    from rich.table import Table

    from console.offline.sweep import COMPARED, group_title

    out = []
    for group in table:
        t = Table(title=group_title(group), title_justify="left")
        t.add_column("policy", no_wrap=True)
        t.add_column("seeds", justify="right")
        for head in ("P99 TPOT ms", "P99 TTFT ms", "SLO att."):
            t.add_column(head, justify="right")
        for row in group["policies"]:
            seeds = str(row["seeds"]) + (f" ({row['missing']} missing)" if row["missing"] else "")
            t.add_row(row["policy"], seeds, *[_fmt(m, row[m]) for m in COMPARED])
        out.append(t)
    return out


def _plot_terminal(table: list[dict[str, Any]]) -> None:
    import plotext as plt

    from console.offline.sweep import tpot_curves, x_label

    for title, series in tpot_curves(table).items():
        plt.clear_figure()
        if not sys.stdout.isatty():
            plt.clear_color()
        for policy, (xs, ys) in series.items():
            plt.plot(xs, ys, label=policy, marker="dot")
        plt.title(f"P99 TPOT (ms): {title}")
        plt.xlabel(x_label(table))
        plt.plotsize(100, 20)
        plt.show()


def _plot_file(table: list[dict[str, Any]], out: Path) -> None:
    from console.offline.sweep import SweepError, tpot_curves, x_label

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SweepError("--plot-out needs matplotlib: pip install 'sibyl-console[plot]'") from None
    curves = tpot_curves(table)
    if not curves:
        raise SweepError("--plot-out: no P99 TPOT against a rate or load to plot")
    cols = min(3, len(curves))
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, curves.items(), strict=False):
        for policy, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=policy)
        ax.set_title(title, fontsize="small")
        ax.set_xlabel(x_label(table))
        ax.set_ylabel("P99 TPOT (ms)")
        ax.legend(fontsize="x-small")
    for ax in list(axes.flat)[len(curves) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


@contextmanager
def _interrupt_between_points() -> Iterator[threading.Event]:
    """A first Ctrl-C asks to stop after the point being recorded; a second one stops at once."""
    asked = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield asked
        return

    def handler(signum: int, frame: object) -> None:
        if asked.is_set():
            raise KeyboardInterrupt
        asked.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield asked
    finally:
        signal.signal(signal.SIGINT, previous)


def _line(point: Point, outcome: PointOutcome | None, error: str | None) -> str:
    c = point.coords()
    level = (
        f"load {c['load']:g}"
        if c["load"] is not None
        else f"{c['rate']:g} req/s"
        if c["rate"] is not None
        else "recorded rate"
    )
    where = f"{c['workload']} {c['mode']} {c['cluster']} {level} seed {c['seed']} {c['policy']}"
    if outcome is None:
        return f"{where}: failed: {error}"
    r = outcome.row
    tpot = "-" if r.get("tpot_p99") is None else f"{r['tpot_p99'] * 1000:.1f} ms"
    return f"{where}: P99 TPOT {tpot} ({r['sim_wall_s']:.1f} s)"


def sweep(
    config: Annotated[Path, typer.Argument(help="sweep CONFIG (TOML), e.g. demos/sweep_routing.toml")],
    ray_address: Annotated[
        str | None,
        typer.Option("--ray-address", help="Ray cluster to run on (default: start a local Ray and stop it at the end)"),
    ] = None,
    workers: Annotated[int | None, typer.Option(min=1, help="CPUs of the local Ray (default: all)")] = None,
    db: DbOpt = None,
    plot: Annotated[bool, typer.Option("--plot", help="draw P99 TPOT against rate per policy in the terminal")] = False,
    plot_out: Annotated[
        Path | None, typer.Option("--plot-out", help="write that plot to a PNG (needs matplotlib)")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="say what would run, run nothing")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the runs and the comparison as JSON")] = False,
) -> None:
    """Run every point of a CONFIG's grid (policies × rates × shapes × seeds …) as a Ray task.

    Each finished point is recorded right away as a sim run tagged with the sweep's name (see
    `runs list`, `runs compare`); running the same CONFIG again runs only the points not stored
    yet, so an interrupted sweep resumes. At the end: one table per workload × mode × shape ×
    rate with the policies as rows (mean ± std over seeds).

    Examples:
      sibyl-console sweep demos/sweep_routing.toml --workers 2 --plot
      sibyl-console sweep my_sweep.toml --ray-address 10.0.0.5:6379 --plot-out tpot.png
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from adapters.store import RunStore
    from console.offline.sweep import SweepError, comparison, execute, ray_session, record_point, stored_points
    from console.offline.sweep_config import axes_summary, expand, load_config, resolve_profile

    cfg = load_config(config)
    profile = resolve_profile(cfg, str(config))
    points = expand(cfg, profile)
    store = RunStore(db)
    store.mark_interrupted_runs()
    done = stored_points(store, cfg.name)
    todo = [p for p in points if p.key not in done]
    err = Console(stderr=True, soft_wrap=True)
    err.print(
        f"sweep {cfg.name}: {len(points)} points ({axes_summary(cfg)}); "
        f"{len(points) - len(todo)} already in {store.path}, {len(todo)} to run"
    )
    if dry_run:
        for p in todo:
            err.print(f"  {p.key} {p.coords()}", markup=False)
        return
    ran: list[dict[str, Any]] = []
    failed: list[str] = []
    if todo:
        started = time.perf_counter()
        with ray_session(ray_address, workers) as ray:
            bar: Progress | None = None
            if err.is_terminal and not err.is_dumb_terminal:
                bar = Progress(
                    TextColumn(cfg.name), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err
                )
            task = bar.add_task(cfg.name, total=len(points), completed=len(points) - len(todo)) if bar else None

            def on_done(point: Point, outcome: PointOutcome | None, error: str | None) -> None:
                run_id = record_point(store, cfg.name, point, outcome, store_requests=cfg.store_requests, error=error)
                ran.append(
                    {
                        "run_id": run_id,
                        "point": point.key,
                        **point.coords(),
                        "status": "failed" if outcome is None else "completed",
                    }
                )
                if outcome is None:
                    failed.append(f"{point.key} {point.coords()}: {error}")
                if bar is not None and task is not None:
                    bar.advance(task)
                    if outcome is None:
                        bar.console.print(_line(point, outcome, error), style="red", markup=False)
                else:
                    count = len(points) - len(todo) + len(ran)
                    err.print(f"[{count}/{len(points)}] {_line(point, outcome, error)}", markup=False, highlight=False)

            try:
                if bar is not None:
                    bar.start()
                with _interrupt_between_points() as asked:
                    execute(ray, todo, profile, on_done, stop=asked.is_set)
            except KeyboardInterrupt:
                err.print(
                    f"interrupted: {len(ran)} of {len(todo)} points run this time are stored; "
                    f"run `sibyl-console sweep {config}` again to resume"
                )
                raise typer.Exit(130) from None
            finally:
                if bar is not None:
                    bar.stop()
        err.print(f"ran {len(ran)} points in {time.perf_counter() - started:.1f} s")
    stored = stored_points(store, cfg.name)
    table = comparison(points, {k: info.summary or {} for k, info in stored.items()})
    if as_json:
        typer.echo(
            json.dumps(
                {"sweep": cfg.name, "points": len(points), "ran": ran, "failed": len(failed), "comparison": table},
                indent=2,
            )
        )
    else:
        out = Console()
        for t in _tables(table):
            out.print(t)
    if plot:
        _plot_terminal(table)
    if plot_out is not None:
        _plot_file(table, plot_out)
        err.print(f"wrote {plot_out}")
    if failed:
        raise SweepError(
            f"{len(failed)} of {len(todo)} points failed (stored as failed runs; run again to retry): {failed[0]}"
        )


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep)

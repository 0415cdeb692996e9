"""`sibyl-console runs`: find runs, requests and policy changes afterwards."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from console.commands.options import DbOpt, JsonOpt, ParamOpt, ParamsJsonOpt
from console.commands.params import params_for, policy_params
from console.commands.runs_breakdown import fmt_metric as _fmt_metric
from console.commands.runs_why import runs_why

if TYPE_CHECKING:
    from adapters.store import RunInfo, RunStore

# The run store (SQLAlchemy) and rich load inside the commands, not for `--help` or other commands.

runs_app = typer.Typer(help="Runs recorded in the run store (SQLite).", no_args_is_help=True)


def open_store(db: Path | None) -> RunStore:
    from adapters.store import RunStore

    store = RunStore(db)
    store.mark_interrupted_runs()
    return store


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _duration(r: RunInfo) -> str:
    end = r.ended_at or (time.time() if r.status == "running" else None)
    return "-" if end is None else f"{end - r.started_at:.0f}s"


def _metric(summary: dict[str, Any] | None, *keys: str, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    for k in keys:
        if summary and summary.get(k) is not None:
            return fmt.format(summary[k] * scale)
    return "-"


@runs_app.command("list")
def runs_list(
    db: DbOpt = None,
    limit: Annotated[int, typer.Option(min=1, help="show the newest N runs")] = 30,
    as_json: JsonOpt = False,
) -> None:
    """Runs, newest first.

    Example: sibyl-console runs list --json | jq '.[0].run_id'
    """
    from rich.console import Console
    from rich.table import Table

    store = open_store(db)
    runs = store.list_runs(limit)
    if as_json:
        typer.echo(json.dumps([r.to_json() for r in runs], indent=2))
        return
    t = Table(title=f"runs in {store.path}")
    for col in (
        "run id",
        "kind",
        "status",
        "started",
        "duration",
        "backend",
        "cluster",
        "policy",
        "requests",
        "TPOT p99 ms",
        "SLO att.",
    ):
        t.add_column(col)
    for r in runs:
        t.add_row(
            r.run_id,
            r.kind,
            r.status,
            _when(r.started_at),
            _duration(r),
            r.backend,
            r.cluster,
            r.policy,
            str(r.requests),
            _metric(r.summary, "tpot_p99", scale=1000),
            _metric(r.summary, "slo_attainment", "attainment", scale=100, fmt="{:.1f}%"),
        )
    Console().print(t)


def run_details(store: RunStore, run_id: str) -> dict[str, Any]:
    from console.offline.advisor_log import advice_timeline, canary_lives
    from console.offline.analysis import run_metrics
    from console.offline.breakdown import breakdowns

    info = store.get_run(run_id)
    reqs = store.requests(info.run_id)
    per_decode = Counter(r["decode_instance"] for r in reqs if r["decode_instance"])
    per_prefill = Counter(r["prefill_instance"] for r in reqs if r["prefill_instance"])
    outcomes = Counter(r["status"] for r in reqs)
    reasons = Counter((r["reason"] or "")[:80] for r in reqs if r["status"] != "ok")
    advisor = store.advisor_events(info.run_id)
    return {
        **info.to_json(),
        "outcomes": dict(outcomes),
        "failure_reasons": dict(reasons.most_common(10)),
        "requests_per_prefill": dict(sorted(per_prefill.items())),
        "requests_per_decode": dict(sorted(per_decode.items())),
        "per_tenant": per_tenant(reqs),
        "cached_share": run_metrics(reqs)["cached_share"],
        "cached_reported": sum(r.get("cached_tokens") is not None for r in reqs),
        "breakdowns": breakdowns(reqs),
        "policy_events": store.policy_events(info.run_id),
        "instance_events": store.instance_events(info.run_id),
        "advice": advice_timeline(advisor),
        "canaries": canary_lives(advisor),
    }


@runs_app.command("show")
def runs_show(
    run: Annotated[str, typer.Argument(help="run id (or a unique prefix)")], db: DbOpt = None, as_json: JsonOpt = False
) -> None:
    """One run: config, summary, policy timeline, per-instance counts, outcomes; by model, adapter and canary arm
    when it has several; what the advisor advised and each canary's life; with several pools, the pool of each
    policy event and each pool's decision quality."""
    from rich.console import Console

    from console.commands.runs_breakdown import advice_lines, breakdown_tables, canary_lines
    from console.commands.runs_policies import run_pools, run_quality_lines, timeline_table

    d = run_details(open_store(db), run)
    if as_json:
        typer.echo(json.dumps(d, indent=2, default=str))
        return
    con = Console()
    con.print(
        f"[bold]{d['run_id']}[/]  {d['kind']}  {d['status']}  started "
        f"{_when(d['started_at'])}  ended {_when(d['ended_at'])}"
    )
    con.print(f"backend {d['backend']}  cluster {d['cluster']}  workload {d['workload'] or '-'}  seed {d['seed']}")
    con.print(f"requests {d['requests']}  outcomes {d['outcomes']}")
    if d["failure_reasons"]:
        con.print(f"failures: {d['failure_reasons']}")
    if d["summary"]:
        s = d["summary"]
        con.print(
            "summary: " + ", ".join(f"{k}={_summary_value(v)}" for k, v in s.items() if not isinstance(v, dict | list))
        )
        if s.get("tpot_unknown"):
            con.print(
                f"  {s['tpot_unknown']} whole (non-streamed) replies: TPOT not measured (left out of TPOT attainment), "
                "TTFT taken at the end of their prefill leg"
            )
    con.print(timeline_table(d["policy_events"], by_pool=bool(run_pools(d["policy_events"], d["summary"]))))
    for table in breakdown_tables(d["breakdowns"]):
        con.print(table)
    for line in [*advice_lines(d["advice"]), *canary_lines(d["canaries"])]:
        con.print(line, markup=False, highlight=False, soft_wrap=True)
    if d.get("cached_share") is not None:
        con.print(
            f"prefix cache: {d['cached_share']:.1%} of prompt tokens served "
            f"from a cache ({d['cached_reported']} requests report it)"
        )
    for line in run_quality_lines(d["summary"]):
        con.print(line, markup=False)
    for name, row in (d.get("per_tenant") or {}).items():
        att = "-" if row["attainment"] is None else f"{row['attainment']:.1%}"
        con.print(
            f"tenant {name}: {row['requests']} requests, {row['ok']} ok, {row['limited']} refused by its limits, "
            f"SLO attainment of the answered {att}"
        )
    if d["requests_per_decode"]:
        con.print("per decode instance: " + ", ".join(f"{k}={v}" for k, v in d["requests_per_decode"].items()))
    for e in d["instance_events"]:
        con.print(f"  t={e['t']:.2f}s {e['instance_id']} {e['event']} {e['detail']}")
    con.print(f"config: {json.dumps(d['config'])}")


def per_tenant(reqs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Requests by the tenant they were charged to (rows of schema 8 on; none for older runs)."""
    out: dict[str, dict[str, Any]] = {}
    for r in reqs:
        if r.get("tenant") is None:
            continue
        row = out.setdefault(r["tenant"], {"requests": 0, "ok": 0, "met": 0, "limited": 0})
        row["requests"] += 1
        row["ok"] += r["status"] == "ok"
        row["met"] += r["status"] == "ok" and bool(r["slo_met"])
        row["limited"] += (r["reason"] or "").startswith("tenant ")
    for row in out.values():
        row["attainment"] = row["met"] / row["ok"] if row["ok"] else None
    return out


def _summary_value(v: Any) -> str:
    """A summary figure as `runs show` prints it: "-" for one that was not measured."""
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


@runs_app.command("compare")
def runs_compare(
    runs: Annotated[
        list[str],
        typer.Argument(help="two or more run ids (or unique prefixes; one with --by); the first is the baseline"),
    ],
    by: Annotated[
        str | None,
        typer.Option(
            "--by",
            help="model | lora | arm: split each run by the base model, LoRA adapter or canary arm of its requests; "
            "each group is compared to the same group of the first run (one run: to its first group, the control arm)",
        ),
    ] = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Side-by-side metrics, policy timelines and relative differences to the first run.

    Example: sibyl-console runs compare r-20261122-1101 r-20261122-1102 r-20261122-1103
    Example: sibyl-console runs compare r-20261122-1101 --by arm
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from adapters.store import StoreError
    from console.offline.analysis import LOWER_IS_BETTER, METRICS, NEUTRAL, compare
    from console.offline.breakdown import check_by, compare_groups

    if by is not None:
        check_by(by)
    if len(runs) < (1 if by else 2):
        raise StoreError("runs compare needs at least two run ids (or one, split with --by model|lora|arm)")
    result = compare(open_store(db), runs) if by is None else compare_groups(open_store(db), runs, by)
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
        return
    if not result:
        raise StoreError(f"the runs {', '.join(runs)} have no requests to split by {by}")
    first = result[0]["run"]["run_id"] + (f" {by}={escape(result[0]['group'])}" if by and len(runs) == 1 else "")
    if by and len(runs) > 1:
        first += f", each {by} to its own in the first run"
    t = Table(title=f"compared to {first}")
    t.add_column("metric")
    for entry in result:
        r = entry["run"]
        group = f"\n{by}={escape(entry['group'])}" if by else ""
        t.add_column(f"{r['run_id']}\n{r['kind']} {r['policy'] or ''}{group}", justify="right")
    for key in METRICS:
        cells = []
        for k, entry in enumerate(result):
            cell = _fmt_metric(key, entry["metrics"][key])
            rel = entry["relative"][key]
            if k and not entry.get("baseline") and rel is not None and key not in NEUTRAL:
                better = rel < 0 if key in LOWER_IS_BETTER else rel > 0
                cell += f" [{'green' if better else 'red'}]({rel:+.1%})[/]" if rel else " (=)"
            cells.append(cell)
        t.add_row(key, *cells)
    t.add_row("policies", *["\n".join(e["policy_timeline"]) or "-" for e in result])
    Console().print(t)


@runs_app.command("export")
def runs_export(
    run: Annotated[str, typer.Argument(help="run id (or a unique prefix)")],
    format: Annotated[str, typer.Option("--format", help="csv | json | parquet")] = "csv",
    out: Annotated[Path | None, typer.Option("--out", help="file to write (default: stdout for csv/json)")] = None,
    db: DbOpt = None,
) -> None:
    """Per-request records of a run as CSV, JSON or Parquet.

    Example: sibyl-console runs export r-20261122-1101 --format csv --out run.csv
    """
    import csv
    import io

    from adapters.store import StoreError
    from adapters.store.schema import REQUEST_COLUMNS

    store = open_store(db)
    info = store.get_run(run)
    rows = store.requests(info.run_id)
    cols = ["request_id", *[c for c in REQUEST_COLUMNS if c != "request_id"]]
    records = [{c: r.get(c) for c in cols} for r in rows]
    for record in records:  # prefix keys: a list of ints (in CSV, that list as JSON)
        keys = record["prefix_keys"]
        if keys is not None:
            record["prefix_keys"] = json.dumps(list(keys)) if format == "csv" else list(keys)
    if format == "parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise StoreError(
                "--format parquet needs pyarrow: pip install 'sibyl-console[plot]' or pip install pyarrow"
            ) from None
        if out is None:
            raise StoreError("--format parquet needs --out FILE")
        pq.write_table(pa.Table.from_pylist(records), out)
        return
    if format == "json":
        text = json.dumps(records, indent=1)
    elif format == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=cols)
        w.writeheader()
        w.writerows(records)
        text = buf.getvalue()
    else:
        raise StoreError(f"--format {format!r}: expected csv, json or parquet")
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)


@runs_app.command("plot")
def runs_plot(
    run: Annotated[str, typer.Argument(help="run id (or a unique prefix)")],
    metric: Annotated[str, typer.Option(help="tpot | ttft | attainment | load")] = "tpot",
    out: Annotated[
        Path | None, typer.Option("--out", help="write a PNG instead of drawing in the terminal (needs matplotlib)")
    ] = None,
    db: DbOpt = None,
) -> None:
    """Plot a run over time in the terminal (plotext), or to a PNG with --out.

    Example: sibyl-console runs plot r-20261122-1101 --metric attainment --out attainment.png
    """
    from adapters.store import StoreError
    from console.offline.analysis import series

    store = open_store(db)
    info = store.get_run(run)
    try:
        data = series(store, info.run_id, metric)
    except ValueError as e:
        raise StoreError(str(e)) from None
    if not any(xs for xs, _ in data.values()):
        raise StoreError(f"run {info.run_id} has no data for {metric}")
    title = f"{info.run_id} ({info.kind}, {info.policy or '-'}): {metric}"
    if out is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise StoreError("--out needs matplotlib: pip install 'sibyl-console[plot]'") from None
        fig, ax = plt.subplots(figsize=(10, 4))
        for name, (xs, ys) in data.items():
            ax.plot(xs, ys, ".", markersize=2, label=name) if metric in ("tpot", "ttft") else ax.plot(
                xs, ys, label=name
            )
        ax.set_xlabel("time in run (s)")
        ax.set_title(title)
        ax.legend(loc="upper right", fontsize="small")
        fig.tight_layout()
        fig.savefig(out, dpi=120)
        plt.close(fig)
        typer.echo(f"wrote {out}")
        return
    import plotext as plt_term

    plt_term.clear_figure()
    for name, (xs, ys) in data.items():
        (plt_term.scatter if metric in ("tpot", "ttft") else plt_term.plot)(xs, ys, label=name)
    plt_term.title(title)
    plt_term.xlabel("time in run (s)")
    plt_term.show()


@runs_app.command("whatif")
def runs_whatif(
    run: Annotated[str, typer.Argument(help="run id (or a unique prefix) of a live run")],
    policy: Annotated[list[str], typer.Option("--policy", help="routing policy to try (repeat)")] = [],  # noqa: B006
    param: ParamOpt = [],  # noqa: B006
    params_json: ParamsJsonOpt = [],  # noqa: B006
    profile: Annotated[
        str | None, typer.Option(help="profile to simulate with (default: calibrated from the run)")
    ] = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-simulate a run's recorded arrivals under other policies, next to what was recorded.

    Example: sibyl-console runs whatif r-20261122-1101 --policy sibyl --policy least_load
    """
    from rich.console import Console
    from rich.table import Table

    from console.offline.analysis import run_metrics
    from console.offline.calibration import calibrate, serving_run, whatif
    from core.perf import get_profile

    store = open_store(db)
    info = store.get_run(run)
    prof = get_profile(profile) if profile else calibrate(store, info.run_id)[0]
    assigned = policy_params(param, params_json)
    served = serving_run(store, info)  # a replay run: the console run that served it
    names = policy or [served.policy or "round_robin"]
    predicted = whatif(store, info.run_id, [(n, params_for(assigned, n)) for n in names], prof)
    recorded = run_metrics(store.requests(info.run_id))
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "run_id": info.run_id,
                    "profile": prof.name,
                    "recorded": {"policy": served.policy, **recorded},
                    "predicted": predicted,
                },
                indent=2,
                default=str,
            )
        )
        return
    t = Table(title=f"what if: {info.run_id} re-simulated with {prof.name}")
    t.add_column("metric")
    t.add_column(f"recorded ({served.policy})", justify="right")
    for p in predicted:
        t.add_column(f"predicted {p['policy']}", justify="right")
    for key in ("ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99", "throughput_tok_s"):
        t.add_row(key, _fmt_metric(key, recorded.get(key)), *[_fmt_metric(key, p.get(key)) for p in predicted])
    Console().print(t)


runs_app.command("why")(runs_why)


def register(app: typer.Typer) -> None:
    app.add_typer(runs_app, name="runs")

"""`sibyl-console runs`: find runs, requests and policy changes afterwards."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from adapters.store import RunInfo, RunStore

runs_app = typer.Typer(help="Runs recorded in the run store (SQLite).", no_args_is_help=True)
DbOpt = Annotated[Path | None, typer.Option("--db", help="run store (default: user data dir; env SIBYL_DB)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]


def open_store(db: Path | None) -> RunStore:
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
    store = open_store(db)
    runs = store.list_runs(limit)
    if as_json:
        typer.echo(json.dumps([r.to_json() for r in runs], indent=2))
        return
    t = Table(title=f"runs in {store.path}")
    for col in ("run id", "kind", "status", "started", "duration", "backend", "cluster", "policy", "requests", "TPOT p99 ms", "SLO att."):
        t.add_column(col)
    for r in runs:
        t.add_row(r.run_id, r.kind, r.status, _when(r.started_at), _duration(r), r.backend, r.cluster, r.policy, str(r.requests),
                  _metric(r.summary, "tpot_p99", scale=1000), _metric(r.summary, "slo_attainment", "attainment", scale=100, fmt="{:.1f}%"))
    Console().print(t)


def run_details(store: RunStore, run_id: str) -> dict[str, Any]:
    info = store.get_run(run_id)
    reqs = store.requests(info.run_id)
    per_decode = Counter(r["decode_instance"] for r in reqs if r["decode_instance"])
    per_prefill = Counter(r["prefill_instance"] for r in reqs if r["prefill_instance"])
    outcomes = Counter(r["status"] for r in reqs)
    reasons = Counter((r["reason"] or "")[:80] for r in reqs if r["status"] != "ok")
    return {
        **info.to_json(),
        "outcomes": dict(outcomes),
        "failure_reasons": dict(reasons.most_common(10)),
        "requests_per_prefill": dict(sorted(per_prefill.items())),
        "requests_per_decode": dict(sorted(per_decode.items())),
        "policy_events": store.policy_events(info.run_id),
        "instance_events": store.instance_events(info.run_id),
    }


@runs_app.command("show")
def runs_show(run: Annotated[str, typer.Argument(help="run id (or a unique prefix)")], db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """One run: config, summary, policy timeline, per-instance counts, outcomes."""
    d = run_details(open_store(db), run)
    if as_json:
        typer.echo(json.dumps(d, indent=2, default=str))
        return
    con = Console()
    con.print(f"[bold]{d['run_id']}[/]  {d['kind']}  {d['status']}  started {_when(d['started_at'])}  ended {_when(d['ended_at'])}")
    con.print(f"backend {d['backend']}  cluster {d['cluster']}  workload {d['workload'] or '-'}  seed {d['seed']}")
    con.print(f"requests {d['requests']}  outcomes {d['outcomes']}")
    if d["failure_reasons"]:
        con.print(f"failures: {d['failure_reasons']}")
    if d["summary"]:
        s = d["summary"]
        con.print("summary: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items() if not isinstance(v, dict | list)))
    t = Table(title="policy timeline")
    for col in ("t (s)", "kind", "old", "new", "params", "source"):
        t.add_column(col)
    for e in d["policy_events"]:
        t.add_row(f"{e['t']:.2f}", e["kind"], e["old"] or "-", e["new"], json.dumps(e["params"]), e["source"])
    con.print(t)
    if d["requests_per_decode"]:
        con.print("per decode instance: " + ", ".join(f"{k}={v}" for k, v in d["requests_per_decode"].items()))
    for e in d["instance_events"]:
        con.print(f"  t={e['t']:.2f}s {e['instance_id']} {e['event']} {e['detail']}")
    con.print(f"config: {json.dumps(d['config'])}")


def register(app: typer.Typer) -> None:
    app.add_typer(runs_app, name="runs")

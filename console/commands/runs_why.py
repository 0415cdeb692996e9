"""`sibyl-console runs why RUN REQUEST_ID`: a request's timeline and each decision on it, candidate by candidate."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from console.commands.options import DbOpt, JsonOpt

if TYPE_CHECKING:
    from adapters.store import RunStore

# The run store (SQLAlchemy) and rich load inside the command.

TIMES = ("arrival", "queued", "prefill_start", "prefill_end", "decode_start", "first_token", "finish")
"""A request row's timestamps (seconds since the run started), in the order they happen."""


def timeline(row: dict[str, Any] | None, decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's stamps and its decisions, by time (seconds since the run started)."""
    out = [{"t": row[k], "event": k} for k in TIMES if row is not None and row.get(k) is not None]
    for d in decisions:
        out.append({"t": d["t"], "event": f"{d['kind']} {d['stage']}: {d['chosen'] or '-'} ({d['policy']})"})
    return sorted(out, key=lambda e: e["t"])


def _not_recorded(store: RunStore, run_id: str, request_id: str, row: dict[str, Any] | None) -> str:
    """Why a request has no decision records: unknown, sampled out, or a run that keeps none."""
    info = store.get_run(run_id)
    if row is None:
        return (
            f"request {request_id!r} is not in run {run_id} ({info.requests} requests recorded); "
            f"`sibyl-console runs export {run_id}` lists them"
        )
    if store.decision_count(run_id) == 0:
        return (
            f"run {run_id} recorded no decisions (decision records are off with [decisions] sample_rate = 0, "
            "and runs before schema 7 or of the simulator have none)"
        )
    records = ((info.summary or {}).get("decision_quality") or {}).get("records") or {}
    conf = (info.config or {}).get("decisions") or {}
    rate = records.get("sample_rate", conf.get("sample_rate", 1.0))
    bound = records.get("max_per_s", conf.get("max_per_s", "?"))
    skipped = ""
    if records:
        skipped = (
            f"; this run left out {records.get('skipped_by_rate', 0)} requests by the rate and "
            f"{records.get('skipped_by_bound', 0)} over the bound"
        )
    return (
        f"request {request_id!r} of run {run_id} has no decision records: sampling dropped them "
        f"(sample_rate {rate}, at most {bound} requests/s){skipped}"
    )


def why(store: RunStore, run: str, request_id: str) -> dict[str, Any]:
    """The request's row, timeline and decisions; a StoreError that says why when there are none."""
    from adapters.store import StoreError

    info = store.get_run(run)
    rows = [r for r in store.requests(info.run_id) if r["request_id"] == request_id]
    row = rows[-1] if rows else None
    decisions = store.decisions(info.run_id, request_id)
    if not decisions:
        raise StoreError(_not_recorded(store, info.run_id, request_id, row))
    return {
        "run_id": info.run_id,
        "request_id": request_id,
        "request": row,
        "timeline": timeline(row, decisions),
        "decisions": decisions,
    }


def runs_why(
    run: Annotated[str, typer.Argument(help="run id (or a unique prefix)")],
    request_id: Annotated[str, typer.Argument(help="the request id (X-Request-Id, or the one the gateway gave it)")],
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Why a request went where it went: its timeline, then every decision taken on it (routing,
    late bind, handoff score, rank, queue release, retries) with each candidate's features and score
    as the policy saw them, the choice, the margin to the runner-up and ties. Scores: lower is better;
    dim candidates were not eligible (a load guard, no room).

    Example: sibyl-console runs why r-20261122-1101 cmpl-42 --json | jq '.decisions[0].candidates'
    """
    from rich.console import Console
    from rich.table import Table

    from adapters.store import RunStore
    from console.why_tables import decision_table, num

    store = RunStore(db)
    store.mark_interrupted_runs()
    out = why(store, run, request_id)
    if as_json:
        typer.echo(json.dumps(out, indent=2, default=str))
        return
    con = Console()
    r = out["request"] or {}
    con.print(
        f"[bold]{request_id}[/] in {out['run_id']}: {r.get('status', '?')}  prefill {r.get('prefill_instance') or '-'}"
        f" → decode {r.get('decode_instance') or '-'}  prompt {num(r.get('prompt_tokens'))} tokens"
        f" (cached {num(r.get('cached_tokens'))}), output {num(r.get('output_tokens'))}"
        f"  TTFT {num(r.get('ttft'))} s  TPOT {num(r.get('tpot'))} s"
        + (f"  reason: {r['reason']}" if r.get("reason") else "")
    )
    tl = Table(title="timeline (s since the run started)", title_justify="left")
    tl.add_column("t", justify="right")
    tl.add_column("event")
    for e in out["timeline"]:
        tl.add_row(f"{e['t']:.3f}", e["event"])
    con.print(tl)
    for d in out["decisions"]:
        con.print(decision_table(d))

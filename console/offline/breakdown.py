"""A run's requests split by model, LoRA adapter or canary arm: groups, their metrics, runs compared group by group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from adapters.store import RunStore
from console.errors import ConsoleError
from console.offline.analysis import METRICS, policy_timeline, relative_to, run_metrics

BREAKDOWNS: dict[str, str] = {
    "model": "the base model each request ran on",
    "lora": "the LoRA adapter each request named",
    "arm": "the policy-canary arm each request ran in",
}
"""What a run's requests can be split by (request columns of the run store)."""
UNSET: dict[str, str] = {"model": "(unknown)", "lora": "(base model)", "arm": "(no canary)"}
"""The group of requests whose column is NULL: no model recorded, no adapter, no canary running."""
ARM_ORDER = {"control": 0, "canary": 1}
"""The control arm first, so the canary arm's differences are against it."""
BREAKDOWN_METRICS = ("requests", "failed", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "slo_attainment")
"""The figures `runs show` prints for each group."""


class BreakdownError(ConsoleError):
    """A breakdown that cannot be made: an unknown `--by`."""


def check_by(by: str) -> str:
    """`by` when it is one of BREAKDOWNS, else a BreakdownError naming them."""
    if by not in BREAKDOWNS:
        raise BreakdownError(f"--by {by!r}: expected one of {', '.join(BREAKDOWNS)}")
    return by


def _order(by: str, value: str | None) -> tuple[int, int, str]:
    """NULL first for lora (the base model) and last otherwise; the control arm before the canary arm."""
    if value is None:
        return (0 if by == "lora" else 2, 0, "")
    return (1, ARM_ORDER.get(value, len(ARM_ORDER)) if by == "arm" else 0, value)


def group_rows(rows: Sequence[Mapping[str, Any]], by: str) -> dict[str | None, list[Mapping[str, Any]]]:
    """Request rows by their `by` column's value (None: NULL), in presentation order."""
    check_by(by)
    groups: dict[str | None, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r.get(by), []).append(r)
    return {v: groups[v] for v in sorted(groups, key=lambda v: _order(by, v))}


def label(by: str, value: str | None) -> str:
    """A group's name as printed: its value, or what NULL means for that column."""
    return UNSET[by] if value is None else value


def breakdown(rows: Sequence[Mapping[str, Any]], by: str) -> list[dict[str, Any]]:
    """One entry per group: its value, label and metrics (analysis.run_metrics over its rows)."""
    return [
        {"value": value, "group": label(by, value), "metrics": run_metrics([dict(r) for r in members])}
        for value, members in group_rows(rows, by).items()
    ]


def worth_showing(rows: Sequence[Mapping[str, Any]], by: str) -> bool:
    """Whether `runs show` splits a run by `by`: by model when its requests ran on more than one (NULL
    counts as one), by adapter or arm when any request named an adapter or ran in a canary arm."""
    values = {r.get(by) for r in rows}
    if by == "model":
        return len(values) > 1
    return any(v is not None for v in values)


def breakdowns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The breakdowns `runs show` prints for a run's rows (only those `worth_showing`), by what they split by."""
    return {by: breakdown(rows, by) for by in BREAKDOWNS if worth_showing(rows, by)}


def compare_groups(store: RunStore, run_ids: Sequence[str], by: str) -> list[dict[str, Any]]:
    """Each run split by `by`, side by side: one entry per (run, group), run by run.

    `relative` is each group's difference to its baseline: with one run, its first group (the control
    arm, the base model, the first model); with several, the same group of the first run (None where
    the first run has no such group). `baseline` marks the entries the others are compared to."""
    check_by(by)
    out: list[dict[str, Any]] = []
    for rid in run_ids:
        info = store.get_run(rid)
        timeline = policy_timeline(store, info.run_id)
        for entry in breakdown(store.requests(info.run_id), by):
            out.append({"run": info.to_json(), "by": by, **entry, "policy_timeline": timeline})
    if not out:
        return out
    first_run = out[0]["run"]["run_id"]
    baseline = {e["value"]: e["metrics"] for e in out if e["run"]["run_id"] == first_run}
    for k, entry in enumerate(out):
        entry["baseline"] = k == 0 if len(run_ids) == 1 else entry["run"]["run_id"] == first_run
        base = out[0]["metrics"] if len(run_ids) == 1 else baseline.get(entry["value"])
        entry["relative"] = relative_to(base, entry["metrics"]) if base is not None else dict.fromkeys(METRICS)
    return out

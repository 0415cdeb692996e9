"""How `runs show` prints a run's breakdowns (by model, adapter, canary arm) and its advisor and canary events."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

READINGS_SHOWN = 10
"""A canary's last readings printed by `runs show` (`--json` has them all)."""
BREAKDOWN_TITLES = {"model": "by model", "lora": "by LoRA adapter", "arm": "by canary arm"}


def fmt_metric(key: str, v: Any) -> str:
    """A metric as `runs compare`, `whatif` and the breakdowns print it ("-": not measured)."""
    if v is None:
        return "-"
    if key in ("requests", "failed", "tpot_unknown"):
        return str(v)
    if key.startswith(("ttft", "tpot")):
        return f"{v * 1000:.1f} ms"
    if key in ("slo_attainment", "cached_share"):
        return f"{v:.1%}"
    return f"{v:.2f}"


def breakdown_tables(breakdowns: dict[str, list[dict[str, Any]]]) -> list[Table]:
    """One table per breakdown: a row per group, its figures in columns."""
    from rich.markup import escape
    from rich.table import Table

    from console.offline.breakdown import BREAKDOWN_METRICS

    tables = []
    for by, groups in breakdowns.items():
        t = Table(title=BREAKDOWN_TITLES.get(by, f"by {by}"))
        t.add_column(by)
        for key in BREAKDOWN_METRICS:
            t.add_column(key, justify="right")
        for g in groups:
            t.add_row(escape(g["group"]), *[fmt_metric(key, g["metrics"][key]) for key in BREAKDOWN_METRICS])
        tables.append(t)
    return tables


def _when(t: float | None) -> str:
    return "-" if t is None else f"t={t:.1f}s"


def advice_lines(spans: list[dict[str, Any]]) -> list[str]:
    """What was advised when: a line per span of the same advice."""
    if not spans:
        return []
    out = [f"advisor: {sum(s['readings'] for s in spans)} advice over {len(spans)} spans"]
    for s in spans:
        when = _when(s["from_t"]) if s["readings"] == 1 else f"t={s['from_t']:.1f}-{s['to_t']:.1f}s"
        action = f" [{s['decision']}]" if s.get("decision") else ""
        detail = f": {s['detail']}" if s["detail"] else ""
        out.append(f"  {when} advised {s['advised']} ({s['readings']}x){action}{detail}")
    return out


def _plan(data: dict[str, Any]) -> str:
    """A canary's plan in words, from its start event's data ({"plan": CanaryPlan.to_json(), "source": ...})."""
    plan = data["plan"] if isinstance(data.get("plan"), dict) else data
    parts = []
    if plan.get("share") is not None:
        parts.append(f"share {plan['share']:.0%}")
    if plan.get("duration_s") is not None:
        parts.append(f"for {plan['duration_s']:.0f} s")
    if plan.get("params"):
        parts.append(f"params {json.dumps(plan['params'])}")
    if data.get("source"):
        parts.append(f"from {data['source']}")
    return f" ({', '.join(parts)})" if parts else ""


def canary_lines(lives: list[dict[str, Any]]) -> list[str]:
    """Every canary's life: its start, its last readings and its end with the verdict."""
    out = []
    for life in lives:
        start = life["start"]
        head = f"canary {life['canary'] or '-'}: {life['kind'] or '-'} {life['policy'] or '-'}"
        if start is None:
            out.append(f"{head}, start not recorded")
        else:
            detail = f": {start['detail']}" if start["detail"] else ""
            out.append(f"{head}, started {_when(start['t'])}{_plan(start['data'])}{detail}")
        readings = life["readings"]
        if len(readings) > READINGS_SHOWN:
            out.append(f"  ... {len(readings) - READINGS_SHOWN} earlier readings (--json has them all)")
        for r in readings[-READINGS_SHOWN:]:
            out.append(f"  {_when(r['t'])} {r['decision'] or '-'}: {r['detail']}")
        end = life["end"]
        if end is None:
            out.append("  no end recorded: it was running when the run's record stopped")
        else:
            out.append(f"  ended {_when(end['t'])}: {end['decision'] or '-'}: {end['detail']}")
    return out

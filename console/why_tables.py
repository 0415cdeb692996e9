"""Why a request went where it did, as Rich tables of its decision records: shared by `runs why` and the inspector."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def num(v: Any) -> str:
    """A value as a table cell: "-" for none, 4 significant digits for a float."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def decision_table(d: dict[str, Any]) -> Table:
    """One decision: a row per candidate with its score and every feature, the chosen one marked."""
    margin = "-" if d["margin"] is None else f"{d['margin']:.4g}"
    scorer = f" scored by {d['scorer']}" if d.get("scorer") and d["scorer"] != d["policy"] else ""
    title = (
        f"t={d['t']:.3f}s  {d['kind']} {d['stage']} by {d['policy']}{scorer}: chose {d['chosen'] or '-'}"
        f"  (margin {margin}, ties {d['ties']})"
    )
    t = Table(title=title, title_justify="left")
    t.add_column("candidate")
    t.add_column(d["score_name"] or "score", justify="right")
    features = [f for f in dict.fromkeys(f for c in d["candidates"] for f in c["features"]) if f != d["score_name"]]
    for f in features:
        t.add_column(f, justify="right")
    for c in d["candidates"]:
        name = (
            f"[bold green]▶ {c['name']}[/]" if c["chosen"] else (c["name"] if c["eligible"] else f"[dim]{c['name']}[/]")
        )
        t.add_row(name, num(c["score"]), *[num(c["features"].get(f)) for f in features])
    if d["info"]:
        t.caption = ", ".join(f"{k}={num(v)}" for k, v in d["info"].items())
        t.caption_justify = "left"
    return t

"""`sibyl-console advise`: the live what-if advisor's latest advice, ranked, with its error."""

from __future__ import annotations

import json
from typing import Any

import typer

from console.commands.options import JsonOpt, TokenOpt, UrlOpt


def _ms(x: Any) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _pct(x: Any, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.1%}" if signed else f"{x:.1%}"


def gain_text(entry: dict[str, Any]) -> str:
    """A candidate's gain over the active policies, shown only past the advisor's error."""
    if entry["active"]:
        return "(active)"
    if not entry["shown"]:
        return "within error"
    g = entry["gain"]
    return f"TTFT {_pct(g['ttft_p99'], True)}, attain {_pct(g['attainment'], True)}"


def advise(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Which policy would do better right now: the recent window re-simulated under each candidate.

    A candidate's gain over the active policies is shown only when it exceeds the advisor's own
    recent error (its prediction of the active policies against what they did). Needs
    `\\[advisor] enabled = true` on the console (docs/advisor.md); it advises on `\\[advisor] pool`
    (default: the first pool), which the first line names.

    Example: sibyl-console advise --json | jq '.advice.ranked[0]'
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from console.control_client import ControlClient

    answer = ControlClient(url, token).advice()
    if as_json:
        typer.echo(json.dumps(answer, indent=2))
        return
    con = Console()
    if not answer.get("enabled"):
        con.print("the advisor is off: set \\[advisor] enabled = true in the console's configuration (docs/advisor.md)")
        return
    share = answer.get("cpu_share")
    con.print(
        f"advisor on pool {escape(str(answer.get('pool') or '-'))}: every {answer['period_s']:g} s over the last "
        f"{answer['window_s']:g} s, apply = {answer['apply']}; "
        f"worker pid {answer.get('pid')}, {'-' if share is None else f'{share:.1%}'} of a core"
    )
    advice = answer.get("advice")
    if advice is None:
        con.print(f"no advice yet{': ' + answer['error'] if answer.get('error') else ''}")
        return
    w, obs, err, bound = advice["window"], advice["observed"], advice["error"], advice["bound"]
    con.print(
        f"window {max(w['start'], 0.0):.0f}-{w['end']:.0f} s of the run: {w['requests']} requests on "
        f"{advice['shape']}, profile {advice['profile']}{'; a swap or canary inside it' if w['swapped'] else ''}"
    )
    if advice.get("key_blocks", 1) > 1:  # the worker modelled the prefix cache coarsely ([advisor] coarse_*)
        con.print(f"cache modelled in {advice['cache_model']}: {advice['cache_why']}")
    t = Table(title=f"candidates, best first (observed P99 TTFT {_ms(obs['ttft_p99'])} ms, attainment "
              f"{_pct(obs['attainment'])})")
    t.add_column("candidate", no_wrap=True)
    for col in ("TTFT p50/p99 ms", "TPOT p99 ms", "attain", "refused", "prefix hit", "gain"):
        t.add_column(col)
    for r in advice["ranked"]:
        p = r["predicted"]
        t.add_row(
            r["label"],
            f"{_ms(p['ttft_p50'])}/{_ms(p['ttft_p99'])}",
            _ms(p["tpot_p99"]),
            _pct(p["attainment"]),
            str(p["refusals"]),
            _pct(p["prefix_hit_rate"]),
            gain_text(r),
        )
    con.print(t)
    error = "unknown (the window mixed two policies)" if err is None else (
        f"{_pct(err['ttft_p99'])} on P99 TTFT, {_pct(err['attainment'])} on attainment"
    )
    con.print(
        f"the advisor's error on the active policies: {error}; a gain must clear {_pct(bound['ttft_p99'])} "
        f"(P99 TTFT) or {_pct(bound['attainment'])} (attainment)"
    )
    con.print(str(answer.get("detail") or ""))


def register(app: typer.Typer) -> None:
    app.command("advise")(advise)

"""`runs show`'s policy timeline and decision quality (console/commands/runs_policies.py): the pool of each policy
event and each pool's decision quality when a run had several pools; a run of one pool, or one recorded before pools
(schema 9), prints as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from adapters.store import RunStore
from console.cli import _register_commands, app
from console.commands.runs_policies import quality_lines, run_pools, run_quality_lines

_register_commands()
runner = CliRunner()


def quality(scored: int, still_best: float | None) -> dict[str, Any]:
    """A pool's decision quality as the live console's summary keeps it (no prefix keys, no records)."""
    return {
        "decode_still_best": still_best,
        "decode_scored": scored,
        "prefix_achieved_tokens": 0,
        "prefix_achievable_tokens": 0,
        "prefix_hit_share": None,
        "prefix_decisions": 0,
        "records": None,
    }


def event(t: float, new: str, pool: str | None, source: str = "config") -> dict[str, Any]:
    return {"t": t, "kind": "routing", "old": None, "new": new, "params": {}, "source": source, "pool": pool}


def test_a_run_has_several_pools_when_its_summary_or_its_events_name_several() -> None:
    both = [event(0.0, "round_robin", "A"), event(0.0, "round_robin", "B")]
    assert run_pools(both, None) == ["A", "B"]  # an interrupted run: no summary, its events name both
    assert run_pools([event(0.0, "round_robin", "B")], {"pools": {"A": {}, "B": {}}}) == ["A", "B"]
    assert run_pools([event(0.0, "round_robin", "tiny"), event(5.0, "least_load", "tiny", "cli")], {}) == []
    assert run_pools([event(0.0, "round_robin", None)], {"decision_quality": quality(1, 1.0)}) == []  # schema 9


def test_each_pools_decision_quality_is_printed_under_its_name() -> None:
    summary = {
        "decision_quality": quality(3, 2 / 3),
        "pools": {
            "A": {"model": "A", "decision_quality": quality(3, 2 / 3)},
            "chat": {"model": "org/chat", "decision_quality": quality(2, 1.0)},
            "idle": {"model": "idle", "decision_quality": quality(0, None)},
        },
    }
    assert run_quality_lines(summary) == [
        "pool A:",
        "  decision quality: 66.7% of 3 decode choices were still the least loaded instance when decoding began",
        "pool chat (model org/chat):",
        "  decision quality: 100.0% of 2 decode choices were still the least loaded instance when decoding began",
        "pool idle: no decisions scored",
    ]
    one = {"decision_quality": quality(4, 0.5)}
    assert run_quality_lines(one) == quality_lines(one["decision_quality"]) == [
        "decision quality: 50.0% of 4 decode choices were still the least loaded instance when decoding began"
    ]
    assert run_quality_lines(None) == []


def show(db: Path, run_id: str) -> str:
    result = runner.invoke(app, ["runs", "show", run_id, "--db", str(db)], terminal_width=200)
    assert result.exit_code == 0, (result.stdout, result.exception)
    return result.stdout


def timeline_rows(text: str) -> list[list[str]]:
    """The policy timeline as rich draws it: its header's and its rows' cells, stripped."""
    lines = text.splitlines()
    start = next(k for k, line in enumerate(lines) if "policy timeline" in line)
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("└"):
            break
        if line.startswith(("│", "┃")):
            rows.append([cell.strip() for cell in line.replace("┃", "│").strip("│").split("│")])
    return rows


def test_show_puts_the_pool_beside_each_swap_only_when_the_run_had_several(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    s = RunStore(db)
    two = s.create_run(kind="live", backend="emulator", cluster="2P2D", policy="round_robin")
    for pool in ("A", "B"):
        s.add_policy_event(two, t=0.0, kind="routing", old=None, new="round_robin", params={}, source="config",
                           pool=pool)
    s.add_policy_event(two, t=4.5, kind="routing", old="round_robin", new="least_load", params={}, source="cli",
                       pool="B")
    pools = {"A": {"model": "A", "decision_quality": quality(3, 1.0)}, "B": {"model": "B", "decision_quality":
                                                                            quality(2, 0.5)}}
    s.finish_run(two, "completed", {"decision_quality": quality(3, 1.0), "pools": pools})
    one = s.create_run(kind="live", backend="emulator", cluster="1P1D", policy="round_robin")
    s.add_policy_event(one, t=0.0, kind="routing", old=None, new="round_robin", params={}, source="config",
                       pool="tiny")
    s.add_policy_event(one, t=2.0, kind="routing", old="round_robin", new="sibyl", params={}, source="api",
                       pool="tiny")
    s.finish_run(one, "completed", {"decision_quality": quality(5, 0.8)})
    s.close()

    text = show(db, two)
    assert timeline_rows(text) == [
        ["t (s)", "pool", "kind", "old", "new", "params", "source"],
        ["0.00", "A", "routing", "-", "round_robin", "{}", "config"],
        ["0.00", "B", "routing", "-", "round_robin", "{}", "config"],
        ["4.50", "B", "routing", "round_robin", "least_load", "{}", "cli"],
    ]
    assert "pool A:\n  decision quality: 100.0% of 3 decode choices" in text
    assert "pool B:\n  decision quality: 50.0% of 2 decode choices" in text
    shown = json.loads(runner.invoke(app, ["runs", "show", two, "--db", str(db), "--json"]).stdout)
    assert [e["pool"] for e in shown["policy_events"]] == ["A", "B", "B"]

    text = show(db, one)
    assert timeline_rows(text) == [
        ["t (s)", "kind", "old", "new", "params", "source"],
        ["0.00", "routing", "-", "round_robin", "{}", "config"],
        ["2.00", "routing", "round_robin", "sibyl", "{}", "api"],
    ]
    assert "\ndecision quality: 80.0% of 5 decode choices" in text and "pool tiny" not in text

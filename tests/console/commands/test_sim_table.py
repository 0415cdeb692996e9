"""`sim`'s table in a narrow terminal: the most telling columns whole, the rest named with `--json`."""

from __future__ import annotations

import math
import os
from typing import Any

from rich.console import Console

from console.commands.sim_table import COLUMNS, results_table


def _row(policy: str, params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "policy": policy,
        "params": params,
        "run_id": "r-20261129-001253-656f",
        "requests": 2000,
        "throughput_tok_s": 18234.4,
        "ttft_p50": 0.4123,
        "ttft_p99": 1.9877,
        "tpot_mean": 0.05123,
        "tpot_p50": 0.0491,
        "tpot_p99": 0.0987,
        "tpot_p999": 0.1234,
        "slo_attainment": 0.9712,
        "optimal_assignment_ratio": math.nan,
        "shed": 0,
        "expired": 3,
        "scale_events": 0,
        **extra,
    }


def _render(rows: list[dict[str, Any]], width: int) -> str:
    with open(os.devnull, "w") as sink:
        console = Console(width=width, record=True, file=sink)
        console.print(results_table(rows, console.width))
    return console.export_text()


ROWS = [_row("prefix_aware", {}), _row("least_load", {"by": "tokens"}), _row("sibyl", {})]


def test_at_80_columns_the_columns_shown_are_whole_and_the_rest_named() -> None:
    text = _render(ROWS, 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    header = next(line for line in text.splitlines() if "policy" in line)
    for kept in ("policy", "SLO att.", "TTFT p99", "TPOT p99", "tok/s"):
        assert kept in header, kept
    for row in text.splitlines():
        if "least_load" in row:
            assert "least_load(by=tokens)" in row and "97.1%" in row and "1987.7" in row and "18234" in row
    # 1 (edge) + 3 a column + the widest cell: policy 21, tok/s 5, TTFT p50 8, TTFT p99 8, TPOT p99 8,
    # SLO att. 8 make 77; the next by rank, TPOT p50, would make 88.
    assert max(len(line) for line in text.splitlines() if "│" in line) == 77
    caption = " ".join(text.split()[text.split().index("left") :])
    assert caption == (
        "left out at 80 columns: run, req, TPOT mean, TPOT p50, TPOT p99.9, opt. assign, shed, expired, "
        "scale ev. (--json prints every field)"
    )


def test_a_wide_terminal_shows_every_column_and_no_caption() -> None:
    cached = _row("sibyl", {}, prefix_hit_rate=0.5, kv_transferred_tokens=12000, kv_transferred_share=0.25)
    text = _render([cached], 400)
    header = next(line for line in text.splitlines() if "policy" in line)
    assert [c.header for c in COLUMNS if c.header in header] == [c.header for c in COLUMNS]
    assert "left out" not in text and "12.0k (25%)" in text


def test_columns_are_kept_by_importance_as_the_terminal_narrows() -> None:
    by_rank = [c.header for c in sorted(COLUMNS, key=lambda c: c.rank) if not c.cached_only]
    for width in range(200, 20, -7):
        header = next(line for line in _render(ROWS, width).splitlines() if "policy" in line)
        shown = [h.strip() for h in header.strip("┃ ").split("┃")]
        assert [h for h in by_rank if h in shown] == by_rank[: len(shown)], width  # the most telling ones
        assert shown == [c.header for c in COLUMNS if c.header in shown], width  # in the table's order

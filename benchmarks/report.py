"""Formatting shared by the benchmarks' reports: milliseconds, numbers and markdown tables."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any


def ms(x: float | None) -> str:
    """Seconds as milliseconds with one decimal; "-" when unknown (None or NaN)."""
    return "-" if x is None or math.isnan(x) else f"{x * 1e3:.1f}"


def to_ms(x: float | None) -> float | None:
    """Seconds as milliseconds, None kept (for JSON reports)."""
    return None if x is None else x * 1000


def num(x: float | None, fmt: str = ".0f") -> str:
    """`x` formatted with `fmt`; "-" when None."""
    return "-" if x is None else format(x, fmt)


def md_row(cells: Iterable[object]) -> str:
    """One markdown table row: `| a | b | c |`."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_header(columns: Sequence[str], align: str) -> list[str]:
    """A markdown table's header row and its alignment row. `align` has one letter per column:
    "l" (`---`) or "r" (`---:`)."""
    if len(align) != len(columns):
        raise ValueError(f"{len(columns)} columns but {len(align)} alignment letters")
    return [md_row(columns), "|" + "".join("---:|" if a == "r" else "---|" for a in align)]


def load_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a resumable sweep's results file (none yet: []); a last line cut short by an
    interrupted run is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


class Progress:
    """A resumable sweep's results: each row appended to `path` as it lands, with a progress line
    (`describe(row)` says what the row measured)."""

    def __init__(
        self,
        path: Path,
        rows: list[dict[str, Any]],
        total: int,
        already: int,
        describe: Callable[[dict[str, Any]], str],
        log: Callable[[str], None],
    ) -> None:
        self.path, self.rows, self.total, self.count = path, rows, total, already
        self.describe, self.log = describe, log
        self.started = time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.rows.append(row)
        self.count += 1
        self.log(
            f"[{self.count}/{self.total}] {row['cell']} {row['policy']}: {self.describe(row)} "
            f"({row['sim_wall_s']:.1f} s; {time.perf_counter() - self.started:.0f} s elapsed)"
        )


def by_cell(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Rows grouped by cell, then policy label (the last run of a label wins)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["cell"], {})[r["policy"]] = r
    return out

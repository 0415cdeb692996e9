"""Formatting shared by the benchmarks' reports: milliseconds, numbers and markdown tables."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
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

"""Fidelity of the emulator and the simulator against real vLLM: the comparison table and its bounds.

The real-vLLM stage (tests/vllm/test_real_vllm.py) replays the same trace slices against the real
P/D pair (several times each, for the run-to-run spread), against the emulator and through `runs
whatif` (the simulator), both with the profile calibrated from separate real runs. This module turns
their metrics into one table and says which predictions fall outside which bound.

Deviations are measured against the median of the real runs. Each row has issue 16's target (light
load p50 ±15% and p99 ±30%, queueing load p50 ±25%; a prediction within the real runs' own range
also meets it) and a gate the stage fails on: the target plus the row's run-to-run spread of real
vLLM measured in the same stage run ((max − min) / median). Real vLLM on two shared cores does not
repeat itself closer than that (light TPOT p50 6-17 ms over eleven replays of one slice in a day), so no
prediction can be judged closer; rows the issue gives no target (queueing p99) are gated at ±50%
plus the spread. docs/fidelity.md has the measured spreads and the table.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

LOADS = ("light", "queueing")
METRICS = ("ttft", "tpot")
STATS = ("p50", "p99")

TARGETS: dict[tuple[str, str], float] = {("light", "p50"): 0.15, ("light", "p99"): 0.30, ("queueing", "p50"): 0.25}
"""Issue 16's bounds as relative deviations (queueing p99 has none)."""
UNTARGETED = 0.5
"""The gate's base for rows without a target (before this work the emulator's TTFT was off by 100x)."""


@dataclass(frozen=True)
class Row:
    """One (load, metric, statistic) of the table: real runs, predictions and their deviations."""

    load: str
    metric: str
    stat: str
    real: tuple[float, ...]
    predicted: dict[str, float]

    @property
    def reference(self) -> float:
        """What predictions are judged against: the median of the real runs."""
        return statistics.median(self.real)

    @property
    def spread(self) -> float:
        """Run-to-run spread of real vLLM: (max − min) / median."""
        return (max(self.real) - min(self.real)) / self.reference if self.reference else 0.0

    def deviation(self, source: str) -> float:
        return self.predicted[source] / self.reference - 1.0 if self.reference else 0.0

    @property
    def target(self) -> float | None:
        return TARGETS.get((self.load, self.stat))

    def meets_target(self, source: str) -> bool | None:
        if self.target is None:
            return None
        value = self.predicted[source]
        return abs(self.deviation(source)) <= self.target or min(self.real) <= value <= max(self.real)

    @property
    def gate(self) -> float:
        """The target (or UNTARGETED) widened by real vLLM's own spread in this stage run."""
        return (self.target if self.target is not None else UNTARGETED) + self.spread

    def within_gate(self, source: str) -> bool:
        return abs(self.deviation(source)) <= self.gate


def build_rows(real: dict[str, list[dict[str, Any]]], predicted: dict[str, dict[str, dict[str, Any]]]) -> list[Row]:
    """Rows from metrics dicts (`ttft_p50`, ... in seconds): real[load] is one dict per real run,
    predicted[source][load] one dict per predictor ("emulator", "simulator")."""
    rows = []
    for load in LOADS:
        for metric in METRICS:
            for stat in STATS:
                key = f"{metric}_{stat}"
                rows.append(
                    Row(
                        load,
                        metric,
                        stat,
                        tuple(float(m[key]) for m in real[load]),
                        {src: float(by_load[load][key]) for src, by_load in predicted.items()},
                    )
                )
    return rows


def failures(rows: list[Row], ungated: Collection[tuple[str, ...]] = ()) -> list[str]:
    """What lies outside the gate, one line each (empty: the stage passes). `ungated` entries are left out
    (reported in the table, not judged): (source, metric) at every load, (source, metric, load) at one,
    (source, metric, load, stat) one row."""
    return [
        f"{r.load} {r.metric.upper()} {r.stat}: "
        f"{src} {r.predicted[src] * 1000:.1f} ms vs real {r.reference * 1000:.1f} ms "
        f"({r.deviation(src):+.0%}, gate ±{r.gate:.0%}: {'the target' if r.target is not None else 'no target'} "
        f"{r.gate - r.spread:.0%} + the real runs' spread {r.spread:.0%})"
        for r in rows
        for src in r.predicted
        if not r.within_gate(src)
        and not {(src, r.metric), (src, r.metric, r.load), (src, r.metric, r.load, r.stat)} & set(ungated)
    ]


def table(rows: list[Row]) -> str:
    """The fidelity table in Markdown (milliseconds)."""
    sources = list(rows[0].predicted) if rows else []
    head = [
        "load",
        "metric",
        "real runs (ms)",
        "real spread",
        *[f"{s} (ms, Δ vs real median)" for s in sources],
        "target",
        *[f"{s} meets target" for s in sources],
        "gate",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        target = f"±{r.target:.0%}" if r.target is not None else "-"
        preds = [f"{r.predicted[s] * 1000:.1f} ({r.deviation(s):+.0%})" for s in sources]
        met = [{True: "yes", False: "no", None: "-"}[r.meets_target(s)] for s in sources]
        lines.append(
            f"| {r.load} | {r.metric.upper()} {r.stat} | "
            + " / ".join(f"{v * 1000:.1f}" for v in r.real)
            + f" | {r.spread:.0%} | "
            + " | ".join(preds)
            + f" | {target} | "
            + " | ".join(met)
            + f" | ±{r.gate:.0%} |"
        )
    return "\n".join(lines)

"""Where adapter-aware routing wins: a simulated sweep over the adapter count, max_loras, the skew, the load and the
cluster, adapter-blind least_load and sibyl against lora_affinity wrapping each.

Workload: the Azure LLM inference 2023 conversation trace (its first --requests rows: prompts mean 1.2k
tokens, outputs mean 254), rescaled to each cell's rate; each request gets one of N adapters drawn
from Zipf(skew) (core/traces/lora.py, seeded). Profile roofline-h100-qwen2.5-7b (a 7-8B model, the size
`lora_load_s`'s 0.5 s prior is for), decode under processor sharing, SLO TTFT ≤ 2 s and TPOT ≤ 100 ms.
The simulator's LoRA model (core/sim/cluster/lora.py): `max_loras` slots per instance with LRU
eviction, a load stalls its instance for lora_load_s, each distinct adapter in a step adds
lora_per_adapter_step_s, at most max_loras adapters per batch, both legs under the adapter.

The grid is the issue's target cell (50 adapters, Zipf(1.0), max_loras 4, 4P4D, 3.5 req/s: the load
where adapter-blind least_load meets about 80% of the SLO) and its neighbours, one axis at a time; no
policy default was tuned on any cell. `--quick` runs the target cell alone on fewer requests. Each cell's
"most cut" is the baseline's loads over the fewest any routing could make on its requests (Belady's MIN
on each role's pooled slots, `fewest_loads`): how much of what is possible a policy got.

    python -m benchmarks.lora_sweep            # the grid, under ~1 min on this machine
    python -m benchmarks.lora_sweep --quick
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from benchmarks.paths import add_traces_option, traces_dir
from console.offline.simulate import SimPlan, run_one
from core.perf import get_profile
from core.slo import SLOClass
from core.traces import read_trace
from core.traces.lora import zipf_mix

PROFILE = "roofline-h100-qwen2.5-7b"
TRACE = "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
POLICIES: list[tuple[str, str, dict[str, Any]]] = [
    ("least_load", "least_load", {}),
    ("affinity(least_load)", "lora_affinity", {"routing": "least_load"}),
    ("sibyl", "sibyl", {}),
    ("affinity(sibyl)", "lora_affinity", {"routing": "sibyl"}),
]
"""(label, policy, params): each baseline, then lora_affinity wrapping it (its default params)."""


@dataclass(frozen=True)
class Cell:
    adapters: int = 50
    skew: float = 1.0
    max_loras: int = 4
    rate: float = 3.5
    prefill: int = 4
    decode: int = 4

    def label(self) -> str:
        return (
            f"{self.adapters} ad, zipf {self.skew:g}, max_loras {self.max_loras}, "
            f"{self.prefill}P{self.decode}D, {self.rate:g} req/s"
        )


TARGET = Cell()
NEIGHBOURS = [
    replace(TARGET, adapters=10),
    replace(TARGET, adapters=200),
    replace(TARGET, skew=0.5),
    replace(TARGET, skew=1.5),
    replace(TARGET, max_loras=2),
    replace(TARGET, max_loras=8),
    replace(TARGET, rate=2.5),
    replace(TARGET, rate=5.0),
    replace(TARGET, prefill=4, decode=8, rate=5.0),
    replace(TARGET, prefill=8, decode=8, rate=7.0),
]


def fewest_loads(adapters: Sequence[str | None], slots: int) -> int:
    """Belady's MIN: the fewest adapter loads that serving `adapters` in arrival order takes from one
    pool of `slots` (on a miss, evict the adapter needed again furthest ahead). One pool of a role's
    instances × max_loras slots can place anything its instances can, and ignores that an adapter in
    use cannot be evicted, so no routing, even one that knew every future request, loads less on
    that role's instances."""
    ahead: list[int] = [0] * len(adapters)
    seen: dict[str, int] = {}
    for i in range(len(adapters) - 1, -1, -1):
        a = adapters[i]
        if a is not None:
            ahead[i], seen[a] = seen.get(a, len(adapters)), i
    held: dict[str, int] = {}
    loads = 0
    for i, a in enumerate(adapters):
        if a is None:
            continue
        if a not in held:
            loads += 1
            if len(held) >= slots:
                del held[max(held, key=held.__getitem__)]
        held[a] = ahead[i]
    return loads


def run_cell(cell: Cell, base: Any, seed: int) -> list[dict[str, Any]]:
    """Every policy on the cell's identical arrivals and adapters: one row each, with the fewest loads
    any routing could make there (`fewest_loads` on each role)."""
    t = base.with_rate(cell.rate)
    mix = zipf_mix(len(t), cell.adapters, cell.skew, seed)
    fewest = fewest_loads(mix, cell.prefill * cell.max_loras) + fewest_loads(mix, cell.decode * cell.max_loras)
    plan = SimPlan(
        arrivals=t.arrivals,
        prompt_tokens=t.prompt_tokens,
        output_tokens=t.output_tokens,
        workload=t.name,
        profile=get_profile(PROFILE),
        n_prefill=cell.prefill,
        n_decode=cell.decode,
        mode="ps",
        policies=[(name, params) for _, name, params in POLICIES],
        slo=SLOClass(),
        seed=seed,
        shadow=False,
        lora=mix,
        max_loras=cell.max_loras,
    )
    rows = []
    for label, name, params in POLICIES:
        row, _ = run_one(plan, name, params)
        rows.append({"cell": cell, "label": label, "fewest_loads": fewest, **row})
    return rows


def _pct(new: float, old: float) -> str:
    return f"{100.0 * (new - old) / old:+.0f}%" if old else "—"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per cell and policy, TTFT p50/p99, loads per minute, SLO attainment, P99 TPOT, and each
    lora_affinity row against the baseline it wraps (loads ÷, the most any routing could cut them to
    (÷ `fewest_loads`), P99 TTFT and P99 TPOT change)."""
    head = (
        "| cell | policy | TTFT p50 s | TTFT p99 s | loads/min | SLO | TPOT p99 ms | loads cut | most cut "
        "| TTFT p99 | TPOT p99 |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    by_label: dict[tuple[Cell, str], dict[str, Any]] = {(r["cell"], r["label"]): r for r in rows}
    for r in rows:
        cut = most = ttft = tpot = ""
        if r["label"].startswith("affinity("):
            b = by_label[(r["cell"], r["label"][len("affinity(") : -1])]
            loads, base_loads = r["lora_loads"], b["lora_loads"]
            cut = f"{base_loads / loads:.1f}×" if loads else "∞"
            most = f"{base_loads / r['fewest_loads']:.1f}×" if r["fewest_loads"] else "∞"
            ttft, tpot = _pct(r["ttft_p99"], b["ttft_p99"]), _pct(r["tpot_p99"], b["tpot_p99"])
        lines.append(
            f"| {r['cell'].label()} | {r['label']} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | "
            f"{r['lora_loads_per_min']:.0f} | {100 * r['slo_attainment']:.1f}% | {1000 * r['tpot_p99']:.1f} | "
            f"{cut} | {most} | {ttft} | {tpot} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000, help="rows of the trace (default 3000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the adapter mix")
    ap.add_argument("--quick", action="store_true", help="the target cell alone, on 1500 requests")
    add_traces_option(ap)
    args = ap.parse_args(argv)
    requests = 1500 if args.quick else args.requests
    base = read_trace(traces_dir(args.traces) / TRACE, limit=requests)
    cells = [TARGET] if args.quick else [TARGET, *NEIGHBOURS]
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for cell in cells:
        rows.extend(run_cell(cell, base, args.seed))
    print(f"{len(base)} requests of {TRACE}, {PROFILE}, ps decode, SLO TTFT ≤ 2 s and TPOT ≤ 100 ms, seed {args.seed}")
    print(table(rows))
    print(f"({len(cells)} cells × {len(POLICIES)} policies in {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()

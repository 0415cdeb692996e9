"""Where prefix-aware routing wins: a resumable sweep over real traces with shared prefixes (and a
control without), P:D ratios, loads and cache sizes, with an oracle as the reference (issue 27).

Traces (the first --requests rows of each, arrivals rescaled to the cell's rate):
  mooncake-conv   Mooncake FAST'25 conversation trace (hash ids: multi-turn reuse, a shared
                  system prompt)
  mooncake-synth  Mooncake FAST'25 synthetic trace (Poisson arrivals, 64 % of blocks repeat)
  azure-conv      Azure LLM 2023 conversation trace: no prefix information, nothing to reuse (the
                  control: no policy should lose to least_load there)

Profile: the H100 roofline of Qwen2.5-7B with a 128k context (Mooncake prompts average 12k
tokens, p99 85k, max 126k: the H20/Qwen3-32B profile of the other sweeps takes 12 s to prefill
the mean prompt, so no load has a P99 TTFT of 2-10 s there). Cache size is a multiple of the
profile's KV capacity per instance (x1: GPU memory only; x4: with a host-memory tier as
LMCache or Mooncake's store add); it is the same on prefill and decode instances.

Policies: least_load, round_robin, sibyl (the console's default before prefix_aware), session_affinity,
prefix_aware with the approximate and with the precise prefix source, prefix_pd (precise), and
the oracle (simulator only: exact caches plus what the queued requests will cache). The
prefix-aware ones decode by sibyl (their default). "precise" is the exact caches (what vLLM's KV
events deliver live); "approximate" is the router's own past decisions (TTL 1,800 s, capped at the
instance's capacity).

Hit rate = prompt tokens found cached where the prefill ran / prompt tokens. The ideal is every
shared prefix reused: one unbounded cache that has seen every earlier prompt, each hit capped as
vLLM caps it (whole blocks, at most prompt − 1 tokens). The TTFT floor is the P99 over requests
of the prefill of their uncached tokens under that ideal, with no queue: no router can go below it.

Every (cell, policy) result is appended to a JSONL file as soon as it finishes; a re-run skips
what is already there. At the end (and with --report-only) the file becomes OUT.md and OUT.json.

Usage:
  python -m benchmarks.prefix_sweep                           # the full grid (10-11 min on an idle machine)
  python -m benchmarks.prefix_sweep --quick --out /tmp/q.jsonl  # 2 cells, 200 rows (seconds)
  python -m benchmarks.prefix_sweep --only trace=mooncake-conv --only policy=least_load,oracle
  python -m benchmarks.prefix_sweep --report-only
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.paths import add_traces_option, traces_dir
from benchmarks.prefix_cells import (
    APPROX,
    BASELINE,
    DEFAULT,
    GRIDS,
    OPERATING_POINT,
    OPERATING_POINT_QUEUE,
    OPERATING_POINT_TP4,
    OPERATING_POINTS,
    ORACLE,
    POLICIES,
    PRECISE,
    REQUESTS,
    TRACES,
    Cell,
    PolicyCase,
    floors,
    ideal_cached,
    load_trace,
    plan_for,
    run_cell,
    sweep_profile,
)
from benchmarks.prefix_report import fmt_s, markdown, table_rows, targets, write_report
from benchmarks.report import Progress, load_rows

__all__ = [
    "APPROX",
    "BASELINE",
    "DEFAULT",
    "GRIDS",
    "OPERATING_POINT",
    "OPERATING_POINT_QUEUE",
    "OPERATING_POINT_TP4",
    "OPERATING_POINTS",
    "ORACLE",
    "POLICIES",
    "PRECISE",
    "REQUESTS",
    "TRACES",
    "Cell",
    "PolicyCase",
    "floors",
    "ideal_cached",
    "load_trace",
    "main",
    "markdown",
    "plan_for",
    "run_cell",
    "sweep",
    "sweep_profile",
    "table_rows",
    "targets",
    "write_report",
]


def sweep(
    cells: Sequence[Cell],
    policies: Sequence[PolicyCase],
    out: Path,
    *,
    requests: int,
    folder: Path,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> list[dict[str, Any]]:
    """Run what `out` does not hold yet (same requests and profile), appending each row as it lands."""
    rows = load_rows(out)
    profiles = {c.key: sweep_profile(c.tp).name for c in cells}
    done = {
        (r["cell"], r["policy"])
        for r in rows
        if r.get("requests") == requests and r.get("profile") == profiles.get(r["cell"])
    }
    total = len(cells) * len(policies)
    already = sum((c.key, p.label) in done for c in cells for p in policies)
    log(f"{total} runs in {len(cells)} cells; {already} already in {out}, {total - already} to go")
    progress = Progress(
        out,
        rows,
        total,
        already,
        lambda row: (
            f"TTFT P99 {fmt_s(row['ttft_p99'])} s, mean {fmt_s(row['ttft_mean'])} s, hit {row['prefix_hit_rate']:.1%}"
        ),
        log,
    )
    for cell in cells:
        run_cell(cell, policies, requests=requests, folder=folder, done=done, on_row=progress.append)
    return rows


def parse_only(items: Iterable[str]) -> dict[str, set[str]]:
    """`--only key=a,b` (repeatable) → {key: {"a", "b"}}; keys: trace, pd, rate, cache, policy."""
    allowed = {"trace", "pd", "tp", "rate", "cache", "policy"}
    out: dict[str, set[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or key not in allowed:
            raise SystemExit(f"--only {item!r}: expected KEY=V1,V2 with KEY one of {sorted(allowed)}")
        out.setdefault(key, set()).update(v.strip() for v in values.split(","))
    return out


def _matches(cell: Cell, only: dict[str, set[str]]) -> bool:
    for key, values in only.items():
        if key == "policy":
            continue
        got = getattr(cell, key)
        if isinstance(got, float):
            if not any(math.isclose(got, float(v)) for v in values):
                return False
        elif str(got) not in values:
            return False
    return True


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 cells (the operating point and the control), 200 rows")
    ap.add_argument("--requests", type=int, default=None, help="rows of each trace (default 3000; --quick 200)")
    ap.add_argument("--out", type=Path, default=Path("prefix_sweep.jsonl"))
    ap.add_argument(
        "--only", action="append", default=[], help="KEY=V1,V2 (repeatable): trace, pd, tp, rate, cache, policy"
    )
    ap.add_argument("--report-only", action="store_true", help="only rebuild OUT.md/OUT.json")
    add_traces_option(ap)
    args = ap.parse_args(argv)
    grid = "quick" if args.quick else "full"
    requests = args.requests or REQUESTS[grid]
    only = parse_only(args.only)
    policies = [p for p in POLICIES if "policy" not in only or p.label in only["policy"] or p.name in only["policy"]]
    cells = [c for c in GRIDS[grid] if _matches(c, only)]
    if args.report_only:
        rows = load_rows(args.out)
    else:
        rows = sweep(cells, policies, args.out, requests=requests, folder=traces_dir(args.traces))
    md, js = write_report(rows, args.out, [p.label for p in POLICIES])
    print(md.read_text())
    print(f"wrote {md} and {js}", file=sys.stderr)


if __name__ == "__main__":
    main()

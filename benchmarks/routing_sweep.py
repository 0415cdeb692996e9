"""Where each routing policy wins: a resumable sweep over workloads, decode models, cluster sizes,
P:D ratios, loads and arrival patterns, with the clairvoyant reference as the bound.

Every (cell, policy) result is appended to a JSONL file as soon as it finishes; a re-run skips
what is already there, so an interrupted sweep resumes. At the end (and with --report-only) the
whole file is turned into a markdown and a JSON table next to it (OUT.md, OUT.json).

The same grid as a `sibyl-console sweep` CONFIG (Ray tasks, results in the run store):
demos/sweep_routing.toml. Both plan a cell with console.offline.sweep.traffic, so a cell gives the same
numbers either way.

Load is the arrival rate as a share of decode saturation: n_decode × peak instance throughput
(max over N ≤ max_num_seqs of TPS(N), 1,177 tok/s for the H20 profile) / the trace's mean output
length. The same rate is used in iteration mode (whose H20 step model is fitted to TPS(N) up to
its peak, so it saturates a little later). Bursty arrivals are gamma gaps of shape 0.2.

Usage:
  python -m benchmarks.routing_sweep --grid quick [--requests 8000] [--out routing_sweep.jsonl]
  python -m benchmarks.routing_sweep --grid full --requests 20000            # the whole grid
  python -m benchmarks.routing_sweep --only workload=reasoning-chat --only decode=64 \\
      --only policy=least_load,clairvoyant
  python -m benchmarks.routing_sweep --report-only --out routing_sweep.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import Progress, by_cell, load_rows, md_header, md_row, ms
from console.offline.simulate import SimPlan, run_one
from console.offline.sweep import traffic
from console.offline.sweep_config import WorkloadRef, params_for_mode
from core.errors import PolicyError
from core.perf import PerfProfile, get_profile
from core.policies import parse_policy_spec
from core.slo import SLOClass

BURSTY = 0.2
"""Gamma shape of the bursty arrivals (vllm bench serve --burstiness)."""


@dataclass(frozen=True)
class Cell:
    workload: str
    mode: str
    decode: int
    pd: str
    """P:D ratio, "1:4" or "1:1"."""
    load: float
    arrival: str
    """poisson or bursty."""

    @property
    def prefill(self) -> int:
        p, d = (int(x) for x in self.pd.split(":"))
        return max(1, round(self.decode * p / d))

    @property
    def burstiness(self) -> float:
        return 1.0 if self.arrival == "poisson" else BURSTY

    @property
    def key(self) -> str:
        return f"{self.workload}/{self.mode}/{self.prefill}P{self.decode}D/load{self.load:g}/{self.arrival}"


@dataclass(frozen=True)
class PolicyCase:
    label: str
    name: str
    params: dict[str, Any]

    def params_for(self, mode: str) -> dict[str, Any]:
        """The clairvoyant is told the simulator's decode model (it is an oracle anyway)."""
        return params_for_mode(self.name, self.params, mode)


POLICIES: list[PolicyCase] = [
    PolicyCase("round_robin", "round_robin", {}),
    PolicyCase("least_load", "least_load", {}),
    PolicyCase("least_load(tokens)", "least_load", {"by": "tokens"}),
    PolicyCase("req_level", "req_level", {}),
    PolicyCase("sibyl(paper)", "sibyl", {"unit": "tokens"}),
    PolicyCase("sibyl(requests)", "sibyl", {"unit": "requests"}),
    PolicyCase("sibyl(lifetime)", "sibyl", {"horizon": "lifetime", "unit": "auto"}),
    PolicyCase("clairvoyant", "clairvoyant", {}),
]
BASELINE = "least_load"
ORACLE = "clairvoyant"
LIFETIME = "sibyl(lifetime)"

GRIDS: dict[str, dict[str, list[Any]]] = {
    "full": {
        "workload": ["reasoning-chat", "reasoning-code", "random"],
        "mode": ["ps", "iteration"],
        "decode": [16, 64],
        "pd": ["1:4", "1:1"],
        "load": [0.8, 0.9, 0.95],
        "arrival": ["poisson", "bursty"],
    },
    "prefill-bound": {
        "workload": ["reasoning-chat", "reasoning-code"],
        "mode": ["ps", "iteration"],
        "decode": [64],
        "pd": ["1:16", "1:8"],
        "load": [0.95],
        "arrival": ["poisson", "bursty"],
    },
    "quick": {
        "workload": ["reasoning-chat", "reasoning-code", "random"],
        "mode": ["ps", "iteration"],
        "decode": [16, 64],
        "pd": ["1:4"],
        "load": [0.95],
        "arrival": ["poisson", "bursty"],
    },
}


def cells_of(grid: dict[str, list[Any]]) -> list[Cell]:
    keys = ["workload", "mode", "decode", "pd", "load", "arrival"]
    return [Cell(**dict(zip(keys, values, strict=True))) for values in itertools.product(*(grid[k] for k in keys))]


def parse_only(items: Iterable[str]) -> dict[str, set[str]]:
    """`--only key=a,b` (repeatable) → {key: {"a", "b"}}; keys: the Cell fields and `policy`."""
    allowed = {"workload", "mode", "decode", "pd", "load", "arrival", "policy"}
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


def plan_for(cell: Cell, requests: int, seed: int, profile: PerfProfile) -> SimPlan:
    trace = traffic(
        WorkloadRef(cell.workload),
        requests=requests,
        seed=seed,
        rate=None,
        load=cell.load,
        burstiness=cell.burstiness,
        n_decode=cell.decode,
        profile=profile,
    )
    return SimPlan(
        arrivals=trace.arrivals,
        prompt_tokens=trace.prompt_tokens,
        output_tokens=trace.output_tokens,
        workload=cell.workload,
        profile=profile,
        n_prefill=cell.prefill,
        n_decode=cell.decode,
        mode=cell.mode,  # type: ignore[arg-type]
        policies=[],
        slo=SLOClass(),
        seed=seed,
        shadow=False,
    )


def _clean(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return x


def run_cell(
    cell: Cell,
    policies: Sequence[PolicyCase],
    *,
    requests: int,
    seed: int,
    profile: PerfProfile,
    done: set[tuple[str, str]] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Simulate every policy not yet `done` on one cell; returns (and hands to `on_row`) the rows."""
    todo = [p for p in policies if done is None or (cell.key, p.label) not in done]
    if not todo:
        return []
    plan = plan_for(cell, requests, seed, profile)
    rows = []
    for case in todo:
        params = case.params_for(cell.mode)
        metrics, _ = run_one(plan, case.name, params)
        row = {
            "cell": cell.key,
            **asdict(cell),
            "prefill": cell.prefill,
            "policy": case.label,
            "name": case.name,
            "params": params,
            "requests": requests,
            "seed": seed,
            "profile": profile.name,
            "rate_rps": float(len(plan.arrivals) / plan.arrivals[-1]) if len(plan.arrivals) > 1 else None,
            **{
                k: _clean(metrics.get(k))
                for k in (
                    "tpot_p99",
                    "tpot_p999",
                    "tpot_mean",
                    "tpot_p50",
                    "ttft_p99",
                    "slo_attainment",
                    "completed",
                    "failed",
                    "preemptions",
                    "sim_wall_s",
                )
            },
        }
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def parse_policy_case(text: str) -> PolicyCase:
    """`LABEL=NAME[:key=value,...]` → a PolicyCase (values are parsed by the policy's params)."""
    label, sep, spec = text.partition("=")
    if not sep or not label or not spec:
        raise SystemExit(f"--add-policy {text!r}: expected LABEL=NAME[:key=value,...]")
    try:
        name, params = parse_policy_spec(spec)
    except PolicyError:
        raise SystemExit(f"--add-policy {text!r}: expected LABEL=NAME[:key=value,...]") from None
    return PolicyCase(label, name, dict(params))


def sweep(
    cells: Sequence[Cell],
    policies: Sequence[PolicyCase],
    out: Path,
    *,
    requests: int,
    seed: int,
    profile: PerfProfile,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> list[dict[str, Any]]:
    """Run what `out` does not hold yet (same requests and seed), appending each row as it lands."""
    rows = load_rows(out)
    done = {
        (r["cell"], r["policy"])
        for r in rows
        if r.get("requests") == requests and r.get("seed") == seed and r.get("profile") == profile.name
    }
    total = len(cells) * len(policies)
    already = sum((c.key, p.label) in done for c in cells for p in policies)
    log(f"{total} runs in {len(cells)} cells; {already} already in {out}, {total - already} to go")
    progress = Progress(
        out, rows, total, already, lambda row: f"P99 TPOT {(row['tpot_p99'] or float('nan')) * 1e3:.1f} ms", log
    )
    for cell in cells:
        run_cell(cell, policies, requests=requests, seed=seed, profile=profile, done=done, on_row=progress.append)
    return rows


# --- report ----------------------------------------------------------------------------------


def summarize_cells(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: every policy's metrics, the clairvoyant's P99 headroom over least_load and how
    much of it sibyl(lifetime) closes."""
    out = []
    for cell, pol in by_cell(rows).items():
        base = pol.get(BASELINE, {}).get("tpot_p99")
        oracle = pol.get(ORACLE, {}).get("tpot_p99")
        life = pol.get(LIFETIME, {}).get("tpot_p99")
        entry: dict[str, Any] = {"cell": cell, "policies": pol}
        if base and oracle is not None:
            entry["headroom"] = (base - oracle) / base
            if life is not None:
                gap = base - oracle
                entry["lifetime_closes"] = (base - life) / gap if gap > 0 else None
                entry["lifetime_vs_baseline"] = life / base - 1
        out.append(entry)
    return out


def markdown(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> str:
    cells = summarize_cells(rows)
    lines = [
        "P99 TPOT (ms) per cell; headroom = (least_load − clairvoyant) / least_load; "
        "closes = share of that headroom sibyl(lifetime) closes; Δlife = sibyl(lifetime) vs least_load.",
        "",
        *md_header(["cell", *policies, "headroom", "closes", "Δlife"], "l" + "r" * (len(policies) + 3)),
    ]
    for c in cells:
        pol = c["policies"]
        vals = [ms(pol.get(p, {}).get("tpot_p99")) for p in policies]
        head = c.get("headroom")
        closes = c.get("lifetime_closes")
        dl = c.get("lifetime_vs_baseline")
        lines.append(
            md_row(
                [
                    c["cell"],
                    *vals,
                    "-" if head is None else f"{head:+.1%}",
                    "-" if closes is None else f"{closes:.0%}",
                    "-" if dl is None else f"{dl:+.1%}",
                ]
            )  # fmt: skip
        )
    lines += [
        "",
        "All metrics (TPOT in ms, SLO attainment: TTFT ≤ 2 s and TPOT ≤ 100 ms):",
        "",
        *md_header(
            ["cell", "policy", "P99", "P99.9", "mean", "SLO att.", "TTFT P99 s", "preempt.", "ΔP99 vs least_load"],
            "llrrrrrrr",
        ),
    ]
    for c in cells:
        pol = c["policies"]
        base = pol.get(BASELINE, {}).get("tpot_p99")
        for p in policies:
            r = pol.get(p)
            if r is None:
                continue
            d = "-" if not base or r.get("tpot_p99") is None else f"{r['tpot_p99'] / base - 1:+.1%}"
            slo = r.get("slo_attainment")
            ttft = r.get("ttft_p99")
            lines.append(
                md_row(
                    [
                        c["cell"],
                        p,
                        ms(r.get("tpot_p99")),
                        ms(r.get("tpot_p999")),
                        ms(r.get("tpot_mean")),
                        "-" if slo is None else f"{slo:.1%}",
                        "-" if ttft is None else f"{ttft:.2f}",
                        r.get("preemptions", "-"),
                        d,
                    ]
                )  # fmt: skip
            )
    return "\n".join(lines) + "\n"


def write_report(rows: Sequence[dict[str, Any]], out: Path, policies: Sequence[str]) -> tuple[Path, Path]:
    md, js = out.with_suffix(".md"), out.with_suffix(".json")
    md.write_text(markdown(rows, policies))
    cells = summarize_cells(rows)
    js.write_text(json.dumps(cells, indent=1, default=str) + "\n")
    return md, js


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", choices=sorted(GRIDS), default="quick")
    ap.add_argument("--requests", type=int, default=8000, help="requests per cell (same for every cell)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--profile", default="h20-qwen3-32b")
    ap.add_argument("--out", type=Path, default=Path("routing_sweep.jsonl"))
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        help="KEY=V1,V2 filter (repeatable): workload, mode, decode, pd, load, arrival, policy",
    )
    ap.add_argument(
        "--add-policy",
        action="append",
        default=[],
        help="LABEL=NAME[:key=value,...] run one more policy setting (repeatable), e.g. "
        "'life256=sibyl:horizon=lifetime,lifetime_tokens=256'",
    )
    ap.add_argument("--report-only", action="store_true", help="only rebuild OUT.md/OUT.json")
    args = ap.parse_args(argv)
    only = parse_only(args.only)
    extra = [parse_policy_case(x) for x in args.add_policy]
    policies = [
        p for p in [*POLICIES, *extra] if "policy" not in only or p.label in only["policy"] or p.name in only["policy"]
    ]
    cells = [c for c in cells_of(GRIDS[args.grid]) if _matches(c, only)]
    profile = get_profile(args.profile)
    if args.report_only:
        rows = load_rows(args.out)
    else:
        rows = sweep(cells, policies, args.out, requests=args.requests, seed=args.seed, profile=profile)
    labels = [p.label for p in POLICIES] + [p.label for p in extra]
    labels += sorted({r["policy"] for r in rows} - set(labels))
    md, js = write_report(rows, args.out, labels)
    print(md.read_text())
    print(f"wrote {md} and {js}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Reproduce SIBYL's simulation setting (App. I) and print our reductions next to the paper's.

64 decode instances, the H20/Qwen3-32B processor-sharing curve, reasoning-chat (ShareGPT-like)
and reasoning-code (Zeta-like) workloads near decode saturation. For each workload: P99, P99.9
and mean TPOT of sibyl vs least_load (ILS) and vs round_robin, and the optimal-assignment ratios.
Usage: python -m benchmarks.reproduce_sibyl [--requests 20000] [--load 0.95] [--burstiness 1.0]
"""

from __future__ import annotations

import argparse

from console.offline.simulate import SimPlan, run_one
from core.perf import get_profile
from core.slo import SLOClass
from core.traces import synthetic_trace

PAPER = {  # sim, 64 decode instances (SIBYL Table/§5, shared/design/papers/sibyl.md §6)
    "reasoning-chat": {
        "p99_vs_ils": -47.7,
        "p99_vs_rr": -24.5,
        "mean_vs_ils": -28.0,
        "mean_vs_rr": -12.5,
        "ratio": {"sibyl": 94.2, "least_load": 71.6, "round_robin": 79.5},
    },
    "reasoning-code": {
        "p99_vs_ils": -78.0,
        "p99_vs_rr": -14.4,
        "mean_vs_ils": -70.4,
        "mean_vs_rr": -12.7,
        "ratio": {"sibyl": 64.5, "least_load": 22.6, "round_robin": 52.2},
    },
}
MEAN_OUTPUT = {"reasoning-chat": 5657.0, "reasoning-code": 6500.0}
POLICIES: list[tuple[str, dict[str, object]]] = [
    ("sibyl", {"unit": "tokens"}),
    ("sibyl", {"unit": "requests"}),
    ("least_load", {}),
    ("round_robin", {}),
]


def pct(new: float, old: float) -> str:
    return f"{(new / old - 1) * 100:+.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--load", type=float, default=0.95, help="arrival rate / decode saturation rate")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--workloads", default="reasoning-chat,reasoning-code")
    args = ap.parse_args()
    prof = get_profile("h20-qwen3-32b")
    peak = prof.total_tps(53)
    for workload in args.workloads.split(","):
        rate = args.load * 64 * peak / MEAN_OUTPUT[workload]
        trace = synthetic_trace(workload, requests=args.requests, rate=rate, seed=0, burstiness=args.burstiness)
        plan = SimPlan(
            arrivals=trace.arrivals,
            prompt_tokens=trace.prompt_tokens,
            output_tokens=trace.output_tokens,
            workload=workload,
            profile=prof,
            n_prefill=args.prefill,
            n_decode=64,
            mode="ps",
            policies=POLICIES,
            slo=SLOClass(),
            shadow=False,
        )
        rows = {}
        for name, params in POLICIES:
            label = name + ("(unit=requests)" if params.get("unit") == "requests" else "")
            rows[label], _ = run_one(plan, name, params)
        print(
            f"\n== {workload}: {args.requests} requests at {rate:.2f} req/s (load {args.load}, "
            f"burstiness {args.burstiness}), 64 decode"
        )
        print(
            f"{'policy':<24} {'TPOT mean ms':>12} {'p99 ms':>8} {'p99.9 ms':>9} {'TTFT p99 s':>10} {'opt.assign':>10}"
        )
        for label, r in rows.items():
            print(
                f"{label:<24} {r['tpot_mean'] * 1e3:>12.1f} {r['tpot_p99'] * 1e3:>8.1f} {r['tpot_p999'] * 1e3:>9.1f} "
                f"{r['ttft_p99']:>10.2f} {r['optimal_assignment_ratio'] * 100:>9.1f}%"
            )
        s, ils, rr = rows["sibyl"], rows["least_load"], rows["round_robin"]
        paper = PAPER[workload]
        print(f"{'reduction (ours | paper)':<24} {'vs ILS':>16} {'vs RR':>16}")
        for metric, key in (("P99 TPOT", "tpot_p99"), ("P99.9 TPOT", "tpot_p999"), ("mean TPOT", "tpot_mean")):
            pk = {"tpot_p99": "p99", "tpot_mean": "mean"}.get(key)
            p_ils = f"{paper[pk + '_vs_ils']:+.1f}%" if pk else "-"  # type: ignore[operator]
            p_rr = f"{paper[pk + '_vs_rr']:+.1f}%" if pk else "-"  # type: ignore[operator]
            print(f"  {metric:<22} {pct(s[key], ils[key]):>8} | {p_ils:<6} {pct(s[key], rr[key]):>8} | {p_rr:<6}")
        req = rows["sibyl(unit=requests)"]
        print(
            f"  sibyl(unit=requests) P99 TPOT: {pct(req['tpot_p99'], ils['tpot_p99'])} vs ILS, "
            f"{pct(req['tpot_p99'], rr['tpot_p99'])} vs RR"
        )
        ratios = paper["ratio"]
        print(
            "  optimal-assignment ratio (ours | paper): "
            + ", ".join(f"{k} {rows[k]['optimal_assignment_ratio'] * 100:.1f}% | {v}%" for k, v in ratios.items())
        )  # type: ignore[union-attr]


if __name__ == "__main__":
    main()

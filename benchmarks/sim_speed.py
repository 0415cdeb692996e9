"""Simulator speed: requests simulated per second for reasoning-chat at 64 decode instances.

Targets (issue 2): 100,000 requests in processor-sharing mode with SIBYL in <= 30 s wall,
round robin in <= 10 s. Prints one table with each run's wall and CPU seconds (on a shared machine
the wall time also counts the time other processes held the cores: the CPU time is the run's own
cost); --json for a machine-readable copy.
Usage: python -m benchmarks.sim_speed [--requests 100000] [--modes ps,iteration] [--prefill 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

from core.dispatch import Dispatcher
from core.perf import get_profile
from core.sim.cluster import ClusterSimulation
from core.traces import synthetic_trace

SATURATION_RPS = 64 * 1176.6 / 5657  # 64 decode instances at the H20 peak / mean reasoning-chat output


def run(policy: str, mode: str, requests: int, load: float, n_prefill: int = 16) -> dict[str, float | str | int]:
    trace = synthetic_trace("reasoning-chat", requests=requests, rate=SATURATION_RPS * load, seed=0)
    prof = get_profile("h20-qwen3-32b")
    d = Dispatcher(prof, policy, survival_prior_max=8192)
    sim = ClusterSimulation(
        arrivals=trace.arrivals,
        prompt_tokens=trace.prompt_tokens,
        output_tokens=trace.output_tokens,
        profile=prof,
        n_prefill=n_prefill,
        n_decode=64,
        dispatcher=d,
        mode=mode,  # type: ignore[arg-type]
    )
    t0, cpu0 = time.perf_counter(), time.process_time()
    result = sim.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "policy": policy,
        "mode": mode,
        "cluster": f"{n_prefill}P64D",
        "requests": requests,
        "events": result.events,
        "wall_s": wall,
        "cpu_s": cpu,
        "requests_per_s": requests / wall,
        "completed": int(result.ok.sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--modes", default="ps,iteration")
    ap.add_argument("--policies", default="round_robin,sibyl")
    ap.add_argument("--load", type=float, default=0.9, help="arrival rate as a share of decode saturation")
    ap.add_argument("--prefill", type=int, default=16, help="prefill instances beside the 64 decode instances")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [
        run(p, m, args.requests, args.load, args.prefill)
        for m in args.modes.split(",")
        for p in args.policies.split(",")
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    targets = {("ps", "sibyl"): 30.0, ("ps", "round_robin"): 10.0}
    print(
        f"{'mode':<10} {'policy':<12} {'cluster':>8} {'requests':>9} {'events':>9} {'wall s':>8} {'cpu s':>8} "
        f"{'req/s':>9} {'target s':>9}"
    )
    for r in rows:
        target = targets.get((str(r["mode"]), str(r["policy"])))
        print(
            f"{r['mode']:<10} {r['policy']:<12} {r['cluster']:>8} {r['requests']:>9} {r['events']:>9} "
            f"{r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} "
            f"{r['requests_per_s']:>9.0f} {'-' if target is None else f'{target:.0f}':>9}"
        )
    base = {r["mode"]: r["wall_s"] for r in rows if r["policy"] == "round_robin"}
    for r in rows:
        if r["policy"] != "round_robin" and r["mode"] in base:
            print(
                f"{r['mode']}: {r['policy']} costs "
                f"{float(r['wall_s']) / float(base[r['mode']]):.2f}x round robin's wall time"
            )


if __name__ == "__main__":
    main()

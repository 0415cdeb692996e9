"""The advisor's targets (issue 40): what one advice costs, whether a 10% canary reaches the right verdict, and
how much the two arms of a routing canary interfere. `benchmarks/advisor_live.py` runs the prediction target
(a live replay whose character changes halfway).

- **cost**: one advice (`console.advisor.simulate.advise`, the default candidates) on a window of an Azure
  conversation slice rescaled to `--rate` requests/s over `--window-s` seconds, at `--cluster` (default 8P56D);
  wall and CPU seconds, pairs simulated and pairs carried over without a run. Target: within period_s (30 s).
  With `prefix`, also on a Mooncake conversation window with each request's 16-token prefix keys, exact and with
  coarser cache blocks (`--key-blocks`), and how far the coarse figures are from the exact ones.
- **worker**: the live path: the Mooncake window handed `--periods` times to a real `AdvisorWorker` (a niced
  process, the `[advisor] coarse_*` rule of `--coarse-cpu-share` and `--coarse-blocks`), each answer's CPU
  seconds as the worker measures them (its own process time over the advice, what the console reports), and
  the cache model it chose and why.
- **canary** (simulated arms, on Mooncake conversation slices with their prefix hashes, where prefix_aware's P99
  TTFT differs from least_load's by far more than 20% when the prefill pool queues): the canary runs inside the
  simulator's dispatcher (`Dispatcher.start_canary`, the live code) with the console's split (`ArmSplit`, by
  session, salted per seed) and is read every `--read-every-s` with the console's rule (`read_canary`) on the
  requests finished by then, as the live canary reads its arms. A pair of policies with a real P99 TTFT difference
  (each run alone on the same slice) must reach the right verdict within `--for-s` (5 min) in 5 of 5 seeds; two
  identical policies must end equal or inconclusive in >= 19 of 20.
- **interference**: from the same runs, each arm's P99 TTFT against the same requests' P99 TTFT when its policy
  runs alone on the whole slice.

Seeds move the slice through the trace and change the split's salt. CPU seconds are this process's own; on a
shared machine the wall time also counts the time other processes held the cores.
Usage: python -m benchmarks.advisor [--parts cost,prefix,worker,canary] [--seeds 5] [--null-seeds 20] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.paths import AZURE_CONV, add_traces_option, traces_dir
from console.advisor.canary import CANARY, ArmSample, ArmSplit, Reading, plan_canary, read_canary
from console.advisor.settings import AdvisorSettings
from console.advisor.simulate import NOTHING_HELD, Shape, advise, predict
from console.advisor.window import RecentArrivals, Window, window_from_rows
from console.advisor.worker import AdvisorWorker
from core.dispatch import Dispatcher
from core.perf import PerfProfile, get_profile
from core.sim.cluster import CacheParams, ClusterSimResult, ClusterSimulation
from core.slo import SLOClass, met, percentile
from core.traces import Trace
from core.traces.prompts import NATIVE_BLOCK_TOKENS
from core.traces.readers import read_azure, read_mooncake

COST_PROFILE = {"azure": "roofline-h20-llama3-8b", "mooncake": "roofline-h100-llama3-8b"}
"""Prefill ~4.6k tokens/s per instance: 8 prefill instances run the 20 req/s Azure window at ~60% busy; Mooncake's
prompts (12k tokens on average) need the H100's ~31k tokens/s per instance to be served at that rate."""
CANARY_PROFILE = "roofline-h100-qwen2.5-7b"
"""With a 128k context (Mooncake's prompts reach 126k tokens), as the prefix sweep runs it."""
CACHE_BLOCK_TOKENS = 128
"""The canary runs' KV block (the engines' is 16): 8x fewer blocks to track, the same prefix structure (Mooncake's
512-token hash blocks are whole multiples of it)."""
CANARY_SLO = SLOClass(ttft_s=2.0, tpot_s=0.1)
MOONCAKE_CONV = Path("mooncake_fast25") / "conversation_trace.jsonl"
RIGHT = {"better": ("promote",), "worse": ("rollback",), "same": ("equal", "inconclusive")}
"""The verdicts that are right for a candidate whose alone-run P99 TTFT is better, worse, or the same policy."""


def azure(traces: Any) -> Trace:
    return read_azure(traces_dir(traces) / AZURE_CONV)


def mooncake(traces: Any) -> Trace:
    """The Mooncake conversation trace, with sessions derived from its hash ids (what the canary's split hashes)."""
    return read_mooncake(traces_dir(traces) / MOONCAKE_CONV).with_sessions()


def trace_slice(trace: Trace, seed: int, duration_s: float, rate: float) -> Trace:
    """`duration_s` seconds of the trace at `rate` requests/s, starting 7 % further into it per seed (wrapping)."""
    native = trace.mean_rate()
    span = duration_s * rate / native  # native seconds that hold duration_s at `rate`
    start = (seed * 0.07 * float(trace.arrivals[-1])) % max(float(trace.arrivals[-1]) - span, 1.0)
    return trace.window(start, span).scale_time(native / rate)


# --- cost -------------------------------------------------------------------------------------------------------
def mooncake_profile() -> PerfProfile:
    return get_profile(COST_PROFILE["mooncake"]).model_copy(update={"max_model_len": 131_072})


def stored_rows(trace: Trace) -> list[dict[str, Any]]:
    """The trace's requests as the run store holds them (every one answered; the figures are not compared here)."""
    rows = []
    for i, (t, p, o) in enumerate(zip(trace.arrivals.tolist(), trace.prompt_tokens.tolist(),
                                      trace.output_tokens.tolist(), strict=True)):
        rows.append({"request_id": f"r{i}", "arrival": t, "prompt_tokens": p, "output_tokens": o, "max_tokens": o,
                     "status": "ok", "prefill_start": t, "first_token": t + 0.2, "finish": t + 2.0, "ttft": 0.2,
                     "tpot": 0.02, "slo_met": True, "cached_tokens": None, "slo_class": "default",
                     "tenant": "default", "priority": 0})
    return rows


def cost_window(trace: Trace, rate: float, window_s: float, block: int = 16) -> Window:
    """A window of the trace at `rate`; a trace with hash ids gets each request's chain of `block`-token keys, as
    the gateway notes them (a Mooncake hash id names its whole prefix, so (id, block in it) is a chained key)."""
    piece = trace_slice(trace, 0, window_s, rate)
    rows = stored_rows(piece)
    keys = None
    if piece.hash_ids is not None:
        keys = RecentArrivals(len(rows))
        per = NATIVE_BLOCK_TOKENS // block
        for r, ids in zip(rows, piece.hash_ids, strict=True):
            chain = [h * per + j for h in ids for j in range(per)][: r["prompt_tokens"] // block]
            keys.note(r["request_id"], chain, "")
    end = rows[-1]["arrival"]
    return window_from_rows(rows, run_id="bench", end=end, window_s=end + 1e-9, keys=keys,
                            active={"routing": ("least_load", {}), "queue": ("fcfs", {})})


def cost(window: Window, shape: Shape, profile: PerfProfile, mode: str, key_blocks: int = 1) -> dict[str, Any]:
    """One advice's wall and CPU seconds; and what the pairs it carried over without a run would have cost."""
    t0, c0 = time.perf_counter(), time.process_time()
    advice = advise(window, shape, profile, mode=mode, key_blocks=key_blocks)  # type: ignore[arg-type]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    carried = [r for r in advice.ranked if r.note == NOTHING_HELD]
    c1 = time.process_time()
    for r in carried:
        again = predict(window, shape, profile, r.routing, r.queue, mode=mode, key_blocks=key_blocks)  # type: ignore[arg-type]
        assert again == r.predicted, f"{r.label}: carried figures differ from its own simulation"
    simulated = len(advice.ranked) - len(carried)
    return {"part": "cost", "mode": mode, "cluster": str(shape), "profile": profile.name,
            "trace": "mooncake" if window.prefix_keys is not None else "azure", "key_blocks": key_blocks,
            "requests": int(window.measured.sum()), "pairs": len(advice.ranked), "simulated": simulated,
            "carried": len(carried), "wall_s": wall, "cpu_s": cpu, "cpu_per_simulated_s": cpu / simulated,
            "cpu_s_without_shortcut": cpu + time.process_time() - c1,
            "predicted": {r.label: [r.predicted.ttft_p99, r.predicted.prefix_hit_rate] for r in advice.ranked}}


# --- the live worker -------------------------------------------------------------------------------------------
def worker_cost(window: Window, shape: Shape, profile: PerfProfile, settings: AdvisorSettings,
                periods: int) -> list[dict[str, Any]]:
    """The window advised `periods` times in a row by a worker process under `settings`' coarse rule."""
    worker = AdvisorWorker(shape, profile, coarse=settings.coarse_rule())
    rows = []
    try:
        for period in range(periods):
            worker.submit(window)
            answer = asyncio.run(worker.next_answer(3600.0))
            assert answer is not None and answer.advice is not None, answer and answer.error
            advice = answer.advice
            rows.append({"part": "worker", "period": period + 1, "cluster": str(shape), "key_blocks": advice.key_blocks,
                         "cache_model": advice.cache_model, "why": advice.cache_why, "cpu_s": answer.job_cpu_s,
                         "wall_s": answer.wall_s, "period_s": settings.period_s,
                         "predicted": {r.label: [r.predicted.ttft_p99, r.predicted.prefix_hit_rate]
                                       for r in advice.ranked}})
    finally:
        worker.close()
    return rows


# --- canary (simulated arms) -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trial:
    """One seed of a canary: the slice, the active policy and the candidate."""

    seed: int
    active: str
    candidate: str
    share: float
    duration_s: float


def run_sim(trace: Trace, shape: Shape, profile: PerfProfile, policy: str,
            canary: tuple[str, np.ndarray] | None = None) -> ClusterSimResult:
    """The slice under `policy`; with `canary` (candidate, in-canary mask by row) the dispatcher's canary decides
    the masked rows. A trace with hash ids gets a prefix cache of CACHE_BLOCK_TOKENS-token blocks."""
    d = Dispatcher(profile, policy, slo={"default": CANARY_SLO},
                   survival_prior_max=int(trace.output_tokens.max()))
    if canary is not None:
        name, mask = canary
        d.start_canary("routing", name, {}, lambda r: bool(mask[int(r.id)]))
    sim = ClusterSimulation(arrivals=trace.arrivals, prompt_tokens=trace.prompt_tokens,
                            output_tokens=trace.output_tokens, profile=profile, n_prefill=shape.n_prefill,
                            n_decode=shape.n_decode, dispatcher=d, mode="iteration", hash_ids=trace.hash_ids,
                            sessions=None if trace.session is None else [str(x) for x in trace.session.tolist()],
                            cache=CacheParams(block_size=CACHE_BLOCK_TOKENS) if trace.hash_ids is not None else None)
    return sim.run()


def latencies(r: ClusterSimResult) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TTFT, TPOT (NaN where not measured) and SLO met, per row."""
    ok = r.ok.astype(bool)
    ttft = np.where(ok, r.first_token - r.arrival, np.nan)
    tpot = np.where(ok & (r.output_tokens > 1),
                    (r.finish - r.first_token) / np.maximum(r.output_tokens - 1, 1), np.nan)
    return ttft, tpot, met(ttft, tpot, ok, CANARY_SLO)


def arm_sample(r: ClusterSimResult, rows: np.ndarray) -> ArmSample:
    ttft, tpot, meets = latencies(r)
    ok = r.ok.astype(bool) & rows
    return ArmSample(ttft[ok], tpot[ok], meets[rows])


def read_until_final(r: ClusterSimResult, mask: np.ndarray, trial: Trial, every_s: float) -> Reading:
    """The live canary's readings: every `every_s`, the arms' requests finished by then; the first final one."""
    plan = plan_canary("routing", trial.candidate, {}, trial.share, trial.duration_s, min_samples=200)
    finish = np.where(r.ok.astype(bool), r.finish, np.where(np.isnan(r.finish), np.inf, r.finish))
    t = every_s
    while True:
        done = finish <= t
        reading = read_canary(arm_sample(r, mask & done), arm_sample(r, ~mask & done), plan, t)
        if reading.final:
            return reading
        t += every_s


def p99(values: np.ndarray) -> float:
    return float(percentile(values[~np.isnan(values)], 99))


def canary_trial(trace: Trace, shape: Shape, profile: PerfProfile, trial: Trial, rate: float,
                 every_s: float) -> dict[str, Any]:
    piece = trace_slice(trace, trial.seed, trial.duration_s, rate)
    split = ArmSplit(trial.share, salt=f"bench-{trial.seed}")
    sessions = [None] * len(piece) if piece.session is None else [f"s{x}" for x in piece.session.tolist()]
    mask = np.array([split.arm(sessions[i], None, f"{trial.seed}-{i}") == CANARY for i in range(len(piece))])
    t0, c0 = time.perf_counter(), time.process_time()
    alone_active = latencies(run_sim(piece, shape, profile, trial.active))[0]
    same = trial.candidate == trial.active
    alone_candidate = alone_active if same else latencies(run_sim(piece, shape, profile, trial.candidate))[0]
    mixed = run_sim(piece, shape, profile, trial.active, (trial.candidate, mask))
    reading = read_until_final(mixed, mask, trial, every_s)
    ttft = latencies(mixed)[0]
    real = p99(alone_candidate) / p99(alone_active) - 1
    truth = "same" if same else ("better" if real < 0 else "worse")
    return {
        "part": "canary", "seed": trial.seed, "active": trial.active, "candidate": trial.candidate,
        "requests": len(piece), "canary_n": reading.canary_n, "control_n": reading.control_n,
        "real_p99_ttft_diff": real, "truth": truth, "decision": reading.decision, "at_s": reading.elapsed_s,
        "right": reading.decision in RIGHT[truth], "reason": reading.reason,
        "figures": {f.figure: [f.difference, f.low, f.high, f.direction] for f in reading.figures},
        # interference: each arm's P99 TTFT in the mixed run ÷ the same requests' P99 TTFT alone
        "canary_arm_vs_alone": p99(ttft[mask]) / p99(alone_candidate[mask]),
        "control_arm_vs_alone": p99(ttft[~mask]) / p99(alone_active[~mask]),
        "canary_arm_p99": p99(ttft[mask]), "control_arm_p99": p99(ttft[~mask]),
        "alone_active_p99": p99(alone_active), "alone_candidate_p99": p99(alone_candidate),
        "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
    }


# --- output -------------------------------------------------------------------------------------------------------
def print_cost(rows: list[dict[str, Any]], period_s: float) -> None:
    print(f"{'trace':<9} {'blocks':>6} {'mode':<10} {'cluster':>8} {'profile':<24} {'requests':>8} {'pairs':>5} "
          f"{'simulated':>9} {'wall s':>7} {'cpu s':>7} {'cpu s/sim':>9} {'cpu s, all run':>14} {'period s':>8} "
          f"{'met':>4}")
    for r in rows:
        print(f"{r['trace']:<9} {r['key_blocks']:>6} {r['mode']:<10} {r['cluster']:>8} {r['profile']:<24} "
              f"{r['requests']:>8} {r['pairs']:>5} "
              f"{r['simulated']:>9} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} {r['cpu_per_simulated_s']:>9.2f} "
              f"{r['cpu_s_without_shortcut']:>14.1f} {period_s:>8.0f} {'yes' if r['cpu_s'] <= period_s else 'no':>4}")
    exact = next((r for r in rows if r["trace"] == "mooncake" and r["key_blocks"] == 1), None)
    for r in rows:
        if exact is None or r is exact or r["trace"] != "mooncake":
            continue
        errs = [(abs(p[0] / exact["predicted"][k][0] - 1), abs(p[1] - exact["predicted"][k][1]))
                for k, p in r["predicted"].items() if p[0] and exact["predicted"][k][0] and p[1] is not None]
        flips = order_flips(exact["predicted"], r["predicted"], 0.01)
        print(f"{r['key_blocks']}-block keys vs exact: P99 TTFT off by at most {max(e[0] for e in errs):.1%}, "
              f"hit rate by at most {max(e[1] for e in errs):.2%} points; pairs ranked the other way round by P99 "
              f"TTFT whose exact figures differ by more than 1%: {len(flips)} {flips or ''}")


def print_worker(rows: list[dict[str, Any]]) -> None:
    print(f"{'period':>6} {'cluster':>8} {'cache model':<28} {'worker cpu s':>12} {'wall s':>7} {'period s':>8} "
          f"{'met':>4}  why")
    for r in rows:
        print(f"{r['period']:>6} {r['cluster']:>8} {r['cache_model']:<28} {r['cpu_s']:>12.1f} {r['wall_s']:>7.1f} "
              f"{r['period_s']:>8.0f} {'yes' if r['cpu_s'] <= r['period_s'] else 'no':>4}  {r['why']}")


def print_canary(rows: list[dict[str, Any]]) -> None:
    print(f"{'seed':>4} {'active':<12} {'candidate':<12} {'reqs':>5} {'canary':>6} {'control':>7} {'real Δp99':>9} "
          f"{'decision':<12} {'at s':>5} {'right':>5} {'canary/alone':>12} {'control/alone':>13} {'cpu s':>6}")
    for r in rows:
        print(f"{r['seed']:>4} {r['active']:<12} {r['candidate']:<12} {r['requests']:>5} {r['canary_n']:>6} "
              f"{r['control_n']:>7} {r['real_p99_ttft_diff']:>+9.1%} {r['decision']:<12} {r['at_s']:>5.0f} "
              f"{'yes' if r['right'] else 'NO':>5} {r['canary_arm_vs_alone']:>12.3f} "
              f"{r['control_arm_vs_alone']:>13.3f} {r['cpu_s']:>6.1f}")
    for r in rows:
        ttft = r["figures"].get("ttft_p99")
        if r["truth"] != "same" and ttft is not None:
            print(f"seed {r['seed']} {r['candidate']}: P99 TTFT canary ÷ control − 1 = {ttft[0]:+.1%} "
                  f"[{ttft[1]:+.1%}, {ttft[2]:+.1%}] ({ttft[3]})")
    for (active, candidate), group in _groups(rows).items():
        right = sum(r["right"] for r in group)
        print(f"{active} → {candidate}: right verdict in {right} of {len(group)} seeds; "
              f"canary arm ÷ alone median {np.median([r['canary_arm_vs_alone'] for r in group]):.3f}, "
              f"control arm ÷ alone median {np.median([r['control_arm_vs_alone'] for r in group]):.3f}")


def order_flips(exact: dict[str, list[Any]], other: dict[str, list[Any]], tie: float) -> list[tuple[str, str]]:
    """Pairs of candidates that `other` orders by P99 TTFT the other way round from `exact`, where the exact
    figures differ by more than `tie` (closer ones are ties: either order is right)."""
    out = []
    for a in exact:
        for b in exact:
            ea, eb, oa, ob = exact[a][0], exact[b][0], other[a][0], other[b][0]
            if None in (ea, eb, oa, ob) or a >= b:
                continue
            if abs(ea / eb - 1) > tie and (ea < eb) != (oa < ob):
                out.append((a, b))
    return out


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["active"], r["candidate"]), []).append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="cost,canary",
                    help="cost, prefix (cost also on a Mooncake window with prefix keys), worker (the live worker "
                         "process on that window, its coarse rule), canary (and interference)")
    ap.add_argument("--key-blocks", type=lambda t: [int(x) for x in t.split(",")], default=[4, 8],
                    help="prefix: coarser cache blocks to compare with the exact model")
    ap.add_argument("--cluster", default="8P56D", help="cost: the advised shape")
    ap.add_argument("--rate", type=float, default=20.0, help="cost: window arrivals per second")
    ap.add_argument("--window-s", type=float, default=300.0, help="cost: the window's length")
    ap.add_argument("--modes", default="iteration,ps", help="cost: the simulator's modes")
    ap.add_argument("--period-s", type=float, default=30.0)
    ap.add_argument("--periods", type=int, default=3, help="worker: windows advised in a row")
    ap.add_argument("--coarse-cpu-share", type=float, default=AdvisorSettings().coarse_cpu_share,
                    help="worker: [advisor] coarse_cpu_share")
    ap.add_argument("--coarse-blocks", type=int, default=AdvisorSettings().coarse_blocks,
                    help="worker: [advisor] coarse_blocks")
    ap.add_argument("--canary-cluster", default="6P6D")
    ap.add_argument("--canary-rate", type=float, default=12.0, help="canary: Mooncake arrivals per second")
    ap.add_argument("--pair", default="least_load,prefix_aware", help="canary: active,candidate with a real difference")
    ap.add_argument("--same", default="least_load", help="canary: the policy run against itself")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--null-seeds", type=int, default=20)
    ap.add_argument("--share", type=float, default=0.10)
    ap.add_argument("--for-s", type=float, default=300.0)
    ap.add_argument("--read-every-s", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    add_traces_option(ap)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    trace = azure(args.traces)
    out: list[dict[str, Any]] = []
    if "cost" in parts:
        shape = Shape.from_cluster(args.cluster)
        window = cost_window(trace, args.rate, args.window_s)
        out += [cost(window, shape, get_profile(COST_PROFILE["azure"]), m) for m in args.modes.split(",")]
        if "prefix" in parts:
            window = cost_window(mooncake(args.traces), args.rate, args.window_s)
            out += [cost(window, shape, mooncake_profile(), "iteration", k) for k in (1, *args.key_blocks)]
    if "worker" in parts:
        settings = AdvisorSettings(period_s=args.period_s, coarse_cpu_share=args.coarse_cpu_share,
                                   coarse_blocks=args.coarse_blocks)
        window = cost_window(mooncake(args.traces), args.rate, args.window_s)
        out += worker_cost(window, Shape.from_cluster(args.cluster), mooncake_profile(), settings, args.periods)
    if "canary" in parts:
        shape = Shape.from_cluster(args.canary_cluster)
        profile = get_profile(CANARY_PROFILE).model_copy(update={"max_model_len": 131_072})
        trace = mooncake(args.traces)
        active, candidate = args.pair.split(",")
        trials = [Trial(s, active, candidate, args.share, args.for_s) for s in range(args.seeds)]
        trials += [Trial(s, args.same, args.same, args.share, args.for_s) for s in range(args.null_seeds)]
        out += [canary_trial(trace, shape, profile, t, args.canary_rate, args.read_every_s) for t in trials]
    if args.json:
        print(json.dumps(out, indent=2))
        return
    if "cost" in parts:
        print_cost([r for r in out if r["part"] == "cost"], args.period_s)
    if "worker" in parts:
        print_worker([r for r in out if r["part"] == "worker"])
    if "canary" in parts:
        print_canary([r for r in out if r["part"] == "canary"])


if __name__ == "__main__":
    main()

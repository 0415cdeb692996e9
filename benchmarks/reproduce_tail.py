"""Reproduce the tail-aware scheduling claim (seed 002, shared/design/papers/tail-aware.md §6).

One vLLM-like instance (core/sim/instance/engine.py): Llama-3-8B-class roofline on one A100-80GB
(`roofline-a100-llama3-8b`, ~427k KV tokens, max_num_seqs 256), chunked prefill C=1024 inside a
2048-token step budget, preemption by recompute. Workload "Mix-2" (paper Table 2): 70% reasoning
requests with lengths from the ServeGen DeepSeek-R1 distributions and 30% requests from the
Azure LLM 2023 conversation trace (its own prompt/output lengths), all on the Azure trace's
arrival timestamps rescaled to ρ × the saturation rate measured for FCFS on the same lengths
(burstiness kept). Policies: fcfs, sjf (LTR+, perfect), srpt (TRAIL+) with perfect and with
predicted lengths, tail_aware (UniBoost). Prints P99 E2E, P95/P99 TTFT and mean E2E next to the
paper's claims (P99 E2E 35–50% lower than SRPT-perfect; mean ~19% worse) and, if the target
(≥ 25% lower P99 E2E) is missed, what the data say about why.

Usage: python -m benchmarks.reproduce_tail [--requests 4000] [--rho 0.99] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.paths import AZURE_CONV, SERVEGEN_R1, add_traces_option, traces_dir
from core.perf import PerfProfile, get_profile
from core.policies.gamma import boost
from core.sim.instance.engine import InstanceSim
from core.sim.instance.model import DONE, InstanceParams, InstanceSimResult
from core.sim.instance.orderings import build_ordering
from core.traces import read_azure, read_servegen

POLICIES: list[tuple[str, str, dict[str, object]]] = [
    ("fcfs", "fcfs", {}),
    ("sjf", "sjf", {}),
    ("srpt", "srpt", {}),
    ("srpt(predicted)", "srpt", {"lengths": "predicted"}),
    ("tail_aware", "tail_aware", {}),
]
PAPER_VS_SRPT = {  # UniBoost vs TRAIL+ (perfect SRPT), Table 2; positive = better
    "e2e_p99": "35-50% lower (abstract); +35.1% (Table 2)",
    "e2e_mean": "19.1% worse (Table 2)",
    "ttft_p95": "+97.4% better (Table 2)",
    "ttft_p99": "+34.0% better (Table 2)",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def workload(
    n: int, reasoning_share: float, max_model_len: int, seed: int, traces: Path
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, float]]:
    """Unit-rate arrivals (mean 1 req/s, Azure burstiness), prompt, output, is_reasoning, from
    the traces folder `traces`."""
    rng = np.random.default_rng(seed)
    az = read_azure(traces / AZURE_CONV)
    if n > len(az.arrivals):
        raise SystemExit(f"--requests {n} > {len(az.arrivals)} rows of the Azure trace")
    start = int(rng.integers(0, len(az.arrivals) - n + 1))
    sl = slice(start, start + n)
    arr = az.arrivals[sl] - az.arrivals[start]
    arr = arr * ((n - 1) / arr[-1])  # mean rate 1 req/s, gaps' shape kept
    pool_p: list[np.ndarray] = []
    pool_o: list[np.ndarray] = []
    for w in (0.0, 21600.0, 43200.0, 64800.0):  # one 600-s window per 6-h dataset PMF set
        sg = read_servegen(traces / SERVEGEN_R1, seed=seed, duration_s=600.0, start_s=w)
        pool_p.append(sg.prompt_tokens)
        pool_o.append(sg.output_tokens)
    rp, ro = np.concatenate(pool_p), np.concatenate(pool_o)
    reason = rng.random(n) < reasoning_share
    pick = rng.integers(0, len(rp), n)
    prompt = np.where(reason, rp[pick], az.prompt_tokens[sl]).astype(np.int64)
    output = np.where(reason, ro[pick], az.output_tokens[sl]).astype(np.int64)
    too_long = prompt >= max_model_len
    prompt = np.minimum(prompt, max_model_len - 1)
    clipped = output > max_model_len - prompt
    output = np.minimum(output, max_model_len - prompt)
    info = {
        "azure_start_row": float(start),
        "prompts_clipped": float(too_long.sum()),
        "outputs_clipped": float(clipped.sum()),
    }
    return arr, prompt, output, reason, info


def _dispersion(arr: np.ndarray) -> float:
    counts = np.bincount(np.floor(arr).astype(np.int64))
    return float(counts.var() / counts.mean())


def saturation_rate(
    prof: PerfProfile, params: InstanceParams, prompt: np.ndarray, output: np.ndarray, n_max: int
) -> tuple[float, float]:
    """FCFS with every request queued at t=0: work throughput (prompt + output tokens done per
    second) until the queue empties, divided by the mean request work → requests/s."""
    n = min(len(prompt), n_max)
    inst = InstanceSim(prof, build_ordering("fcfs"), params)
    for i in range(n):
        inst.submit(i, 0.0, int(prompt[i]), int(output[i]))
    while inst.waiting or inst.next_arrival() < math.inf:
        if inst.step() is None:
            break
    work = sum(min(r.hw, r.prompt) + r.generated for r in inst.requests)
    tok_s = work / inst.now
    return tok_s / float(np.mean(prompt[:n] + output[:n])), tok_s


class _Progress(InstanceSim):
    label = ""
    every_s = 20.0
    _last = 0.0
    _wall0 = 0.0

    def on_progress(self) -> None:
        w = time.perf_counter()
        if w - self._last >= self.every_s:
            self._last = w
            done = sum(1 for r in self.requests if r.state == DONE)
            log(
                f"  {self.label}: t={self.now:,.0f}s done {done}/{len(self.requests)} "
                f"running {len(self.running)} waiting {len(self.waiting)} "
                f"({w - self._wall0:.0f}s wall)"
            )


def run(
    label: str,
    name: str,
    params: dict[str, object],
    prof: PerfProfile,
    iparams: InstanceParams,
    arr: np.ndarray,
    prompt: np.ndarray,
    output: np.ndarray,
) -> tuple[InstanceSimResult, float]:
    t0 = time.perf_counter()
    inst = _Progress(prof, build_ordering(name, params), iparams)
    inst.label, inst._wall0, inst._last = label, t0, t0
    for i in range(len(arr)):
        inst.submit(i, float(arr[i]), int(prompt[i]), int(output[i]))
    res = inst.run(progress=2000)
    return res, time.perf_counter() - t0


def pct_better(new: float, base: float) -> float:
    """Paper's sign convention (Table 2): (base − new)/base, positive = better."""
    return (base - new) / base * 100.0


def tail_profile(res: InstanceSimResult, reason: np.ndarray, q: float = 99.0) -> dict[str, float]:
    """Who is in the top (100 − q)% of E2E: their lengths, wait and decode time."""
    e2e = res.e2e
    thr = float(np.percentile(e2e, q))
    top = e2e >= thr
    return {
        "n": float(top.sum()),
        "reasoning_share": float(reason[top].mean()),
        "output_mean": float(res.output[top].mean()),
        "ttft_mean": float(res.ttft[top].mean()),
        "decode_mean": float((e2e - res.ttft)[top].mean()),
        "preempt_mean": float(res.preemptions[top].mean()),
    }


ABLATIONS: list[tuple[str, str, dict[str, object]]] = [
    # why-analysis, run when the target is missed: does any γ in the spec's range change it?
    ("ta(window=1000)", "tail_aware", {"window_s": 1e9}),
    ("ta(u_k=0.01,LAS)", "tail_aware", {"adapt_gamma": False, "u_init": 0.01}),
    ("ta(u_k=100,FCFS)", "tail_aware", {"adapt_gamma": False, "u_init": 100.0}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000, help="requests per run")
    ap.add_argument("--rho", type=float, default=0.99, help="arrival rate / FCFS saturation rate")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (rows, lengths, mix)")
    ap.add_argument("--reasoning-share", type=float, default=0.7, help="Mix-2: 0.7")
    ap.add_argument("--profile", default="roofline-a100-llama3-8b")
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=32768,
        help="context limit; the profile's 8192 (Llama-3-8B) would cut reasoning outputs, "
        "32768 is Llama-3.1-8B's architecture with a longer context",
    )
    ap.add_argument("--token-budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk C (paper: 1024)")
    ap.add_argument(
        "--saturation-requests",
        type=int,
        default=4000,
        help="requests in the FCFS backlog run that measures saturation (fewer overestimate it)",
    )
    ap.add_argument("--policies", default=",".join(p[0] for p in POLICIES))
    ap.add_argument("--no-ablation", action="store_true", help="skip the γ runs made when the target is missed")
    add_traces_option(ap)
    args = ap.parse_args()

    wall0 = time.perf_counter()
    prof = get_profile(args.profile).model_copy(update={"max_model_len": args.max_model_len})
    iparams = InstanceParams(token_budget=args.token_budget, chunk_size=args.chunk)
    unit_arr, prompt, output, reason, info = workload(
        args.requests, args.reasoning_share, args.max_model_len, args.seed, traces_dir(args.traces)
    )
    log("measuring FCFS saturation throughput (all requests queued at t=0) ...")
    sat, sat_tok = saturation_rate(prof, iparams, prompt, output, args.saturation_requests)
    rate = args.rho * sat
    arr = unit_arr / rate
    print(
        f"== Mix-2 on one instance: {args.profile} (max_model_len {args.max_model_len}), "
        f"KV {prof.kv_capacity_tokens:,} tokens, max_num_seqs {prof.max_num_seqs}, "
        f"budget {args.token_budget}, chunk {args.chunk}"
    )
    print(
        f"   {args.requests} requests: {reason.mean() * 100:.0f}% reasoning (ServeGen "
        f"DeepSeek-R1 PMFs), rest Azure conv 2023 rows {int(info['azure_start_row'])}.."
        f"{int(info['azure_start_row']) + args.requests - 1}; arrivals = those rows' timestamps "
        f"rescaled (index of dispersion {_dispersion(arr):.2f} per 1-s bin)"
    )
    print(
        f"   prompt mean {prompt.mean():.0f} p99 {np.percentile(prompt, 99):.0f}; output mean "
        f"{output.mean():.0f} p50 {np.percentile(output, 50):.0f} p99 "
        f"{np.percentile(output, 99):.0f} max {output.max()} ({int(info['outputs_clipped'])} "
        f"clipped to the context limit)"
    )
    print(
        f"   FCFS saturation {sat:.3f} req/s ({sat_tok:,.0f} tok/s); rho {args.rho} -> "
        f"{rate:.3f} req/s, seed {args.seed}"
    )

    def run_all(policies: list[tuple[str, str, dict[str, object]]]) -> None:
        for label, name, params in policies:
            log(f"running {label} ...")
            rows[label], walls[label] = run(label, name, params, prof, iparams, arr, prompt, output)
            log(f"  {label} done in {walls[label]:.0f}s ({rows[label].steps:,} steps)")

    wanted = args.policies.split(",")
    rows: dict[str, InstanceSimResult] = {}
    walls: dict[str, float] = {}
    run_all([p for p in POLICIES if p[0] in wanted])
    table(rows, walls)
    if "tail_aware" not in rows or "srpt" not in rows:
        log(f"total wall {time.perf_counter() - wall0:.0f}s")
        return
    ta, sr = rows["tail_aware"].summary(), rows["srpt"].summary()
    print("\ntail_aware vs srpt (perfect lengths), paper sign convention (positive = better):")
    for key, label in (
        ("e2e_p99", "P99 E2E"),
        ("e2e_mean", "mean E2E"),
        ("ttft_p95", "P95 TTFT"),
        ("ttft_p99", "P99 TTFT"),
    ):
        ours = pct_better(ta[key], sr[key])
        print(f"  {label:<9} ours {ours:+8.1f}%   paper {PAPER_VS_SRPT[key]}")
    gain = pct_better(ta["e2e_p99"], sr["e2e_p99"])
    verdict = "MET" if gain >= TARGET else "NOT MET"
    print(f"  target: P99 E2E >= {TARGET:.0f}% lower than srpt -> {verdict}")
    if gain < TARGET and not args.no_ablation:
        log("target missed: running the gamma ablations ...")
        run_all(ABLATIONS)
        print("\ngamma ablations of tail_aware (same trace):")
        table({k: rows[k] for k, _, _ in ABLATIONS}, walls)
    explain(rows, reason, gain, rate, prof)
    log(f"total wall {time.perf_counter() - wall0:.0f}s")


TARGET = 25.0


def table(rows: dict[str, InstanceSimResult], walls: dict[str, float]) -> None:
    print(
        f"\n{'policy':<17}{'P99 E2E s':>10}{'P95 TTFT s':>11}{'P99 TTFT s':>11}{'mean E2E s':>11}"
        f"{'P50 E2E s':>10}{'preempt':>8}{'recomp Mtok':>12}{'tok/s':>6}{'step ms':>8}{'wall s':>7}"
    )
    for label, res in rows.items():
        s = res.summary()
        print(
            f"{label:<17}{s['e2e_p99']:>10.1f}{s['ttft_p95']:>11.2f}{s['ttft_p99']:>11.2f}"
            f"{s['e2e_mean']:>11.1f}{s['e2e_p50']:>10.1f}{s['preemptions']:>8.0f}"
            f"{s['recomputed_tokens'] / 1e6:>12.2f}{s['tok_per_s']:>6.0f}"
            f"{res.busy_s / res.steps * 1e3:>8.1f}{walls[label]:>7.0f}"
        )


def _busy_median(res: InstanceSimResult) -> tuple[float, float]:
    """Median (γ, τ) over the tail-aware re-key checks while half or more of the run remained."""
    if not res.trace:
        return math.nan, math.nan
    t_half = float(np.percentile(res.arrival, 90))
    pts = [(g, tau) for t, g, tau in res.trace if t <= t_half] or [res.trace[-1][1:]]
    g, tau = np.median(np.array(pts), axis=0)
    return float(g), float(tau)


def explain(
    rows: dict[str, InstanceSimResult], reason: np.ndarray, gain: float, rate: float, prof: PerfProfile
) -> None:
    """Print, from the runs themselves, what makes up the P99 E2E and what tail_aware changed."""
    print("\nwho is in the top 1% of E2E (means over those requests):")
    print(
        f"{'policy':<17}{'n':>4}{'reasoning':>10}{'output tok':>11}{'TTFT s':>9}{'decode s':>10}"
        f"{'s/token':>8}{'preempt':>8}{'evict->admit':>13}"
    )
    tails = {label: tail_profile(res, reason) for label, res in rows.items()}
    for label, t in tails.items():
        print(
            f"{label:<17}{t['n']:>4.0f}{t['reasoning_share'] * 100:>9.0f}%{t['output_mean']:>11.0f}"
            f"{t['ttft_mean']:>9.1f}{t['decode_mean']:>10.1f}"
            f"{t['decode_mean'] / t['output_mean']:>8.3f}{t['preempt_mean']:>8.2f}"
            f"{rows[label].evictions_for_waiting:>13}"
        )
    print("  (evict->admit: preemptions made to admit a waiting request, whole run)")
    ta_res = rows["tail_aware"]
    c = ta_res.counters
    g, tau = _busy_median(ta_res)
    k = 256
    window_n = rate * 120.0
    print(
        f"\ntail_aware while loaded: median gamma {g:.4g}/s, tau {tau * 1e3:.3f} ms/token "
        f"(u_k = {g * tau * k:.3g}); b_max = b(tau*k) = {boost(tau * k, g):.2f} s, "
        f"b(4096 tok) = {boost(tau * 4096, g):.2f} s; {c['gamma_updates']:.0f} gamma updates, "
        f"{c['valve_evictions']:.0f} safety-valve evictions"
    )
    if c["gamma_updates"] == 0:
        print(
            f"  gamma-Ada never updated: at {rate:.2f} req/s a 120-s window holds ~{window_n:.0f} "
            f"completions, fewer than the spec's 200-sample minimum (row ta(window=1000) drops "
            f"the 120-s bound)"
        )
    if gain >= TARGET:
        return
    sr, ta, fc = tails["srpt"], tails["tail_aware"], tails.get("fcfs")
    s_sr, s_ta = rows["srpt"].summary(), rows["tail_aware"].summary()
    need = s_sr["e2e_p99"] * (1 - TARGET / 100)
    print("\nwhy the target is missed (every number from the runs above):")
    print(
        f"  1. The P99 E2E is made of the longest reasoning decodes: under srpt the top 1% are "
        f"{sr['reasoning_share'] * 100:.0f}% reasoning, {sr['output_mean']:.0f} output tokens, and "
        f"{sr['decode_mean'] / (sr['decode_mean'] + sr['ttft_mean']) * 100:.0f}% of their E2E is "
        f"decoding; under tail_aware {ta['decode_mean'] / (ta['decode_mean'] + ta['ttft_mean']) * 100:.0f}%."
    )
    print(
        f"  2. Decode time = tokens x step time, and the step time is set by the load (batch "
        f"size, resident KV read, prefill chunks sharing the step), which an order barely moves: "
        f"mean step {rows['tail_aware'].busy_s / rows['tail_aware'].steps * 1e3:.0f} ms under "
        f"tail_aware, {rows['srpt'].busy_s / rows['srpt'].steps * 1e3:.0f} ms under srpt (a "
        f"lone decode step: {prof.step_time(1, 0) * 1e3:.0f} ms). tail_aware's top 1% spend "
        f"{ta['decode_mean']:.0f} s from first to last token ({ta['decode_mean'] / ta['output_mean'] * 1e3:.0f} "
        f"ms/token) after a {ta['ttft_mean']:.0f}-s wait; the target needs P99 <= {need:.0f} s."
    )
    print(
        f"  3. What an order can change is waiting and recompute. srpt's top-1% requests are "
        f"preempted {sr['preempt_mean']:.1f} times each (dropped, re-queued, recomputed) and take "
        f"{sr['decode_mean'] / sr['output_mean'] * 1e3:.0f} ms/token from first to last token; "
        f"tail_aware's {ta['preempt_mean']:.1f} times and "
        f"{ta['decode_mean'] / ta['output_mean'] * 1e3:.0f} ms/token (recomputed overall: srpt "
        f"{s_sr['recomputed_tokens'] / 1e6:.2f} Mtok, tail_aware "
        f"{s_ta['recomputed_tokens'] / 1e6:.2f}). That is where srpt loses its tail; tail_aware "
        f"gains {gain:.0f}%."
        + (
            f" FCFS alone gains {pct_better(rows['fcfs'].summary()['e2e_p99'], s_sr['e2e_p99']):.0f}%"
            f" (its top 1%: {fc['preempt_mean']:.1f} preemptions each)."
            if fc is not None
            else ""
        )
    )
    print(
        f"  4. The boost is bounded (b_max = {boost(tau * k, g):.2f} s here) while long requests "
        f"stay resident for hundreds of seconds, so tail_aware differs from FCFS only among "
        f"requests arriving within b_max of each other; waiting requests evicted "
        f"{rows['tail_aware'].evictions_for_waiting} residents (srpt: "
        f"{rows['srpt'].evictions_for_waiting}), which is also why its TTFT tail stays FCFS-like "
        f"(P95 {s_ta['ttft_p95']:.0f} s vs srpt {s_sr['ttft_p95']:.1f} s) instead of the paper's "
        f"TTFT gain."
    )
    abl = [k2 for k2, _, _ in ABLATIONS if k2 in rows]
    if abl:
        p99s = ", ".join(f"{k2} {rows[k2].summary()['e2e_p99']:.0f} s" for k2 in abl)
        print(
            f"  5. No gamma in the spec's range reaches the target: P99 E2E {p99s} vs "
            f"tail_aware {s_ta['e2e_p99']:.0f} s and the {need:.0f} s needed."
        )


if __name__ == "__main__":
    main()

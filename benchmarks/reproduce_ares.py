"""Reproduce ARES's decode rescheduling result in the simulator and print it next to the paper's.

Paper (design/papers/ares.md §6, ShareGPT on DeepSeek-R1-Distill-Qwen-7B, 1P+3D RTX 4090D):
P99 TPOT 96.3 ms (vLLM) → 28.3 ms (+rescheduling) → 24.3 ms (ARES), −74.77 %; goodput ×1.93.

Here, at 8 and 64 decode instances, iteration-level decode (step time grows with resident KV,
OOM preempts by recompute), the same least-KV dispatch for every system (spec §2.5):
- none          no migration (the paper's "vLLM PD")
- current_load  migrations on current KV loads only ("+rescheduling")
- ares          ARES with the survival predictor (SIBYL's estimator; no engine plugin)
- ares-learned  ARES with the learned MLP (--model, or trained here when torch is importable)
- ares_oracle   ARES with the true remaining lengths (the paper's ARES-Oracle), a reference

Workload: the ServeGen DeepSeek-R1 reasoning distributions in the traces folder (--traces; the only real
source with reasoning-length outputs, up to 32,768 tokens), all 73 clients pooled, sampled from the
12:00 6-hour window and rescaled to a rate set by Little's law so the *expected* resident KV per
decode instance is --kv-load of its capacity (the paper's sanity check puts its setting at ≈75 %).
Profile: the spec's 4090D / 7B W8A8 estimate (§7): step 9 ms + 0.09 µs per resident KV token,
200K-token KV, migration and P→D transfer at 25 Gbps (18.4 µs/token + 10 ms).
Usage: python -m benchmarks.reproduce_ares [--sizes 8,64] [--duration 2000] [--kv-load 0.75]
       [--model model.pt] [--lengths servegen|table2] [--seed 0]      (about 5 minutes)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import core.policies.ares  # noqa: F401  (registers ares, current_load, ares_oracle)
from benchmarks.paths import SERVEGEN_R1, add_traces_option, traces_dir
from core.dispatch import Dispatcher
from core.perf import PerfProfile
from core.sim.cluster import ClusterSimulation
from core.slo import SLOClass, summarize
from core.traces import Trace, read_servegen

PAPER = {"none": 96.3, "current_load": 28.3, "ares": 24.3}
PAPER_GOODPUT_X = 1.93
OUTPUT_CAP = 32768

PROFILE = PerfProfile(
    name="est-4090d-r1-distill-7b-w8a8",
    description=(
        "ARES spec §7 estimate: RTX 4090D, DeepSeek-R1-Distill-Qwen-7B W8A8; step = 9 ms + "
        "0.09 µs per resident KV token (18.2 ms at 50 % of 200K tokens, the paper's point); "
        "prefill 15 ms + 0.103 ms/token + 2.7 ns/token² (int8 MFU 0.5); KV 57,344 B/token over "
        "25 Gbps = 18.4 µs/token + 10 ms setup"
    ),
    prefill_base_s=0.015,
    prefill_per_token_s=1.03e-4,
    prefill_per_token2_s=2.7e-9,
    decode_step_base_s=0.009,
    decode_step_per_seq_s=0.0,
    decode_step_per_kv_token_s=0.09e-6,
    kv_transfer_base_s=0.010,
    kv_transfer_per_token_s=18.4e-6,
    kv_capacity_tokens=200_000,
    block_size=16,
    max_num_seqs=256,
    max_model_len=65536 + OUTPUT_CAP,
)
SLO = SLOClass(ttft_s=4.0, tpot_s=0.050)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def table2_lengths(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """[EST] lengths shaped like the paper's ShareGPT/R1 Table 2 (spec §7.1), for --lengths table2.

    Output: 17.3 % in a spike just under the 32K cap (uniform on [30K, 32,768]); the rest
    lognormal with median 1,287 and σ 0.667 (so 29 % of all outputs are < 1K and the overall
    median is ≈ 1.5K). Prompt: lognormal median 36, σ 2.0, clipped to [1, 16K] (mean ≈ 270).
    Overall output mean ≈ 6.8K against the paper's 7,542: a rough fit, not the paper's data.
    """
    cap = rng.random(n) < 0.173
    body = np.exp(rng.normal(7.16, 0.667, n))
    out = np.where(cap, rng.integers(30_000, OUTPUT_CAP + 1, n), np.minimum(body, 29_999))
    prompt = np.clip(np.exp(rng.normal(np.log(36.0), 2.0, n)), 1, 16_384)
    return prompt.astype(np.int64), np.maximum(out, 1).astype(np.int64)


def load_workload(seed: int, start_s: float, span_s: float, traces: Path) -> Trace:
    """ServeGen all-client sample (lengths only matter; arrivals are redrawn by `arrivals`)."""
    t = read_servegen(traces / SERVEGEN_R1, seed=seed, start_s=start_s, duration_s=span_s)
    out = np.minimum(t.output_tokens, OUTPUT_CAP)
    return Trace(t.name, t.arrivals, t.prompt_tokens, out, source=t.source)


def per_instance_rate(trace: Trace, kv_load: float) -> float:
    """Arrivals/s per decode instance whose expected resident KV is kv_load·capacity (Little).

    A request of prompt P and output L holds P + a tokens during its a-th step, so it adds
    Σ_a (P + a)·T_step = (L·P + L(L−1)/2)·T_step token-seconds; T_step at the target load.
    """
    p = trace.prompt_tokens.astype(float)
    out = trace.output_tokens.astype(float)
    k = kv_load * PROFILE.kv_capacity_tokens
    token_steps = float(np.mean(out * p + out * (out - 1) / 2))
    return k / (token_steps * PROFILE.step_time(1, k))


def prefill_count(trace: Trace, rate: float, util: float = 0.6) -> int:
    mean_s = float(np.mean(PROFILE.prefill_time(trace.prompt_tokens.astype(float))))
    return max(1, math.ceil(rate * mean_s / util))


def run(
    trace: Trace,
    n_prefill: int,
    n_decode: int,
    reschedule: tuple[str, dict[str, Any]],
) -> dict[str, Any]:
    d = Dispatcher(
        PROFILE,
        "least_load",
        {"by": "tokens", "bind": "prefill_end"},
        reschedule=reschedule,
        true_lengths=True,
        survival_prior_max=OUTPUT_CAP,
    )
    sim = ClusterSimulation(
        arrivals=trace.arrivals,
        prompt_tokens=trace.prompt_tokens,
        output_tokens=trace.output_tokens,
        profile=PROFILE,
        n_prefill=n_prefill,
        n_decode=n_decode,
        dispatcher=d,
        mode="iteration",
    )
    started = time.perf_counter()
    res = sim.run()
    wall = time.perf_counter() - started
    ok = res.ok
    tpot = (res.finish - res.first_token) / np.maximum(res.output_tokens - 1, 1)
    tpot = np.where(res.output_tokens > 1, tpot, 0.0)[ok]
    span = float(np.nanmax(res.finish) - res.arrival.min())
    p, out = res.prompt_tokens[ok].astype(float), res.output_tokens[ok].astype(float)
    # Time-average resident KV per instance: request r holds P + a tokens for its a-th TPOT.
    kv_mean = float(np.sum((out * p + out * (out - 1) / 2) * tpot) / (span * n_decode))
    m = summarize(
        arrival=res.arrival,
        first_token=res.first_token,
        finish=res.finish,
        output_tokens=res.output_tokens,
        ok=res.ok,
        slo=SLO,
    )
    return {
        **m,
        "preemptions": res.preemptions,
        "migrations": res.migrations,
        "proposed": res.migrations_proposed,
        "refused": sum(res.migrations_refused.values()),
        "refused_by": dict(res.migrations_refused),
        "moved_tokens": res.migrated_tokens,
        "wall_s": wall,
        "kv_mean": kv_mean,
        "stalled_share": float(np.mean(tpot > PROFILE.step_time(1, PROFILE.kv_capacity_tokens))),
    }


def learned_model(args: argparse.Namespace) -> Path | None:
    """The --model file, or one trained here on a disjoint ServeGen sample (None: no torch)."""
    if args.model is not None:
        return Path(args.model)
    try:
        import torch  # noqa: F401
    except ImportError:
        log("torch is not importable: skipping ares(learned)")
        return None
    from core.predict.learned import train

    # Disjoint from the benchmark's requests: another seed and the following hour of the window.
    if args.lengths == "servegen":
        t = load_workload(args.seed + 1000, args.servegen_start + 3600.0, 3600.0, traces_dir(args.traces))
    else:
        tp, to = table2_lengths(50_000, np.random.default_rng(args.seed + 1000))
        t = Trace("table2-train", np.zeros(len(tp)), tp, to)
    log(f"training the learned predictor on {len(t)} other ServeGen requests ...")
    model, rep = train(
        t.prompt_tokens,
        t.output_tokens,
        max_len=OUTPUT_CAP,
        epochs=args.train_epochs,
        max_samples=args.train_samples,
        seed=args.seed,
        on_epoch=lambda e, loss, v: log(f"  epoch {e}: train L1 {loss:.0f}, val MAE {v:.0f}"),
    )
    path = Path(args.workdir) / f"ares_learned_{args.lengths}_seed{args.seed}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    log(f"  val MAE {rep.val_mae:.0f} tokens (best epoch {rep.best_epoch}); saved {path}")
    return path


def explain(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Why rescheduling did or did not cut P99 TPOT by ≥ 50 %, from the runs' own numbers."""
    base = rows["none"]
    label, best = min(((k, r) for k, r in rows.items() if k != "none"), key=lambda kr: kr[1]["tpot_p99"])
    cut = 1 - best["tpot_p99"] / base["tpot_p99"]
    full = PROFILE.step_time(1, PROFILE.kv_capacity_tokens)
    floor = PROFILE.step_time(1, base["kv_mean"])
    lines = [
        f"best rescheduling ({label}) cuts P99 TPOT by {cut:.0%} (target ≥ 50 %): "
        + ("met" if cut >= 0.5 else "NOT met"),
        f"  without rescheduling {base['stalled_share']:.2%} of requests averaged a TPOT above a "
        f"full-KV step ({full * 1e3:.1f} ms), i.e. were slowed by OOM recompute stalls "
        f"({base['preemptions']} preemptions); with {label}: {best['stalled_share']:.2%} "
        f"({best['preemptions']} preemptions)",
        f"  mean resident KV ≈ {base['kv_mean']:,.0f} tokens per instance → a perfectly balanced "
        f"step takes ≈ {floor * 1e3:.1f} ms; balancing alone can cut P99 TPOT by at most ≈ "
        f"{max(0.0, 1 - floor / base['tpot_p99']):.0%} here",
    ]
    if cut >= 0.5:
        return lines
    if best["stalled_share"] <= 0.25 * max(base["stalled_share"], 1e-9) or best["preemptions"] == 0:
        stall = float(PROFILE.prefill_time(20_000))
        lines.append(
            f"  → rescheduling removed most OOM stalls; the P99 left ({best['tpot_p99'] * 1e3:.1f} "
            "ms) is step time proportional to resident KV (the balanced step above uses the "
            "time-average KV; the cluster's total varies over time, which no migration can even "
            "out, and some imbalance remains between rounds). The stalls "
            f"cost the baseline only {(base['tpot_p99'] - best['tpot_p99']) * 1e3:.1f} ms at "
            f"P99: a recompute stalls a batch once for prefill_time(N) ({stall:.1f} s at 20K "
            "tokens), spread over each request's many tokens. The paper's vLLM P99 "
            f"({PAPER['none']} ms) is {PAPER['none'] / full / 1e3:.1f}× a full-KV step at the "
            "spec's estimate, i.e. its stalls were far costlier than this model's (repeated "
            "preemption, swapping, or a per-token P99: the spec marks the TPOT definition "
            "[AMBIG]); with the ServeGen R1 lengths (lighter tail than the paper's 17 % at the "
            "32K cap) there are fewer stalls to remove still (compare --lengths table2)"
        )
    else:
        lines.append(
            "  → stalls remain after rescheduling: the cluster's KV is too close to capacity "
            "for moves to avoid every OOM (see preemptions and refusals)"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,64", help="decode instance counts, comma-separated")
    ap.add_argument("--duration", type=float, default=2000.0, help="seconds of arrivals (the paper: 2,000)")
    ap.add_argument("--kv-load", type=float, default=0.75, help="expected KV use per instance")
    ap.add_argument("--servegen-start", type=float, default=43200.0, help="sampling window start (s of the day)")
    ap.add_argument(
        "--lengths",
        choices=("servegen", "table2"),
        default="servegen",
        help="servegen: the real trace's lengths (default); table2: [EST] the paper's Table 2 shape",
    )
    ap.add_argument("--model", default=None, help="learned predictor file (train-predictor)")
    ap.add_argument("--no-learned", action="store_true", help="skip ares(learned)")
    ap.add_argument("--no-oracle", action="store_true", help="skip ares_oracle")
    ap.add_argument(
        "--max-moves", type=int, default=None, help="moves per round (default: 1 at ≤ 8 decode, |D|/8 above)"
    )
    ap.add_argument("--train-epochs", type=int, default=30)
    ap.add_argument("--train-samples", type=int, default=100_000)
    ap.add_argument("--workdir", default="/tmp/sibyl-ares", help="where a trained model is kept")
    ap.add_argument("--seed", type=int, default=0)
    add_traces_option(ap)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    started = time.perf_counter()
    model = None if args.no_learned else learned_model(args)
    if args.lengths == "servegen":
        pool = load_workload(args.seed, args.servegen_start, 3600.0, traces_dir(args.traces))
    else:
        tp, to = table2_lengths(200_000, np.random.default_rng(args.seed))
        pool = Trace("table2", np.zeros(len(tp)), tp, to, source="[EST] ARES Table 2 shape")
    lam_i = per_instance_rate(pool, args.kv_load)
    log(
        f"workload: {len(pool)} {args.lengths} requests sampled (output mean "
        f"{pool.output_tokens.mean():.0f}, p50 {np.median(pool.output_tokens):.0f}, max "
        f"{pool.output_tokens.max()}); {lam_i:.3f} req/s per decode instance for KV load "
        f"{args.kv_load:.0%}"
    )
    print(f"workload: {pool.source}")
    print(
        f"profile: {PROFILE.name}: {PROFILE.description}\n"
        f"SLO: TTFT ≤ {SLO.ttft_s:g} s, per-request TPOT ≤ {SLO.tpot_s * 1e3:g} ms; "
        f"arrivals Poisson at {lam_i:.3f} req/s per decode instance (expected KV {args.kv_load:.0%})"
    )
    for n_decode in sizes:
        rate = lam_i * n_decode
        rng = np.random.default_rng([args.seed, n_decode])
        n = max(1, int(rate * args.duration))
        pick = rng.choice(len(pool), size=n, replace=n > len(pool))
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n))
        trace = Trace(
            f"{args.lengths}@{rate:.2f}rps",
            arrivals - arrivals[0],
            pool.prompt_tokens[pick],
            pool.output_tokens[pick],
        )
        n_prefill = prefill_count(trace, rate)
        moves = args.max_moves or max(1, n_decode // 8)
        systems: list[tuple[str, tuple[str, dict[str, Any]]]] = [
            ("none", ("none", {})),
            ("current_load", ("current_load", {"max_moves": moves})),
            ("ares", ("ares", {"max_moves": moves})),
        ]
        if model is not None:
            systems.append(
                ("ares-learned", ("ares", {"max_moves": moves, "predictor": "learned", "model_path": str(model)}))
            )
        if not args.no_oracle:
            systems.append(("ares_oracle", ("ares_oracle", {"max_moves": moves})))
        rows: dict[str, dict[str, Any]] = {}
        for label, resched in systems:
            log(f"[{n_prefill}P{n_decode}D, {n} requests at {rate:.2f} req/s] {label} ...")
            rows[label] = run(trace, n_prefill, n_decode, resched)
            r = rows[label]
            log(
                f"  done in {r['wall_s']:.0f} s: P99 TPOT {r['tpot_p99'] * 1e3:.1f} ms, "
                f"{r['preemptions']} preemptions, {r['migrations']} migrations"
            )
        base = rows["none"]
        print(f"\n== {n_prefill}P{n_decode}D: {n} requests at {rate:.2f} req/s, max {moves} move(s)/round")
        print(
            f"{'system':<14} {'P99 TPOT ms':>11} {'vs none':>8} {'paper ms':>9} {'mean TPOT':>9} "
            f"{'P99 TTFT s':>10} {'goodput/s':>9} {'× none':>7} {'OOM preempt':>11} "
            f"{'migr':>6} {'refused':>7} {'sim s':>6}"
        )
        for label, r in rows.items():
            paper = PAPER.get(label)
            gx = r["goodput_req_s"] / base["goodput_req_s"] if base["goodput_req_s"] > 0 else math.nan
            print(
                f"{label:<14} {r['tpot_p99'] * 1e3:>11.1f} "
                f"{(r['tpot_p99'] / base['tpot_p99'] - 1) * 100:>+7.1f}% "
                f"{'-' if paper is None else f'{paper:.1f}':>9} {r['tpot_mean'] * 1e3:>9.1f} "
                f"{r['ttft_p99']:>10.2f} {r['goodput_req_s']:>9.3f} {gx:>7.2f} "
                f"{r['preemptions']:>11} {r['migrations']:>6} {r['refused']:>7} {r['wall_s']:>6.0f}"
            )
        print(
            f"paper: P99 TPOT {PAPER['none']} → {PAPER['current_load']} → {PAPER['ares']} ms "
            f"(−74.77 %), goodput ×{PAPER_GOODPUT_X} (1P+3D, ShareGPT, RPS 0.17)"
        )
        for label, r in rows.items():
            if r["refused_by"]:
                print(f"  {label} refusals: {r['refused_by']}")
        for line in explain(rows):
            print(line)
    log(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

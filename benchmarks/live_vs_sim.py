"""Does the live cluster agree with the simulator on which routing policy wins, and by how much?

Replays one slice of a real trace, at --rate requests/s, against an emulated cluster (10
instances by default, a console started here on free ports and stopped at the end) under each
policy, and simulates the same arrivals with the same profile in iteration mode (the emulator's
engine model); prints the P99 TPOT of each side by side, with each policy's difference to the
first one.

To keep 10 emulated instances, the gateway and the client within this 2-core machine, every time
of the profile is multiplied by --slowdown (decode throughput divided by it): the same batching
dynamics at a fraction of the tokens per second through the gateway.

Usage: python -m benchmarks.live_vs_sim [--trace FILE] [--limit 800] [--rate 11]
           [--policy least_load --policy sibyl:unit=requests --policy sibyl:unit=tokens]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from adapters.ports import free_port
from adapters.store import RunStore
from benchmarks.harness import console_env, start_console, stop
from benchmarks.paths import AZURE_CONV, add_traces_option, traces_dir
from console.offline.simulate import SimPlan, run_one
from core.perf import DecodeCurve, PerfProfile, get_profile, save_profile_file
from core.slo import SLOClass
from core.traces import read_trace

ROOT = Path(__file__).resolve().parents[1]

TIME_FIELDS = (
    "prefill_base_s",
    "prefill_per_token_s",
    "prefill_per_token2_s",
    "decode_step_base_s",
    "decode_step_per_seq_s",
    "decode_step_per_kv_token_s",
    "kv_transfer_base_s",
    "kv_transfer_per_token_s",
)


def slowed(profile: PerfProfile, k: float) -> PerfProfile:
    """The same instance k times slower: every time × k, decode throughput ÷ k."""
    update: dict[str, object] = {f: getattr(profile, f) * k for f in TIME_FIELDS}
    if profile.tps_curve is not None:
        c = profile.tps_curve
        update["tps_curve"] = DecodeCurve(a=c.a / k, b=c.b / k, c=c.c / k)
    update["name"] = f"{profile.name}-x{k:g}"
    return profile.model_copy(update=update)


def clip(prompt: np.ndarray, out: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """The replayer's rule (console/offline/replay.py): output first, then the prompt, within the context."""
    out = np.clip(out, 1, context - 1)
    return np.clip(prompt, 1, context - out), out


def parse_policy(text: str) -> tuple[str, dict[str, str]]:
    """`name` or `name:key=value,key=value` (as `bench decision --policy` takes it)."""
    name, _, rest = text.partition(":")
    return name, dict(kv.split("=", 1) for kv in rest.split(",") if kv)


def console_args(args: argparse.Namespace, profile_file: Path, policy: str) -> list[str]:
    """`up`'s arguments for the emulated cluster of `args` under `policy` (NAME or NAME:key=value,...)."""
    name, params = parse_policy(policy)
    shape = ["--prefill", str(args.prefill), "--decode", str(args.decode), "--profile", str(profile_file)]
    return [*shape, "--policy", name, *[f"--param={k}={v}" for k, v in params.items()]]


def replay(args: argparse.Namespace, url: str, env: dict[str, str], *extra: str) -> str:
    """`sibyl-console replay` of the slice (`args.trace`, `--limit`, `--speed`) against `url`; its run id."""
    cmd = [sys.executable, "-m", "console.cli", "replay", str(args.trace), "--limit", str(args.limit)]
    cmd += ["--speed", str(args.speed), *extra, "--url", url, "--json"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return str(json.loads(out.stdout)["run_id"])


def live_p99(args: argparse.Namespace, profile_file: Path, policy: str, home: Path) -> dict[str, float]:
    port = free_port()
    env = console_env(home)
    console = start_console(port, console_args(args, profile_file, policy), env)
    try:
        run_id = replay(args, f"http://127.0.0.1:{port}", env)
        rows = [r for r in RunStore(home / "runs.db").requests(run_id) if r["status"] == "ok" and r["tpot"] is not None]
        tpot = np.array([r["tpot"] for r in rows])
        return {"p99": float(np.percentile(tpot, 99)), "mean": float(tpot.mean()), "ok": len(rows)}
    finally:
        stop(console, 60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=None, help=f"the trace to replay (default: TRACES/{AZURE_CONV})")
    add_traces_option(ap)
    ap.add_argument("--limit", type=int, default=800)
    ap.add_argument("--rate", type=float, default=11.0, help="arrival rate (req/s) the slice is compressed to")
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=6)
    ap.add_argument("--profile", default="roofline-h100-llama3-8b")
    ap.add_argument("--slowdown", type=float, default=8.0)
    ap.add_argument(
        "--policy",
        action="append",
        help="routing policy, NAME or NAME:key=value,...; the first is the reference "
        "(default: least_load, sibyl:unit=requests, sibyl:unit=tokens)",
    )
    args = ap.parse_args()
    if args.trace is None:
        args.trace = traces_dir(args.traces) / AZURE_CONV
    policies = args.policy or ["least_load", "sibyl:unit=requests", "sibyl:unit=tokens"]
    profile = slowed(get_profile(args.profile), args.slowdown)
    trace = read_trace(args.trace).window(limit=args.limit)
    args.speed = args.rate / (len(trace) / float(trace.arrivals[-1] - trace.arrivals[0]))
    prompt, out = clip(np.asarray(trace.prompt_tokens), np.asarray(trace.output_tokens), profile.max_model_len)
    with tempfile.TemporaryDirectory(prefix="sibyl-live-vs-sim-") as tmp:
        profile_file = Path(tmp) / "profile.json"
        save_profile_file(profile, profile_file)
        arrivals = (np.asarray(trace.arrivals) - trace.arrivals[0]) / args.speed
        plan = SimPlan(
            arrivals=arrivals,
            prompt_tokens=prompt,
            output_tokens=out,
            workload=str(args.trace),
            profile=profile,
            n_prefill=args.prefill,
            n_decode=args.decode,
            mode="iteration",
            policies=[parse_policy(p) for p in policies],
            slo=SLOClass(),
            shadow=False,
        )
        rows = []
        for k, p in enumerate(policies):
            sim, _ = run_one(plan, *parse_policy(p))
            live = live_p99(args, profile_file, p, Path(tmp) / f"run{k}")
            rows.append((p, live, sim))
            print(
                f"{p}: live P99 TPOT {live['p99'] * 1000:.1f} ms ({live['ok']} ok), "
                f"sim {sim['tpot_p99'] * 1000:.1f} ms",
                file=sys.stderr,
            )
    ref_live, ref_sim = rows[0][1]["p99"], rows[0][2]["tpot_p99"]
    print(
        f"{args.trace.name}, first {args.limit} requests at {args.rate:g} req/s, "
        f"{args.prefill}P{args.decode}D, {profile.name}"
    )
    print(
        "| policy | live P99 TPOT ms | sim P99 TPOT ms | live vs "
        f"{policies[0]} | sim vs {policies[0]} | live mean ms | sim mean ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for p, live, sim in rows:
        print(
            f"| {p} | {live['p99'] * 1000:.1f} | {sim['tpot_p99'] * 1000:.1f} | {live['p99'] / ref_live - 1:+.1%} | "
            f"{sim['tpot_p99'] / ref_sim - 1:+.1%} | {live['mean'] * 1000:.1f} | {sim['tpot_mean'] * 1000:.1f} |"
        )


if __name__ == "__main__":
    main()

"""What `make up` shows: its demo traffic under least_load, then the prefix-aware default swapped in live.

Starts `sibyl-console up --headless` with the Makefile's demo arguments (the emulated 4P4D cluster, the
Mooncake synthetic-trace sample replayed in a loop, each hash block as 32 tokens, at its own rate) but
routing by `least_load`; after `--phase-s` seconds swaps routing to `prefix_aware` through the control
API, as the dashboard's picker does, and watches as long again. The first `--warmup-s` seconds (also under
least_load) are not judged: conversations have to start before they can return, so a lap of the sample
holds little to reuse in its first two minutes (demos/README.md). `--first prefix_aware --second
least_load` runs the control order (the trace's own drift in reuse moves both orders alike; the policy
moves them apart); `--trace demos/mooncake_conv_sample.jsonl --speed 0.3 --warmup-s 240` is the earlier
demo. Every `--every-s` it reads `/control/state` (what the dashboard draws) and prints one line: the
prefill instances' prefix hit rate (each instance's own 30 s window, mean over the prefill pool), the
gateway's TTFT p50 over its 60 s window, the replayer's TTFT p50, SLO attainment over the last minute and
the requests SLO admission has shed so far. At the end: one row per phase (the last 30 s of each, and the
share of the phase's requests that were shed), and how long after the swap the hit rate first stood above
the whole least_load phase's highest reading.

`--simulate` runs no console: it sends the same traffic (the replayer's prompts, one lap) through the
simulator with the console's default profile, under `--first` and under `--second` each for the whole
lap, and prints each policy's prefix hit rate, TTFT p50 and mean over the arrivals past `--warmup-s`,
beside the ideal hit rate there (every block an earlier request of the lap holds, reused): what the
policy can do to this traffic at all, without the trace's drift between two phases.

Usage: python -m benchmarks.demo_swap [--warmup-s 120] [--phase-s 60] [--every-s 5] [--first least_load]
       [--second prefix_aware] [--prefill 4 --decode 4] [--speed 1.0] [--hash-block-tokens 32] [--json]
       [--no-admission] [--simulate]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from adapters.ports import free_port
from benchmarks.harness import console_env, start_console, stop
from benchmarks.live_vs_sim_prefix import replay_plan
from console.live.config import ConsoleConfig
from console.offline.simulate import run_one
from core.perf import get_profile
from core.traces import Trace, read_trace

ROOT = Path(__file__).resolve().parents[1]
DEMO_TRACE = ROOT / "demos" / "mooncake_synthetic_sample.jsonl"
"""The Makefile's `up` target replays it in a loop (its `--policy prefix_aware` left out: this script starts on
`--first`); `--speed` and `--hash-block-tokens` default to make up's."""


def reading(state: dict[str, Any], t: float, policy: str) -> dict[str, Any]:
    """One sample of what the dashboard shows: mean prefill hit rate, gateway and replayer TTFT p50, SLO
    attainment over the last minute, and the requests SLO admission has shed so far."""
    rates = [
        i["prefix_hit_rate"]
        for i in state["instances"]
        if i["role"] == "prefill" and i.get("prefix_hit_rate") is not None
    ]
    replay = state.get("replay") or {}
    return {
        "t": round(t, 1),
        "policy": policy,
        "prefill_hit_rate": statistics.fmean(rates) if rates else None,
        "ttft_p50": state["slo"]["window"].get("ttft_p50"),
        "replay_ttft_p50": replay.get("ttft_p50"),
        "finished": state["slo"]["run"].get("requests"),
        "attainment": state["slo"]["window"].get("attainment"),
        "shed": ((state.get("queue") or {}).get("admission") or {}).get("shed"),
    }


def state(c: httpx.Client) -> dict[str, Any]:
    """`/control/state`, asked again once if the server closed the kept-alive connection as it was reused."""
    try:
        return c.get("/control/state").json()  # type: ignore[no-any-return]
    except httpx.TransportError:
        return c.get("/control/state").json()  # type: ignore[no-any-return]


def phase_row(samples: list[dict[str, Any]], policy: str, last_s: float) -> dict[str, Any]:
    """The phase's last `last_s` seconds: mean of each reading that was present; and the share of the
    requests that finished during the whole phase that SLO admission shed."""
    mine = [s for s in samples if s["policy"] == policy]
    end = mine[-1]["t"] if mine else 0.0
    tail = [s for s in mine if s["t"] >= end - last_s]

    def mean(key: str) -> float | None:
        values = [s[key] for s in tail if s[key] is not None]
        return statistics.fmean(values) if values else None

    row: dict[str, Any] = {
        "policy": policy,
        **{k: mean(k) for k in ("prefill_hit_rate", "ttft_p50", "replay_ttft_p50", "attainment")},
    }
    done = (mine[-1]["finished"] or 0) - (mine[0]["finished"] or 0) if mine else 0
    shed = (mine[-1]["shed"] or 0) - (mine[0]["shed"] or 0) if mine else 0
    row["shed_share"] = shed / done if done > 0 and mine[-1]["shed"] is not None else None
    return row


def ideal_hit(trace: Trace, prompt_tokens: np.ndarray, hash_block_tokens: int, block_size: int = 16) -> np.ndarray:
    """Per row, the prompt tokens an instance holding every earlier row's blocks would find cached: its
    leading hash blocks seen before, as tokens, capped as vLLM caps a hit (whole blocks of prompt − 1)."""
    seen: set[int] = set()
    out = np.zeros(len(trace), dtype=np.int64)
    for i, ids in enumerate(trace.hash_ids or []):
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        seen.update(ids)
        cap = (int(prompt_tokens[i]) - 1) // block_size * block_size
        out[i] = min(k * hash_block_tokens, cap)
    return out


def simulate(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One lap of the demo's traffic through the simulator under each policy (see the module docstring)."""
    trace = read_trace(args.trace).with_sessions()
    profile = get_profile(ConsoleConfig().profile)
    rows = []
    for policy in (args.first, args.second):
        plan = replay_plan(args, trace, profile, policy)
        _, r = run_one(plan, policy, {})
        judged = r.arrival >= args.warmup_s
        ttft = (r.first_token - r.arrival)[judged]
        prompt = r.prompt_tokens[judged].sum()
        ideal = ideal_hit(trace, plan.prompt_tokens, args.hash_block_tokens)[judged].sum()
        rows.append(
            {
                "policy": policy,
                "requests": int(judged.sum()),
                "hit": float(r.cached_tokens[judged].sum() / prompt),
                "ideal_hit": float(ideal / prompt),
                "ttft_p50": float(np.median(ttft)),
                "ttft_mean": float(ttft.mean()),
            }
        )
    return rows


def fmt(x: float | None, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if x is None else f"{x * scale:.1f}{suffix}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-s", type=float, default=60.0, help="seconds under each routing policy")
    ap.add_argument("--every-s", type=float, default=5.0, help="seconds between readings")
    ap.add_argument("--warmup-s", type=float, default=120.0, help="seconds under --first before the judged phases")
    ap.add_argument("--first", default="least_load", help="routing policy before the swap")
    ap.add_argument("--second", default="prefix_aware", help="routing policy after the swap")
    ap.add_argument("--prefill", type=int, default=4, help="prefill instances (make up: 4)")
    ap.add_argument("--decode", type=int, default=4, help="decode instances (make up: 4)")
    ap.add_argument("--speed", type=float, default=1.0, help="replay speed (make up: 1.0)")
    ap.add_argument("--hash-block-tokens", type=int, default=32, help="tokens per trace hash block (make up: 32)")
    ap.add_argument("--json", action="store_true", help="print the samples and rows as JSON")
    ap.add_argument("--trace", type=Path, default=DEMO_TRACE, help="the trace replayed in a loop (make up's)")
    ap.add_argument("--no-admission", action="store_true", help="SLO admission off (make up: on)")
    ap.add_argument("--simulate", action="store_true", help="the same traffic in the simulator, one policy per lap")
    args = ap.parse_args()
    if args.simulate:
        rows = simulate(args)
        if args.json:
            print(json.dumps(rows, indent=1))
            return
        print(
            f"demo traffic in the simulator, {args.prefill}P{args.decode}D, speed {args.speed:g}, "
            f"{args.hash_block_tokens} tokens per hash block; arrivals past {args.warmup_s:g} s"
        )
        print("| routing | requests | prefix hit | ideal hit | TTFT p50 | TTFT mean |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['policy']} | {r['requests']} | {r['hit']:.1%} | {r['ideal_hit']:.1%} "
                f"| {r['ttft_p50'] * 1000:.0f} ms | {r['ttft_mean'] * 1000:.0f} ms |"
            )
        a, b = rows
        print(
            f"{b['policy']} vs {a['policy']}: TTFT p50 {b['ttft_p50'] / a['ttft_p50'] - 1:+.0%}, "
            f"mean {b['ttft_mean'] / a['ttft_mean'] - 1:+.0%}"
        )
        return
    home = Path(tempfile.mkdtemp(prefix="sibyl-demo-swap-"))
    token = "demo-swap-token"
    port = free_port()
    shape = ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    demo = ["--replay", str(args.trace), "--replay-hash-block-tokens", str(args.hash_block_tokens)]
    demo += ["--replay-speed", str(args.speed), "--loop"]
    config: list[str] = []
    if args.no_admission:  # SLO admission sheds a burst's overflow: off, every request is served and timed
        (home / "demo.toml").write_text("[admission]\nenabled = false\n")
        config = [str(home / "demo.toml")]
    console = start_console(port, [*config, *demo, *shape, "--policy", args.first], console_env(home, token))
    samples: list[dict[str, Any]] = []
    swapped_at: float | None = None
    try:
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}, timeout=10
        ) as c:
            start = time.monotonic()
            policy = args.first
            swap_at = args.warmup_s + args.phase_s
            while (t := time.monotonic() - start) < swap_at + args.phase_s:
                if swapped_at is None and t >= swap_at:
                    r = c.put("/control/policies/routing", json={"name": args.second, "source": "demo_swap"})
                    r.raise_for_status()
                    swapped_at, policy = t, args.second
                    print(f"{t:6.1f} s  routing -> {args.second}", file=sys.stderr)
                s = reading(state(c), t, policy if t >= args.warmup_s else "warmup")
                samples.append(s)
                hit, ttft = fmt(s["prefill_hit_rate"], 100, "%"), fmt(s["ttft_p50"], 1000, " ms")
                seen = fmt(s["replay_ttft_p50"], 1000, " ms")
                print(
                    f"{s['t']:6.1f} s  {policy:<13} prefill hit {hit:>6}  TTFT p50 {ttft:>10}  replayer {seen:>10}  "
                    f"SLO {fmt(s['attainment'], 100, '%'):>6}  shed {s['shed']}",
                    file=sys.stderr,
                )
                time.sleep(max(0.0, args.every_s - (time.monotonic() - start - t)))
    finally:
        stop(console)
    rows = [phase_row(samples, p, 30.0) for p in (args.first, args.second)]
    before = [s["prefill_hit_rate"] for s in samples if s["policy"] == args.first and s["prefill_hit_rate"]]
    ceiling = max(before, default=0.0)
    above = [
        s["t"] - swapped_at
        for s in samples
        if swapped_at is not None and s["policy"] == args.second and (s["prefill_hit_rate"] or 0.0) > ceiling
    ]
    visible_after = above[0] if above else None
    if args.json:
        print(json.dumps({"samples": samples, "rows": rows, "visible_after_s": visible_after}, indent=1))
        return
    print(
        f"{'routing (last 30 s)':<20} {'prefill hit':>12} {'TTFT p50':>10} {'replayer TTFT p50':>18} "
        f"{'SLO attained':>13} {'shed (phase)':>13}"
    )
    for r in rows:
        print(
            f"{r['policy']:<20} {fmt(r['prefill_hit_rate'], 100, '%'):>12} {fmt(r['ttft_p50'], 1000, ' ms'):>10} "
            f"{fmt(r['replay_ttft_p50'], 1000, ' ms'):>18} {fmt(r['attainment'], 100, '%'):>13} "
            f"{fmt(r['shed_share'], 100, '%'):>13}"
        )
    print(
        f"hit rate above every {args.first} reading "
        + ("never" if visible_after is None else f"{visible_after:.0f} s after the swap")
    )


if __name__ == "__main__":
    main()

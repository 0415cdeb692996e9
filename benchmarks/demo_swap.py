"""What `make up` shows: its demo traffic under least_load, then the prefix-aware default swapped in live.

Starts `sibyl-console up --headless` with the Makefile's demo arguments (the emulated 4P4D cluster, the
Mooncake conversation sample replayed in a loop, each hash block as 32 tokens, at 0.3x) but routing by
`least_load`; after `--phase-s` seconds swaps routing to `prefix_aware` through the control API, as the
dashboard's picker does, and watches as long again. The first `--warmup-s` seconds (also under
least_load) are not judged: the sample's first ~250 rows (5 minutes at 0.3x) hold little to reuse (the ideal
hit rate of its first 100 rows is 3%, of rows 300-1,000 about 25%), since conversations have to start before
they can return. `--first prefix_aware --second least_load` runs the control order (the trace's own drift
in reuse moves both orders alike; the policy moves them apart). Every `--every-s` it reads `/control/state` (what the
dashboard draws) and prints one line: the prefill instances' prefix hit rate (each instance's own 30 s
window, mean over the prefill pool), the gateway's TTFT p50 over its 60 s window, and the replayer's TTFT
p50. At the end: one row per phase (the last 30 s of each), and how long after the swap the hit rate first
stood above the whole least_load phase's highest reading.

Usage: python -m benchmarks.demo_swap [--warmup-s 240] [--phase-s 60] [--every-s 5] [--first least_load]
       [--second prefix_aware] [--prefill 4 --decode 4] [--speed 0.3] [--hash-block-tokens 32] [--json]
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

from adapters.ports import free_port
from benchmarks.harness import console_env, start_console, stop

ROOT = Path(__file__).resolve().parents[1]
DEMO_TRACE = ROOT / "demos" / "mooncake_conv_sample.jsonl"
"""The Makefile's `up` target replays it in a loop (its `--policy prefix_aware` left out: this script starts on
`--first`); `--speed` and `--hash-block-tokens` default to make up's."""


def reading(state: dict[str, Any], t: float, policy: str) -> dict[str, Any]:
    """One sample of what the dashboard shows: mean prefill hit rate, gateway and replayer TTFT p50."""
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
    }


def state(c: httpx.Client) -> dict[str, Any]:
    """`/control/state`, asked again once if the server closed the kept-alive connection as it was reused."""
    try:
        return c.get("/control/state").json()  # type: ignore[no-any-return]
    except httpx.TransportError:
        return c.get("/control/state").json()  # type: ignore[no-any-return]


def phase_row(samples: list[dict[str, Any]], policy: str, last_s: float) -> dict[str, Any]:
    """The phase's last `last_s` seconds: mean of each reading that was present."""
    mine = [s for s in samples if s["policy"] == policy]
    end = mine[-1]["t"] if mine else 0.0
    tail = [s for s in mine if s["t"] >= end - last_s]

    def mean(key: str) -> float | None:
        values = [s[key] for s in tail if s[key] is not None]
        return statistics.fmean(values) if values else None

    return {"policy": policy, **{k: mean(k) for k in ("prefill_hit_rate", "ttft_p50", "replay_ttft_p50")}}


def fmt(x: float | None, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if x is None else f"{x * scale:.1f}{suffix}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-s", type=float, default=60.0, help="seconds under each routing policy")
    ap.add_argument("--every-s", type=float, default=5.0, help="seconds between readings")
    ap.add_argument("--warmup-s", type=float, default=240.0, help="seconds under --first before the judged phases")
    ap.add_argument("--first", default="least_load", help="routing policy before the swap")
    ap.add_argument("--second", default="prefix_aware", help="routing policy after the swap")
    ap.add_argument("--prefill", type=int, default=4, help="prefill instances (make up: 4)")
    ap.add_argument("--decode", type=int, default=4, help="decode instances (make up: 4)")
    ap.add_argument("--speed", type=float, default=0.3, help="replay speed (make up: 0.3)")
    ap.add_argument("--hash-block-tokens", type=int, default=32, help="tokens per trace hash block (make up: 32)")
    ap.add_argument("--json", action="store_true", help="print the samples and rows as JSON")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="sibyl-demo-swap-"))
    token = "demo-swap-token"
    port = free_port()
    shape = ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    demo = ["--replay", str(DEMO_TRACE), "--replay-hash-block-tokens", str(args.hash_block_tokens)]
    demo += ["--replay-speed", str(args.speed), "--loop"]
    console = start_console(port, [*demo, *shape, "--policy", args.first], console_env(home, token))
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
                    f"{s['t']:6.1f} s  {policy:<13} prefill hit {hit:>6}  TTFT p50 {ttft:>10}  replayer {seen:>10}",
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
    print(f"{'routing (last 30 s)':<20} {'prefill hit':>12} {'TTFT p50':>10} {'replayer TTFT p50':>18}")
    for r in rows:
        print(
            f"{r['policy']:<20} {fmt(r['prefill_hit_rate'], 100, '%'):>12} {fmt(r['ttft_p50'], 1000, ' ms'):>10} "
            f"{fmt(r['replay_ttft_p50'], 1000, ' ms'):>18}"
        )
    print(
        f"hit rate above every {args.first} reading "
        + ("never" if visible_after is None else f"{visible_after:.0f} s after the swap")
    )


if __name__ == "__main__":
    main()

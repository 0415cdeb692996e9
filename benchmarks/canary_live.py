"""The canary target of issue 40, live: a 10% routing canary on an emulated cluster, against the real gap between
its two policies (`benchmarks/advisor.py --parts canary` shows it on simulated arms).

**The setting.** A slice of the Mooncake conversation trace (its prefix hashes and the sessions derived from
them; each 512-token hash block sent as `--hash-block-tokens` tokens, outputs capped at `--output-cap` tokens so
the gateway, the emulators and this client fit a 2-core machine) replayed with `up --replay` at `--rate`
requests/s into an emulated `--cluster` (`--profile` slowed `--slowdown` times, as live_vs_sim.py), one of
whose prefill instances is made `--slow-prefill` times slower at start (the emulator's own fault,
`PUT /admin/faults {"slowdown": k}`, as chaos.py sets faults: a degraded instance of the same pool).

**The pair, and why it differs.** `least_load` sends each prompt to the prefill instance whose first token comes
soonest, with each instance's calibrated speed (console/live/calibrator.py), so it learns to send the slow one
less. `session_affinity` (decode by least_load, so only the prefill choice differs) hashes each session onto a
prefill instance and skips it only past 1.25 × the mean *count* of requests in prefill: blind to speed, it keeps
sending the slow instance its share of sessions, whose prompts then queue there. The gap is in P99 TTFT, and
it holds per request (a canary request keeps its own placement beside the other arm's), so a canary can see it.
On equal instances the two differ little and unsteadily (the few longest prompts set the P99), too little to be
sure of a ≥ 20% gap; a decode-side pair (round_robin, load-blind on decode) moves TPOT, not TTFT.

**What runs.** The real gap: each policy alone on seed 0's slice (`--gap-every-seed`: on each seed's), its
P99 TTFT over the requests that arrived from `--warmup-s` to `--warmup-s` + `--for-s` (the run store's rows,
as advisor_live.py reads them). Then per seed (a seed moves the slice 7% further through the trace; the
console salts its split with the canary's own id, new each run): the replay under `--active`, after
`--warmup-s` a canary of `--candidate` at `--share` for `--for-s` started over the control API
(`POST /control/canary`, as `policy canary` does; the console's token is the one this script gives it), polled
until it ends; its verdict, when, its arms' counts and figures, and the same comparison recomputed from the
run store's rows of its arms (`read_canary` on them: the check that the figures were read as stored). *Right*
is rollback when the candidate's alone P99 TTFT is worse, promote when better.

**SLO admission stays at its default (on)**, as an operator runs it: it refuses the arrivals it projects to
miss (5–7% of an alone run at this load in the smoke runs), so each P99 is over the requests routed, and a
refused request is in neither arm (admission refuses it before it is routed, where its arm is set).
`--no-admission` turns it off to compare every request.

A full run is 2 + seeds replays of warmup + for + tail seconds (~6 min each at the defaults: ~45 min).
Usage: python -m benchmarks.canary_live [--seeds 5] [--for-s 300] [--share 0.1] [--cluster 2P2D] [--rate 9]
       [--gap-every-seed] [--no-admission] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from adapters.ports import free_port
from adapters.store import RunStore
from benchmarks.advisor_live import p99_ttft
from benchmarks.harness import console_env, start_console, stop
from benchmarks.live_vs_sim import parse_policy, slowed
from benchmarks.paths import add_traces_option, traces_dir
from console.advisor.canary import ArmSample, plan_canary, read_canary
from console.control_client import ControlClient
from core.perf import get_profile, save_profile_file
from core.traces import Trace, read_trace

MOONCAKE_CONV = Path("mooncake_fast25") / "conversation_trace.jsonl"
RIGHT = {"better": "promote", "worse": "rollback"}
"""The verdict that is right for a candidate whose alone P99 TTFT is better or worse than the active policy's."""
POLL_S = 2.0


def write_slice(trace: Trace, seed: int, seconds: float, rate: float, output_cap: int, path: Path) -> int:
    """`seconds` of the trace at `rate` requests/s, starting 7% further into it per seed (wrapping), as a
    Mooncake-format file (outputs capped); its row count."""
    native, last = trace.mean_rate(), float(trace.arrivals[-1])
    span = seconds * rate / native
    start = (seed * 0.07 * last) % max(last - span, 1.0)
    piece = trace.window(start, span).scale_time(native / rate)
    assert piece.hash_ids is not None
    with path.open("w") as f:
        for t, p, o, h in zip(piece.arrivals.tolist(), piece.prompt_tokens.tolist(), piece.output_tokens.tolist(),
                              piece.hash_ids, strict=True):
            f.write(json.dumps({"timestamp": round(1000 * t), "input_length": p, "output_length": min(o, output_cap),
                                "hash_ids": list(h)}) + "\n")
    return len(piece)


class LiveConsole:
    """A headless emulated console replaying one file under one policy, with its slow prefill instance set."""

    def __init__(self, args: argparse.Namespace, home: Path, profile_file: Path, trace_file: Path, policy: str):
        home.mkdir(parents=True, exist_ok=True)
        port, token = free_port(), secrets.token_hex(16)
        config = home / "console.toml"
        config.write_text("[admission]\nenabled = false\n" if args.no_admission else "")
        name, params = parse_policy(policy)
        cmd = [str(config), "--prefill", str(args.prefill), "--decode", str(args.decode), "--profile",
               str(profile_file), "--policy", name, *[f"--param={k}={v}" for k, v in params.items()],
               "--replay", str(trace_file), "--replay-hash-block-tokens", str(args.hash_block_tokens)]
        self.home = home
        self.proc: subprocess.Popen[bytes] = start_console(port, cmd, console_env(home, token))
        self.up = time.monotonic()
        try:
            self.client = ControlClient(f"http://127.0.0.1:{port}", token)
            state = self.client.state()
            self.run_id: str = state["run_id"]
            self.slow = slow_instance(state, args.slow_prefill)
        except BaseException:
            stop(self.proc, 60)
            raise

    def replay_done(self, total: int) -> bool:
        replay = self.client.state().get("replay") or {}
        return replay.get("status") in ("done", "finished", "stopped") or (
            (replay.get("done") or 0) + (replay.get("failed") or 0) >= total
        )

    def close(self) -> list[dict[str, Any]]:
        """Stop the console; its request rows."""
        self.client.close()
        stop(self.proc, 60)
        return RunStore(self.home / "runs.db").requests(self.run_id)


def slow_instance(state: dict[str, Any], factor: float) -> str | None:
    """Slow the last prefill instance `factor` times (its emulator's fault); its id (None: factor 1 or less)."""
    if factor <= 1:
        return None
    prefill = sorted((i for i in state["instances"] if i["role"] == "prefill"), key=lambda i: i["id"])
    target = prefill[-1]
    httpx.put(target["url"] + "/admin/faults", json={"slowdown": factor}, timeout=10).raise_for_status()
    return str(target["id"])


def alone(args: argparse.Namespace, tmp: Path, profile_file: Path, trace_file: Path, total: int, policy: str,
          seed: int) -> dict[str, Any]:
    """One replay of the slice under `policy` alone: its P99 TTFT over the canary's window of arrivals."""
    live = LiveConsole(args, tmp / f"alone-{seed}-{policy.replace(':', '-')}", profile_file, trace_file, policy)
    try:
        deadline = live.up + args.warmup_s + args.for_s + args.tail_s + 180
        while time.monotonic() < deadline and not live.replay_done(total):
            time.sleep(POLL_S)
    finally:
        rows = live.close()
    t0 = min(r["arrival"] for r in rows)
    start, end = t0 + args.warmup_s, t0 + args.warmup_s + args.for_s
    inside = [r for r in rows if start <= r["arrival"] <= end]
    out = {"policy": policy, "seed": seed, "requests": len(inside), "p99_ttft": p99_ttft(rows, start, end),
           "failed": sum(r["status"] != "ok" for r in inside), "why_failed": why_failed(inside),
           "slow_instance": live.slow}
    print(f"alone {policy}, seed {seed}: P99 TTFT {out['p99_ttft']} s over {len(inside)} requests "
          f"({out['failed']} failed)", file=sys.stderr)
    return out


def why_failed(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Failed rows by their status and the first words of their reason."""
    return dict(Counter(f"{r['status']}: {' '.join(str(r['reason'] or '').split()[:6])}" for r in rows
                        if r["status"] != "ok"))


def arm_rows(rows: list[dict[str, Any]], arm: str, start: float, end: float) -> list[dict[str, Any]]:
    """The rows the canary counted in `arm`: arrived after its start, finished by its last reading."""
    return [r for r in rows if r.get("arm") == arm and r["arrival"] >= start
            and (r["finish"] is None or r["finish"] <= end)]


def canary(args: argparse.Namespace, tmp: Path, profile_file: Path, trace_file: Path, seed: int) -> dict[str, Any]:
    """The replay under the active policy with a canary of the candidate started after the warm-up."""
    live = LiveConsole(args, tmp / f"canary-{seed}", profile_file, trace_file, args.active)
    name, params = parse_policy(args.candidate)
    try:
        time.sleep(max(live.up + args.warmup_s - time.monotonic(), 0.0))
        started = live.client.start_canary("routing", name, dict(params), args.share, args.for_s, source="bench")
        deadline = time.monotonic() + args.for_s + 180
        while True:
            time.sleep(POLL_S)
            snap = live.client.canary()
            if snap["running"] is None or snap["running"]["id"] != started["id"]:
                break
            if time.monotonic() > deadline:
                live.client.stop_canary(source="bench")
        ended = live.client.canary()["last"]
    finally:
        rows = live.close()
    assert ended is not None and ended["id"] == started["id"], ended
    start, elapsed = ended["started_t"], ended["elapsed_s"]
    arms = {a: arm_rows(rows, a, start, start + elapsed) for a in ("canary", "control")}
    plan = plan_canary("routing", name, dict(params), args.share, args.for_s)
    again = read_canary(ArmSample.from_rows(arms["canary"]), ArmSample.from_rows(arms["control"]), plan, elapsed)
    reading = ended.get("reading") or {}
    figures = {f["figure"]: f for f in reading.get("figures", [])}
    p99 = {a: p99_ttft(r, start, start + elapsed) for a, r in arms.items()}
    out = {
        "seed": seed, "canary_id": ended["id"], "decision": ended["decision"], "reason": ended["reason"],
        "at_s": elapsed, "requests": sum(1 for r in rows if start <= r["arrival"] <= start + elapsed),
        "canary_n": reading.get("canary_n"), "control_n": reading.get("control_n"),
        "canary_ttft": figures.get("ttft_p99"), "figures": figures, "readings": ended.get("readings"),
        "store": {"canary_n": len(arms["canary"]), "control_n": len(arms["control"]), "decision": again.decision,
                  "canary_p99_ttft": p99["canary"], "control_p99_ttft": p99["control"],
                  "arms_diff": p99["canary"] / p99["control"] - 1 if p99["canary"] and p99["control"] else None,
                  "failed": {a: why_failed(r) for a, r in arms.items()}},
        "slow_instance": live.slow,
    }
    print(f"canary seed {seed}: {out['decision']} at {elapsed:.0f} s ({out['reason']})", file=sys.stderr)
    return out


def judged(run: dict[str, Any], gap: dict[str, Any]) -> dict[str, Any]:
    real = gap["candidate"]["p99_ttft"] / gap["active"]["p99_ttft"] - 1
    truth = "better" if real < 0 else "worse"
    return {**run, "gap_seed": gap["seed"], "real_p99_ttft_diff": real, "truth": truth,
            "right": run["decision"] == RIGHT[truth]}


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def print_table(args: argparse.Namespace, gaps: dict[int, dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    print(f"Mooncake conversation at {args.rate:g} req/s, {args.hash_block_tokens} tokens per hash block, outputs "
          f"≤ {args.output_cap}; {args.prefill}P{args.decode}D {args.profile} ×{args.slowdown:g}, one prefill "
          f"instance ×{args.slow_prefill:g} slower; admission {'off' if args.no_admission else 'on'}; "
          f"{args.active} → {args.candidate} at {args.share:.0%} for {args.for_s:g} s")
    for seed, g in gaps.items():
        a, c = g["active"], g["candidate"]
        print(f"real gap, seed {seed}'s slice: P99 TTFT {args.active} {a['p99_ttft']:.3f} s ({a['requests']} req, "
              f"{a['failed']} failed), {args.candidate} {c['p99_ttft']:.3f} s ({c['requests']} req, {c['failed']} "
              f"failed): {pct(c['p99_ttft'] / a['p99_ttft'] - 1)}")
    print(f"{'seed':>4} {'requests':>8} {'canary n':>8} {'control n':>9} {'real Δp99':>9} {'verdict':<12} {'at s':>5} "
          f"{'arms Δp99':>9} {'canary TTFT Δ [interval] (direction)':<40} {'right':>5} {'store n':>9} {'store':<12}")
    for r in rows:
        f = r["canary_ttft"]
        high = "+∞" if f is None or f["high"] is None else pct(f["high"])  # JSON has no infinity: null
        own = "-" if f is None else f"{pct(f['difference'])} [{pct(f['low'])}, {high}] ({f['direction']})"
        s = r["store"]
        print(f"{r['seed']:>4} {r['requests']:>8} {r['canary_n'] or 0:>8} {r['control_n'] or 0:>9} "
              f"{pct(r['real_p99_ttft_diff']):>9} {r['decision']:<12} {r['at_s']:>5.0f} {pct(s['arms_diff']):>9} "
              f"{own:<40} {'yes' if r['right'] else 'NO':>5} {s['canary_n']:>4}/{s['control_n']:<4} "
              f"{s['decision']:<12}")
    small = [s for s, g in gaps.items() if abs(g["candidate"]["p99_ttft"] / g["active"]["p99_ttft"] - 1) < 0.2]
    print(f"right verdict within {args.for_s:g} s in {sum(r['right'] for r in rows)} of {len(rows)} seeds"
          + (f"; the real gap is under 20% on seed(s) {small}: the target's premise does not hold there" if small
             else ""))
    print("store n / store: each arm's rows in the run store and the rule's verdict recomputed from them")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_traces_option(ap)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--for-s", type=float, default=300.0, help="the canary's duration")
    ap.add_argument("--share", type=float, default=0.1)
    ap.add_argument("--cluster", default="2P2D")
    ap.add_argument("--rate", type=float, default=9.0, help="replayed requests per second")
    ap.add_argument("--warmup-s", type=float, default=30.0, help="replay before the canary starts (not judged)")
    ap.add_argument("--tail-s", type=float, default=15.0, help="replay past the canary's end")
    ap.add_argument("--hash-block-tokens", type=int, default=32)
    ap.add_argument("--output-cap", type=int, default=64)
    ap.add_argument("--profile", default="roofline-h100-llama3-8b")
    ap.add_argument("--slowdown", type=float, default=4.0, help="every instance's profile times")
    ap.add_argument("--slow-prefill", type=float, default=3.0, help="one prefill instance this many times slower")
    ap.add_argument("--active", default="least_load")
    ap.add_argument("--candidate", default="session_affinity:decode=least_load", help="NAME or NAME:key=value,...")
    ap.add_argument("--gap-every-seed", action="store_true", help="measure the real gap on every seed's slice")
    ap.add_argument("--no-admission", action="store_true", help="turn SLO admission off (default: on)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    shape = re.fullmatch(r"(\d+)P(\d+)D", args.cluster)
    if shape is None:
        ap.error(f"--cluster {args.cluster!r}: expected like 2P2D")
    args.prefill, args.decode = int(shape[1]), int(shape[2])
    profile = slowed(get_profile(args.profile), args.slowdown)
    trace = read_trace(traces_dir(args.traces) / MOONCAKE_CONV)
    seconds = args.warmup_s + args.for_s + args.tail_s
    gaps: dict[int, dict[str, Any]] = {}
    runs = []
    with tempfile.TemporaryDirectory(prefix="sibyl-canary-live-") as tmp_dir:
        tmp = Path(tmp_dir)
        profile_file = tmp / "profile.json"
        save_profile_file(profile, profile_file)
        for seed in range(args.seeds):
            trace_file = tmp / f"slice-{seed}.jsonl"
            total = write_slice(trace, seed, seconds, args.rate, args.output_cap, trace_file)
            if seed == 0 or args.gap_every_seed:
                gaps[seed] = {"seed": seed, **{role: alone(args, tmp, profile_file, trace_file, total, policy, seed)
                                               for role, policy in (("active", args.active),
                                                                    ("candidate", args.candidate))}}
            runs.append(judged(canary(args, tmp, profile_file, trace_file, seed), gaps.get(seed, gaps[0])))
    if args.json:
        print(json.dumps({"setting": {k: v for k, v in vars(args).items() if k != "traces"}, "gaps": gaps,
                          "seeds": runs}, indent=2, default=str))
        return
    print_table(args, gaps, runs)


if __name__ == "__main__":
    main()

"""The advisor's prediction target (issue 40), live: a trace whose character changes halfway, replayed through an
emulated cluster under the active policy with the advisor on, then under each candidate for comparison.

The trace: `--azure-rows` rows of the Azure conversation trace (no shared prefixes: every row gets hash ids of its
own), a `--gap-s` pause, then `--mooncake-rows` rows of the Mooncake conversation trace with its prefix hashes, all
written as one Mooncake-format file and replayed with `up --replay` at `--speed`, each 512-token hash block sent as
`--hash-block-tokens` tokens (prompts scaled alike). The emulated engines run `--profile` slowed `--slowdown` times
(as live_vs_sim_prefix.py: so the emulators, gateway and client fit this 2-core machine with the prefill pool busy
in the Mooncake half). Routing reads the emulators' KV events (`[prefix] source = "precise"`); SLO admission is
off. The active run (`--active`) has `[advisor] enabled` with `--period-s` and `--window-s`; the candidates'
runs do not (each replays the same file under its policy).

For each half, the advice used is the latest one the live advisor recorded (the run store's advice events) whose
window lies within that half. Each policy's observed P99 TTFT is taken over the same window, placed relative to
the half's first arrival in its own run. Targets, per half: the advisor's order of the candidates by predicted P99
TTFT is the order of their live P99 TTFTs, each from a run without the advisor (the active policy's second run; two
live figures within `--tie` of each other are a tie: either order counts), and its predicted P99 TTFT of the
active policy is within 25% of the observed.
Usage: python -m benchmarks.advisor_live [--azure-rows 600] [--mooncake-rows 400] [--speed 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from adapters.ports import free_port
from adapters.store import RunStore
from benchmarks.harness import console_env, start_console, stop
from benchmarks.live_vs_sim import slowed
from benchmarks.paths import AZURE_CONV, add_traces_option, traces_dir
from core.perf import get_profile, save_profile_file
from core.traces import read_trace

MOONCAKE_CONV = Path("mooncake_fast25") / "conversation_trace.jsonl"
CANDIDATES = ("least_load", "sibyl", "prefix_aware")
FRESH_IDS = 3_000_000_000
"""Hash ids of the Azure half: above every Mooncake id, one block per row and position, shared with nothing."""


def two_halves(traces: Path, azure_rows: int, mooncake_rows: int, gap_s: float, out: Path) -> float:
    """Write the trace; return the trace second at which the Mooncake half starts."""
    az = read_trace(traces / AZURE_CONV).window(limit=azure_rows)
    mc = read_trace(traces / MOONCAKE_CONV).window(start=600.0, limit=mooncake_rows)
    assert mc.hash_ids is not None
    second = float(az.arrivals[-1]) + gap_s
    with out.open("w") as f:
        for i, (t, p, o) in enumerate(zip(az.arrivals.tolist(), az.prompt_tokens.tolist(), az.output_tokens.tolist(),
                                          strict=True)):
            ids = [FRESH_IDS + 64 * i + b for b in range(-(-p // 512))]
            f.write(json.dumps({"timestamp": round(1000 * t), "input_length": p, "output_length": o,
                                "hash_ids": ids}) + "\n")
        for t, p, o, h in zip(mc.arrivals.tolist(), mc.prompt_tokens.tolist(), mc.output_tokens.tolist(), mc.hash_ids,
                              strict=True):
            f.write(json.dumps({"timestamp": round(1000 * (second + t)), "input_length": p, "output_length": o,
                                "hash_ids": list(h)}) + "\n")
    return second


def config_text(args: argparse.Namespace, advisor: bool) -> str:
    text = '[prefix]\nsource = "precise"\n[admission]\nenabled = false\n'
    if advisor:
        candidates = ", ".join(f'"routing:{c}"' for c in CANDIDATES)
        text += (f"[advisor]\nenabled = true\nperiod_s = {args.period_s}\nwindow_s = {args.window_s}\n"
                 f"candidates = [{candidates}]\n")
    return text


def live_run(args: argparse.Namespace, trace: Path, profile_file: Path, policy: str, home: Path,
             total: int, advisor: bool) -> dict[str, Any]:
    """One replay of the file through a fresh emulated cluster under `policy`: its request rows and advice events."""
    home.mkdir(parents=True, exist_ok=True)
    port, token = free_port(), secrets.token_hex(16)
    env = console_env(home, token)
    (home / "console.toml").write_text(config_text(args, advisor))
    cmd = [str(home / "console.toml"), "--prefill", str(args.prefill), "--decode", str(args.decode),
           "--profile", str(profile_file), "--policy", policy, "--replay", str(trace),
           "--replay-speed", str(args.speed), "--replay-hash-block-tokens", str(args.hash_block_tokens)]
    t0, cpu = time.monotonic(), None
    console = start_console(port, cmd, env)
    url, headers = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {token}"}
    server0, s0 = process_cpu_s(console.pid), time.monotonic()
    try:
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            state = httpx.get(url + "/control/state", headers=headers, timeout=10).json()
            replay = state.get("replay") or {}
            if replay.get("status") == "done" or (replay.get("done") or 0) + (replay.get("failed") or 0) >= total:
                break
            time.sleep(2.0)
        time.sleep(args.period_s + 2 if advisor else 0.5)  # the last advice
        server_cpu, served_s = process_cpu_s(console.pid) - server0, time.monotonic() - s0
        run_id = state["run_id"]
        answer = httpx.get(url + "/control/advice", headers=headers, timeout=10).json() if advisor else {}
        cpu = answer.get("cpu_s") if isinstance(answer, dict) else None
    finally:
        stop(console, 60)
    store = RunStore(home / "runs.db")
    return {"policy": policy, "rows": store.requests(run_id), "advice": store.advisor_events(run_id, "advice"),
            "wall_s": time.monotonic() - t0, "advisor_cpu_s": cpu, "server_cpu_s": server_cpu, "served_s": served_s}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (not its children: the emulators and the advisor's worker)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def half_starts(rows: list[dict[str, Any]], gap_s: float) -> tuple[float, float]:
    """Console-clock arrival of each half's first request (the Mooncake half begins after the largest gap)."""
    arrivals = np.sort([r["arrival"] for r in rows if r.get("arrival") is not None])
    gaps = np.diff(arrivals)
    k = int(np.argmax(gaps))
    if gaps[k] < 0.5 * gap_s:
        raise RuntimeError(f"no gap of {gap_s:g} s found between the halves (largest {gaps[k]:.1f} s)")
    return float(arrivals[0]), float(arrivals[k + 1])


def p99_ttft(rows: list[dict[str, Any]], start: float, end: float) -> float | None:
    ttft = [r["ttft"] for r in rows if start <= r["arrival"] <= end and r["status"] == "ok" and r["ttft"] is not None]
    return float(np.percentile(ttft, 99)) if ttft else None


def order_agrees(advised: list[str], live: dict[str, float | None], tie: float) -> bool:
    """Whether the live P99s keep the advised order, two within `tie` of each other counting as a tie."""
    return all(
        (live[p] or np.inf) <= (live[q] or np.inf) * (1 + tie) for i, p in enumerate(advised) for q in advised[i + 1:]
    )


def judge(args: argparse.Namespace, runs: dict[str, dict[str, Any]], bare: dict[str, Any]) -> list[dict[str, Any]]:
    """Per half: the advice against the live runs. The order is judged on runs alike, none with the advisor: the
    candidates' and the active policy's second run (`bare`); the active run's own figure (the advisor's worker
    shares this machine's two cores with the emulators and the gateway) is reported beside it."""
    active = runs[args.active]
    starts = {p: half_starts(r["rows"], args.gap_s / args.speed) for p, r in runs.items()}
    bare_starts = half_starts(bare["rows"], args.gap_s / args.speed)
    a0, a1 = starts[args.active]
    out = []
    for half, (lo, hi) in enumerate(((a0, a1), (a1, float("inf")))):
        inside = [e for e in active["advice"] if e["data"]["window"]["start"] >= lo
                  and e["data"]["window"]["end"] < hi and not e["data"]["window"]["swapped"]]
        if not inside:
            out.append({"half": half, "error": "no advice window lies within this half"})
            continue
        advice = inside[-1]["data"]
        w0, w1 = advice["window"]["start"] - lo, advice["window"]["end"] - lo  # relative to the half's start
        predicted = {r["routing"]["name"]: r["predicted"]["ttft_p99"] for r in advice["ranked"]}
        observed = {p: p99_ttft(runs[p]["rows"], starts[p][half] + w0, starts[p][half] + w1) for p in CANDIDATES}
        alike = {**observed, args.active: p99_ttft(bare["rows"], bare_starts[half] + w0, bare_starts[half] + w1)}
        live_order = sorted(CANDIDATES, key=lambda p: alike[p] or np.inf)
        advised = sorted(CANDIDATES, key=lambda p: predicted.get(p) or np.inf)
        agree = order_agrees(advised, alike, args.tie)
        own = advice["observed"]["ttft_p99"]  # over the window's requests finished by its end, as the advisor saw them
        pred = advice["predicted_active"]["ttft_p99"]
        every = observed[args.active]  # over every request that arrived in the window (the complete run)
        out.append({
            "half": half, "trace": "azure" if half == 0 else "mooncake", "window_s": [w0, w1],
            "requests": advice["window"]["requests"], "predicted": predicted, "observed": observed,
            "active_without_advisor": alike[args.active],
            "order_agrees_with_active_run": order_agrees(advised, observed, args.tie),  # its own figure there
            "advised_order": advised, "live_order": live_order, "order_agrees": agree,
            "active_predicted": pred, "active_observed": own,
            "active_error": None if not pred or not own else abs(pred - own) / own,
            "within_25pct": bool(pred and own and abs(pred - own) / own <= 0.25),
            "active_error_all_arrivals": None if not pred or not every else abs(pred - every) / every,
            "job_cpu_s": advice.get("job_cpu_s"), "job_wall_s": advice.get("wall_s"),
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_traces_option(ap)
    ap.add_argument("--azure-rows", type=int, default=600)
    ap.add_argument("--mooncake-rows", type=int, default=400)
    ap.add_argument("--gap-s", type=float, default=20.0, help="trace seconds between the halves")
    ap.add_argument("--speed", type=float, default=2.0)
    ap.add_argument("--hash-block-tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--profile", default="roofline-h100-llama3-8b")
    ap.add_argument("--slowdown", type=float, default=4.0)
    ap.add_argument("--active", default="least_load", choices=CANDIDATES)
    ap.add_argument("--period-s", type=float, default=10.0)
    ap.add_argument("--window-s", type=float, default=40.0)
    ap.add_argument("--tie", type=float, default=0.05, help="live P99s within this share of each other are a tie")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per replay")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    profile = slowed(get_profile(args.profile), args.slowdown).model_copy(update={"max_model_len": 131_072})
    with tempfile.TemporaryDirectory(prefix="sibyl-advisor-live-") as tmp:
        trace, profile_file = Path(tmp) / "two_halves.jsonl", Path(tmp) / "profile.json"
        save_profile_file(profile, profile_file)
        two_halves(traces_dir(args.traces), args.azure_rows, args.mooncake_rows, args.gap_s, trace)
        total = args.azure_rows + args.mooncake_rows
        order = [args.active, *[p for p in CANDIDATES if p != args.active]]
        runs = {p: live_run(args, trace, profile_file, p, Path(tmp) / p, total, p == args.active) for p in order}
        bare = live_run(args, trace, profile_file, args.active, Path(tmp) / "no-advisor", total, False)
    halves = judge(args, runs, bare)
    with_advisor = runs[args.active]
    server = {
        "with_advisor_share": with_advisor["server_cpu_s"] / with_advisor["served_s"],
        "without_advisor_share": bare["server_cpu_s"] / bare["served_s"],
        "advisor_process_cpu_s": with_advisor["advisor_cpu_s"], "served_s": with_advisor["served_s"],
    }
    if args.json:
        print(json.dumps({"halves": halves, "wall_s": {p: r["wall_s"] for p, r in runs.items()}, "server": server},
                         indent=2))
        return
    print(f"{args.azure_rows} Azure + {args.mooncake_rows} Mooncake rows at speed {args.speed:g}, "
          f"{args.prefill}P{args.decode}D {profile.name}, active {args.active}, window {args.window_s:g} s")
    print(f"{'half':<9} {'policy':<13} {'pred p99 s':>10} {'live p99 s':>10} {'pred/live':>9}")
    for h in halves:
        if "error" in h:
            print(f"{h['half']:<9} {h['error']}")
            continue
        for p in CANDIDATES:
            pr, ob = h["predicted"].get(p), h["observed"][p]
            ratio = f"{pr / ob:.2f}" if pr and ob else "-"
            print(f"{h['trace']:<9} {p:<13} {pr or float('nan'):>10.3f} {ob or float('nan'):>10.3f} {ratio:>9}")
        bare_p99 = h["active_without_advisor"]
        print(f"{h['trace']:<9} {args.active + ' again, without the advisor':<40} {bare_p99 or float('nan'):>10.3f} "
              "(the order is judged on this run and the candidates', none with the advisor)")
        print(f"{h['trace']}: advised order {' < '.join(h['advised_order'])}; live {' < '.join(h['live_order'])}; "
              f"agrees (ties within {args.tie:.0%}): {'yes' if h['order_agrees'] else 'NO'} (with the advised run's "
              f"own {args.active}: {'yes' if h['order_agrees_with_active_run'] else 'NO'}); active predicted "
              f"{h['active_predicted']:.3f} s vs observed {h['active_observed']:.3f} s over the {h['requests']} "
              f"requests finished by the window's end (error {h['active_error']:.0%}, within 25%: "
              f"{'yes' if h['within_25pct'] else 'NO'}); vs {h['observed'][args.active]:.3f} s over every arrival "
              f"in it (error {h['active_error_all_arrivals']:.0%})")
    for p, r in runs.items():
        print(f"{p}: replay wall {r['wall_s']:.0f} s")
    print(f"console server process ({args.active}): {server['with_advisor_share']:.1%} of a core with the advisor, "
          f"{server['without_advisor_share']:.1%} without (added "
          f"{server['with_advisor_share'] - server['without_advisor_share']:+.1%}); the advisor's own process "
          f"{server['advisor_process_cpu_s'] or 0:.1f} CPU s over {server['served_s']:.0f} s")


if __name__ == "__main__":
    main()

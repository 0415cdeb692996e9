"""Does the live cluster agree with the simulator on prefix routing? A Mooncake slice, live and simulated.

Replays the first --limit rows of Mooncake's conversation trace (its prefix structure kept: each
512-token hash block replayed as --hash-block-tokens tokens, prompts scaled alike) at --speed against
an emulated cluster (a console started here with `[prefix] source = "precise"`: routing reads the
emulators' KV events) under each policy, and simulates the same requests (the replayer's own prompt
lengths, outputs and prompt seed, so the same block keys) with the same profile in iteration mode
and the simulator's exact caches. Prints, per policy, each prefill instance's prefix hit rate (live:
the emulator's own `vllm:prefix_cache_hits_total` / `queries_total` over the replay; sim: cached /
prompt tokens of the requests it prefilled) and TTFT p50/p99 (live: client-side, from the replay's
run; sim: the simulator's), side by side.

As in live_vs_sim.py, every time of the profile is multiplied by --slowdown so the emulators, the
gateway and the client fit this 2-core machine with the prefill instances busy enough for routing to
matter.

Usage: python -m benchmarks.live_vs_sim_prefix [--limit 600] [--speed 3] [--prefill 4 --decode 2] [--policy ...]
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from adapters.ports import free_port
from adapters.store import RunStore
from benchmarks.harness import console_env, start_console, stop
from benchmarks.live_vs_sim import console_args, parse_policy, replay, slowed
from benchmarks.paths import add_traces_option, traces_dir
from console.offline.replay import Replayer
from console.offline.simulate import SimPlan, run_one
from core.perf import get_profile, save_profile_file
from core.sim.cluster import CacheParams
from core.slo import SLOClass
from core.traces import Trace, read_trace

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE_CONV = Path("mooncake_fast25") / "conversation_trace.jsonl"
PROMPT_SEED = 20261127
"""One prompt seed for every live replay and the simulation: the same block keys everywhere."""


def _counter(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _cache_counters(urls: dict[str, str]) -> dict[str, tuple[float, float]]:
    out = {}
    for iid, url in urls.items():
        text = httpx.get(url + "/metrics", timeout=10).text
        out[iid] = (_counter(text, "vllm:prefix_cache_hits_total"), _counter(text, "vllm:prefix_cache_queries_total"))
    return out


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def live(args: argparse.Namespace, profile_file: Path, policy: str, home: Path) -> dict[str, Any]:
    """One replay of the slice through a fresh emulated cluster under `policy`."""
    port = free_port()
    token = secrets.token_hex(16)
    env = console_env(home, token)
    config = home / "console.toml"
    home.mkdir(parents=True, exist_ok=True)
    # the engines' speed is what is compared: no SLO admission (it would shed at the queueing knee)
    config.write_text('[prefix]\nsource = "precise"\n[admission]\nenabled = false\n')
    console = start_console(port, [str(config), *console_args(args, profile_file, policy)], env)
    url = f"http://127.0.0.1:{port}"
    try:
        state = httpx.get(url + "/control/state", headers={"Authorization": f"Bearer {token}"}, timeout=10).json()
        prefill = {i["id"]: i["url"] for i in state["instances"] if i["role"] == "prefill"}
        before = _cache_counters(prefill)
        seeds = ["--hash-block-tokens", str(args.hash_block_tokens), "--prompt-seed", str(PROMPT_SEED)]
        run_id = replay(args, url, env, *seeds)
        after = _cache_counters(prefill)
        rows = [r for r in RunStore(home / "runs.db").requests(run_id) if r["status"] == "ok" and r["ttft"] is not None]
        ttft = [r["ttft"] for r in rows]
        hits = {i: (after[i][0] - before[i][0]) / max(1.0, after[i][1] - before[i][1]) for i in prefill}
        hit_all = sum(after[i][0] - before[i][0] for i in prefill) / max(
            1.0, sum(after[i][1] - before[i][1] for i in prefill)
        )
        return {
            "ttft_p50": _pct(ttft, 50),
            "ttft_p99": _pct(ttft, 99),
            "hit": hits,
            "hit_all": hit_all,
            "ok": len(rows),
        }
    finally:
        stop(console, 60)


def replay_plan(
    args: argparse.Namespace, trace: Trace, profile: Any, policy: str, prompt_seed: int = PROMPT_SEED
) -> SimPlan:
    """The simulator's plan of a live replay of `trace` as a benchmark's `args` set it up (`prefill`,
    `decode`, `speed`, `hash_block_tokens`): the replayer's own prompt lengths, outputs and prompt seed
    (so the same block keys), its arrivals at that speed, the exact caches, iteration mode."""
    hash_block_tokens, speed = args.hash_block_tokens, args.speed
    rep = Replayer.from_trace(
        trace,
        "http://127.0.0.1:1",
        hash_block_tokens=hash_block_tokens,
        speed=speed,
        max_context=profile.max_model_len,
        prompt_seed=prompt_seed,
    )
    sent = [rep.request_prompt(i) for i in range(len(trace))]
    return SimPlan(
        arrivals=(np.asarray(trace.arrivals) - trace.arrivals[0]) / speed,
        prompt_tokens=np.array([len(p) for p, _ in sent], dtype=np.int64),
        output_tokens=np.array([o for _, o in sent], dtype=np.int64),
        workload=trace.source or "replay",
        profile=profile,
        n_prefill=args.prefill,
        n_decode=args.decode,
        mode="iteration",
        policies=[parse_policy(policy)],
        slo=SLOClass(),
        shadow=False,
        hash_ids=trace.hash_ids,
        sessions=[str(s) for s in trace.session.tolist()] if trace.session is not None else None,
        cache=CacheParams(hash_block_tokens=hash_block_tokens, prompt_seed=prompt_seed),
        prefix_source="precise",
    )


def simulated(args: argparse.Namespace, trace: Trace, profile: Any, policy: str) -> dict[str, Any]:
    """The same requests through the simulator: the replayer's own prompt lengths, outputs and seed."""
    plan = replay_plan(args, trace, profile, policy)
    metrics, result = run_one(plan, *parse_policy(policy))
    hits = {}
    for k, iid in enumerate(result.prefill_ids):
        mine = result.prefill_instance == k
        hits[iid] = float(result.cached_tokens[mine].sum() / max(1, result.prompt_tokens[mine].sum()))
    hit_all = float(result.cached_tokens.sum() / max(1, result.prompt_tokens.sum()))
    return {"ttft_p50": metrics["ttft_p50"], "ttft_p99": metrics["ttft_p99"], "hit": hits, "hit_all": hit_all}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=None, help=f"default: TRACES/{MOONCAKE_CONV}")
    add_traces_option(ap)
    ap.add_argument("--limit", type=int, default=600)
    ap.add_argument("--speed", type=float, default=3.0, help="replay speed (the trace's own pace is ~3 req/s)")
    ap.add_argument("--hash-block-tokens", type=int, default=64, help="tokens per 512-token hash block")
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--profile", default="roofline-h100-llama3-8b")
    ap.add_argument("--slowdown", type=float, default=4.0)
    ap.add_argument("--policy", action="append", help="NAME or NAME:key=value,... (default: least_load, prefix_aware)")
    args = ap.parse_args()
    if args.trace is None:
        args.trace = traces_dir(args.traces) / MOONCAKE_CONV
    policies = args.policy or ["least_load", "prefix_aware"]
    profile = slowed(get_profile(args.profile), args.slowdown)
    trace = read_trace(args.trace).window(limit=args.limit).with_sessions()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sibyl-live-vs-sim-prefix-") as tmp:
        profile_file = Path(tmp) / "profile.json"
        save_profile_file(profile, profile_file)
        for k, p in enumerate(policies):
            sim = simulated(args, trace, profile, p)
            got = live(args, profile_file, p, Path(tmp) / f"run{k}")
            rows.append((p, got, sim))
            print(
                f"{p}: live TTFT p50/p99 {got['ttft_p50']:.2f}/{got['ttft_p99']:.2f} s, hit {got['hit_all']:.1%}; "
                f"sim {sim['ttft_p50']:.2f}/{sim['ttft_p99']:.2f} s, hit {sim['hit_all']:.1%}",
                file=sys.stderr,
            )
    print(
        f"{args.trace.name}, first {args.limit} rows at speed {args.speed:g} ({args.hash_block_tokens} tokens per hash "
        f"block), {args.prefill}P{args.decode}D, {profile.name}, precise index"
    )
    print("| policy | side | hit (all prefill) | hit per prefill instance | TTFT p50 s | TTFT p99 s |")
    print("|---|---|---:|---|---:|---:|")
    for p, got, sim in rows:
        for side, r in (("live", got), ("sim", sim)):
            per = ", ".join(f"{i} {h:.1%}" for i, h in sorted(r["hit"].items()))
            print(f"| {p} | {side} | {r['hit_all']:.1%} | {per} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} |")
    if len(rows) > 1:
        (p0, l0, s0), (p1, l1, s1) = rows[0], rows[1]
        for m in ("ttft_p50", "ttft_p99"):
            print(f"{p1} vs {p0}, {m}: live {l1[m] / l0[m] - 1:+.0%}, sim {s1[m] / s0[m] - 1:+.0%}")


if __name__ == "__main__":
    main()

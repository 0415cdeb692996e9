"""Scaling the gateway past one process (issue 18): K gateway shards routing one cluster.

The design evaluated (docs/architecture.md, "Scaling the gateway"): requests are sharded by a
hash of their id over K gateway processes. Each shard has its own Dispatcher (its own request
table and estimators) and sees its own requests in real time. It sees the other shards' requests
only through a state exchange every Δ seconds: a snapshot of their in-flight rows (decode and
prefill instance, state, prompt, progress, projected handoff), their remaining prefill backlog per
instance, and the output lengths (and decode times) of what they finished since the last exchange,
which feed its survival and decode-rate estimators.

How it is simulated: the core simulator (core.sim.cluster.ClusterSimulation: cluster model,
arrival process, decode models) is reused unchanged. It drives a `ShardedDispatcher`, which offers
the dispatcher calls the simulator makes (core.sim.cluster.SimDispatcher) and hands every event of a request
to the real Dispatcher of the shard that owns it. Each shard's routing policy is wrapped (`ShardRouting`) so that
every decision reads the shard's own view merged with the others' rows as of the last exchange. The exchange
runs at the first dispatcher call at or after each multiple of Δ. A dispatcher's state changes
only when it is called, so that is its state as of the boundary. Δ = 0 exchanges before every call.

Measured per (policy, K, Δ): P99 and mean TPOT, P99 TTFT, SLO attainment, the optimal-assignment
ratio against the true global load at each handoff, the view error (how far a deciding shard's
decode load vector is from the truth), the wall time per routing decision, and the exchange's
rows and bytes. `--rtt` also measures a localhost HTTP round trip (httpx client in this process,
uvicorn server in a child process) as the extra latency per request of the alternative design:
one decision service that every gateway process asks.

`--push-latency S` adds a variant: every routing decision also reaches the other shards S seconds
after it is taken (until the next snapshot supersedes it).

Usage (figures in benchmarks/README.md, "Scaling the gateway past one process"):
  python -m benchmarks.gateway_shards --seeds 7,8,9                 # 3 policies × K × Δ, + RTT
  python -m benchmarks.gateway_shards --seeds 7,8,9 --policies sibyl,least_load \\
      --push-latency 0.0005 --no-rtt                                # the push variant
  python -m benchmarks.gateway_shards --requests 1500 --shards 1,4 --deltas 0.5 --no-rtt
  python -m benchmarks.gateway_shards --rtt-only --rtt 5000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import md_header, md_row, ms
from benchmarks.shard_exchange import EXCHANGE_ROW, shard_of
from benchmarks.sharded_dispatcher import ShardedDispatcher
from console.offline.sweep import traffic
from console.offline.sweep_config import WorkloadRef
from core.dispatch import Dispatcher
from core.perf import PerfProfile, get_profile
from core.sim.cluster import ClusterSimResult, ClusterSimulation, Mode
from core.slo import SLOClass, summarize
from core.traces import Trace

__all__ = [
    "Setting",
    "ShardedDispatcher",
    "dispatcher_factory",
    "main",
    "make_trace",
    "run_point",
    "shard_of",
    "simulate",
]


# --- one simulated run --------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    workload: str = "reasoning-chat"
    mode: Mode = "ps"
    n_prefill: int = 4
    n_decode: int = 16
    load: float = 0.9
    burstiness: float = 0.2
    requests: int = 6000
    profile: str = "h20-qwen3-32b"

    @property
    def label(self) -> str:
        arrivals = "Poisson" if self.burstiness == 1.0 else f"bursty (gamma shape {self.burstiness:g})"
        return (
            f"{self.workload}, {self.mode}, {self.n_prefill}P{self.n_decode}D, load {self.load:g} "
            f"of decode saturation, {arrivals} arrivals, {self.requests} requests, {self.profile}"
        )


POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "sibyl": ("sibyl", {}),
    "least_load": ("least_load", {}),
    "round_robin": ("round_robin", {}),
}


def make_trace(setting: Setting, seed: int, profile: PerfProfile) -> Trace:
    return traffic(
        WorkloadRef(setting.workload),
        requests=setting.requests,
        seed=seed,
        rate=None,
        load=setting.load,
        burstiness=setting.burstiness,
        n_decode=setting.n_decode,
        profile=profile,
    )


def dispatcher_factory(
    profile: PerfProfile, name: str, params: dict[str, Any], trace: Trace
) -> Callable[[], Dispatcher]:
    """Dispatchers built as `sim` builds them (console.offline.simulate.run_one without shadows)."""
    prior = int(trace.output_tokens.max()) if len(trace.output_tokens) else None

    def make() -> Dispatcher:
        return Dispatcher(
            profile,
            name,
            params,
            true_lengths=True,
            survival_prior_max=prior,
            slo={"default": SLOClass()},
        )

    return make


def simulate(
    trace: Trace,
    profile: PerfProfile,
    setting: Setting,
    gateway: ShardedDispatcher | Dispatcher,
) -> ClusterSimResult:
    """Run the core simulator on `trace` with `gateway` (K shards, or a plain Dispatcher)."""
    sim = ClusterSimulation(
        arrivals=trace.arrivals,
        prompt_tokens=trace.prompt_tokens,
        output_tokens=trace.output_tokens,
        profile=profile,
        n_prefill=setting.n_prefill,
        n_decode=setting.n_decode,
        dispatcher=gateway,
        mode=setting.mode,
    )
    return sim.run()


def run_point(
    setting: Setting,
    trace: Trace,
    profile: PerfProfile,
    label: str,
    k: int,
    delta: float,
    seed: int,
    push_latency: float | None = None,
) -> dict[str, Any]:
    name, params = POLICIES[label]
    gw = ShardedDispatcher(k, delta, dispatcher_factory(profile, name, params, trace), push_latency=push_latency)
    t0 = time.perf_counter()
    result = simulate(trace, profile, setting, gw)
    wall = time.perf_counter() - t0
    m = summarize(
        arrival=result.arrival,
        first_token=result.first_token,
        finish=result.finish,
        output_tokens=result.output_tokens,
        ok=result.ok,
        slo=SLOClass(),
    )
    dec = np.asarray(gw.decision_s) * 1e6
    rows = np.asarray(gw.exchange_rows, dtype=float)
    sent = np.asarray(gw.exchange_bytes, dtype=float)
    return {
        "policy": label if push_latency is None or k == 1 else f"{label}+push",
        "push_latency": push_latency,
        "pushes": gw.pushes,
        "push_bytes_per_request": EXCHANGE_ROW.itemsize * (k - 1) if push_latency is not None else 0,
        "k": k,
        "delta": None if k == 1 else delta,
        "seed": seed,
        "requests": setting.requests,
        "tpot_p99": m["tpot_p99"],
        "tpot_mean": m["tpot_mean"],
        "ttft_p99": m["ttft_p99"],
        "slo_attainment": m["slo_attainment"],
        "completed": m["completed"],
        "failed": m["failed"],
        "assignment_ratio": result.assignment_ratio,
        "view_error": float(np.mean(gw.view_errors)) if gw.view_errors else 0.0,
        "decision_us_mean": float(dec.mean()) if len(dec) else None,
        "decision_us_p99": float(np.percentile(dec, 99)) if len(dec) else None,
        "merge_us_mean": gw.merge_s * 1e6 / len(dec) if len(dec) else None,
        "exchanges": gw.exchanges,
        "rows_per_exchange": float(rows.mean()) if len(rows) else 0.0,
        "rows_per_exchange_max": int(rows.max()) if len(rows) else 0,
        "bytes_per_exchange": float(sent.mean()) if len(sent) else 0.0,
        # an exchange goes out every Δ (the simulation skips those with no event in between)
        "bytes_per_s": float(sent.mean()) / delta if len(sent) and delta > 0 else None,
        "sim_wall_s": wall,
    }


# --- the alternative: one decision service ------------------------------------------------------

_SERVER = r"""
import sys, uvicorn
BODY = b'{"prefill": "p0", "decode": "d13", "projected_handoff": 1234.567}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
async def app(scope, receive, send):
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", lifespan="off",
            access_log=False)
"""


def measure_rtt(n: int = 3000, warmup: int = 300) -> dict[str, float]:
    """One routing request to a decision service and its answer over localhost HTTP/1.1 with
    keep-alive: httpx client here, a minimal uvicorn ASGI server in a child process."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)])
    try:
        body = json.dumps(
            {
                "request_id": "chatcmpl-5f0c3a9e6d2b4c1f",
                "prompt_tokens": 812,
                "max_tokens": 8192,
                "slo_class": "default",
                "tenant": "",
            }
        ).encode()
        headers = {"content-type": "application/json"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as client:
            deadline = time.monotonic() + 20
            while True:
                try:
                    client.post("/route", content=body, headers=headers)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            samples = []
            for i in range(warmup + n):
                t0 = time.perf_counter()
                r = client.post("/route", content=body, headers=headers)
                r.read()
                dt = time.perf_counter() - t0
                if i >= warmup:
                    samples.append(dt)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    us = np.asarray(samples) * 1e6
    return {
        "n": float(n),
        "mean_us": float(us.mean()),
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
    }


# --- report ---------------------------------------------------------------------------------------


def aggregate(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean over seeds per (policy, K, Δ), with the min and max P99 TPOT."""
    groups: dict[tuple[str, int, float | None], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["k"], r["delta"]), []).append(r)
    out = []
    for (policy, k, delta), rs in groups.items():
        agg: dict[str, Any] = {"policy": policy, "k": k, "delta": delta, "seeds": len(rs)}
        for key in (
            "tpot_p99", "tpot_mean", "ttft_p99", "slo_attainment", "assignment_ratio", "view_error",
            "decision_us_mean", "decision_us_p99", "merge_us_mean", "rows_per_exchange", "bytes_per_exchange",
            "bytes_per_s", "sim_wall_s", "failed",
        ):  # fmt: skip
            vals = [r[key] for r in rs if r.get(key) is not None]
            agg[key] = statistics.fmean(vals) if vals else None
        p99 = [r["tpot_p99"] for r in rs]
        agg["tpot_p99_min"], agg["tpot_p99_max"] = min(p99), max(p99)
        out.append(agg)
    return out


def markdown(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> str:
    agg = aggregate(rows)
    base = {a["policy"]: a["tpot_p99"] for a in agg if a["k"] == 1}
    multi = any(a["seeds"] > 1 for a in agg)
    columns = [
        "policy", "K", "Δ s", "P99 TPOT ms" + (" (min–max)" if multi else ""), "vs K=1",
        "mean TPOT ms", "P99 TTFT s", "SLO att.", "opt. ratio", "view err.", "decision µs (merge)",
        "rows/exch.", "KB/exch.", "KB/s",
    ]  # fmt: skip
    lines = md_header(columns, "l" + "r" * (len(columns) - 1))
    order = {p: i for i, p in enumerate(policies)}
    agg.sort(key=lambda a: (order.get(a["policy"].removesuffix("+push"), 99), a["k"], a["delta"] or 0.0))
    for a in agg:
        p99 = ms(a["tpot_p99"])
        if multi:
            p99 += f" ({ms(a['tpot_p99_min'])}–{ms(a['tpot_p99_max'])})"
        b = base.get(a["policy"].removesuffix("+push"))
        vs = "-" if a["k"] == 1 or not b else f"{a['tpot_p99'] / b - 1:+.1%}"
        many = a["k"] > 1
        decision = f"{a['decision_us_mean']:.0f}"
        if many:
            decision += f" ({a['merge_us_mean']:.0f})"
        delta = "-" if a["delta"] is None else f"{a['delta']:g}"
        rows_x = f"{a['rows_per_exchange']:.0f}" if many else "-"
        kb = f"{a['bytes_per_exchange'] / 1e3:.1f}" if many else "-"
        kbs = f"{a['bytes_per_s'] / 1e3:.1f}" if many and a["bytes_per_s"] is not None else "-"
        lines.append(
            md_row(
                [
                    a["policy"],
                    a["k"],
                    delta,
                    p99,
                    vs,
                    ms(a["tpot_mean"]),
                    f"{a['ttft_p99']:.2f}",
                    f"{a['slo_attainment']:.1%}",
                    f"{a['assignment_ratio']:.3f}",
                    f"{a['view_error']:.3f}",
                    decision,
                    rows_x,
                    kb,
                    kbs,
                ]
            )  # fmt: skip
        )
    return "\n".join(lines) + "\n"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--seeds", default="7", help="comma-separated trace seeds (metrics are averaged)")
    ap.add_argument("--shards", default="1,2,4,8", help="K values (1 = the single gateway)")
    ap.add_argument("--deltas", default="0.05,0.5,2,10", help="exchange periods Δ in seconds")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workload", default="reasoning-chat")
    ap.add_argument("--mode", choices=["ps", "iteration"], default="ps")
    ap.add_argument("--cluster", default="4P16D")
    ap.add_argument("--load", type=float, default=0.9)
    ap.add_argument("--burstiness", type=float, default=0.2)
    ap.add_argument("--profile", default="h20-qwen3-32b")
    ap.add_argument("--out", type=Path, default=None, help="also write every run as JSON here")
    ap.add_argument("--rtt", type=int, default=3000, help="round trips to time (0: skip)")
    ap.add_argument("--no-rtt", action="store_true")
    ap.add_argument("--rtt-only", action="store_true")
    ap.add_argument(
        "--push-latency",
        type=float,
        default=None,
        help="the push variant: every routing decision also reaches the other shards this many "
        "seconds after it is taken (runs labelled POLICY+push; K=1 is run as the baseline)",
    )
    args = ap.parse_args(argv)
    p_str, d_str = args.cluster.upper().rstrip("D").split("P")
    setting = Setting(
        workload=args.workload, mode=args.mode, n_prefill=int(p_str), n_decode=int(d_str), load=args.load,
        burstiness=args.burstiness, requests=args.requests, profile=args.profile,
    )  # fmt: skip
    rtt = None
    if args.rtt and not args.no_rtt:
        rtt = measure_rtt(args.rtt)
        print(
            f"localhost HTTP round trip (httpx → uvicorn, keep-alive, {int(rtt['n'])} requests): "
            f"mean {rtt['mean_us']:.0f} µs, p50 {rtt['p50_us']:.0f} µs, p99 {rtt['p99_us']:.0f} µs",
            flush=True,
        )
    if args.rtt_only:
        return
    profile = get_profile(setting.profile)
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"unknown policy {p!r}; choose from {sorted(POLICIES)}")
    shards, deltas = _ints(args.shards), _floats(args.deltas)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    print(f"setting: {setting.label}", file=sys.stderr, flush=True)
    for seed in _ints(args.seeds):
        trace = make_trace(setting, seed, profile)
        for label in policies:
            for k in shards:
                for delta in deltas if k > 1 else deltas[:1]:
                    push = args.push_latency if k > 1 else None
                    row = run_point(setting, trace, profile, label, k, delta, seed, push)
                    rows.append(row)
                    print(
                        f"seed {seed} {row['policy']} K={k} Δ={'-' if k == 1 else format(delta, 'g')}: P99 TPOT "
                        f"{ms(row['tpot_p99'])} ms, mean {ms(row['tpot_mean'])} ms, TTFT P99 "
                        f"{row['ttft_p99']:.2f} s ({row['sim_wall_s']:.1f} s; "
                        f"{time.perf_counter() - started:.0f} s elapsed)",
                        file=sys.stderr,
                        flush=True,
                    )
    print(f"\n{setting.label}; seeds {args.seeds}\n")
    print(markdown(rows, policies))
    if args.out is not None:
        args.out.write_text(json.dumps({"setting": dataclasses.asdict(setting), "rtt": rtt, "runs": rows}, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

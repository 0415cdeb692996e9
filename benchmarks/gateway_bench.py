"""The gateway's own cost against zero-latency upstreams, side by side with vLLM's toy P/D proxy.

Starts two of `shared/tools/fake_upstream.py` (a prefill and a decode stand-in that answer
instantly), our gateway (`sibyl-console up --headless --attach ...`) and, with `--toy-proxy`,
vLLM's `toy_proxy_server.py` (FastAPI + httpx; not shipped here: pass its path and a Python that
has fastapi), then drives each with `shared/tools/loadgen.py` (streaming /v1/completions, 16
tokens, P/D two legs) loaded and unloaded, in this one process, and prints one table. Our gateway
runs twice: over 1P1D (SIBYL has one decode candidate, so it scores nothing) and over 1P2D (a
second decode fake, so every decision runs SIBYL's whole load projection).
Targets: >= 35% of the req/s of hitting the decode fake directly (one leg, issue 12), <= 1 ms
gateway CPU per P/D request (issue 12), >= 5x the toy proxy's req/s, <= 2 ms added p50 unloaded.
Usage: python -m benchmarks.gateway_bench [--shared ../shared] [--toy-proxy PATH --toy-python PY]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from adapters.ports import free_port
from benchmarks.harness import run_loadgen, start, stop, wait_http

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared")
    ap.add_argument("--toy-proxy", type=Path, help="path of vLLM's toy_proxy_server.py")
    ap.add_argument("--toy-python", default=sys.executable, help="a Python with fastapi + httpx for the toy proxy")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument(
        "--repeat", type=int, default=1, help="load each gateway this many times, in turn; report the median"
    )
    ap.add_argument(
        "--decisions-off-too",
        action="store_true",
        help="also run each gateway with decision records off ([decisions] sample_rate = 0), loaded in turn "
        "with the default one (records on), to measure what the records cost",
    )
    args = ap.parse_args()
    tools = args.shared / "tools"
    pp, dp, dp2 = free_port(), free_port(), free_port()
    procs = [start([sys.executable, str(tools / "fake_upstream.py"), "--port", str(p)]) for p in (pp, dp, dp2)]
    try:
        for p in (pp, dp, dp2):
            wait_http(f"http://127.0.0.1:{p}/health")
        rows = []
        targets = []
        shapes = [("1P1D", f"http://127.0.0.1:{dp}"), ("1P2D", f"http://127.0.0.1:{dp},http://127.0.0.1:{dp2}")]
        records = (
            [("", ""), (" no records", "[decisions]\nsample_rate = 0.0\n")] if args.decisions_off_too else [("", "")]
        )
        for (label, decode), (suffix, extra) in ((s, r) for s in shapes for r in records):
            label += suffix
            home = tempfile.mkdtemp(prefix="sibyl-bench-")
            gport = free_port()
            env = {**os.environ, "SIBYL_HOME": home, "SIBYL_DB": f"{home}/runs.db"}
            # SLO admission on, as an operator runs it: it judges the instant fakes by what they measure, so
            # it refuses nothing they could serve (it had to be switched off here before issue 37)
            config = Path(home) / "bench.toml"
            config.write_text(extra)
            ours = start(
                [
                    sys.executable,
                    "-m",
                    "console.cli",
                    "up",
                    str(config),
                    "--headless",
                    "--port",
                    str(gport),
                    "--backend",
                    "vllm",
                    "--attach",
                    f"prefill=http://127.0.0.1:{pp};decode={decode}",
                    # SIBYL, as every earlier row of this benchmark: the default prefix_aware would key the
                    # fakes' text prompts, which have no prefix to reuse (benchmarks/tokenize_cost.py)
                    "--policy",
                    "sibyl",
                ],
                env,
            )
            procs.append(ours)
            wait_http(f"http://127.0.0.1:{gport}/health")
            targets.append((f"sibyl-console gateway {label}", f"http://127.0.0.1:{gport}", ours.pid))
        if args.toy_proxy:
            tport = free_port()
            toy = start(
                [
                    args.toy_python,
                    str(args.toy_proxy),
                    "--port",
                    str(tport),
                    "--prefiller-hosts",
                    "127.0.0.1",
                    "--prefiller-ports",
                    str(pp),
                    "--decoder-hosts",
                    "127.0.0.1",
                    "--decoder-ports",
                    str(dp),
                ]
            )
            procs.append(toy)
            wait_http(f"http://127.0.0.1:{tport}/healthcheck")
            targets.append(("vLLM toy_proxy_server.py", f"http://127.0.0.1:{tport}", toy.pid))
        direct = run_loadgen(tools / "loadgen.py", f"http://127.0.0.1:{dp}", procs[1].pid, 1, 500)
        direct_loaded = run_loadgen(tools / "loadgen.py", f"http://127.0.0.1:{dp}", procs[1].pid, 64, args.requests)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in targets}
        for _ in range(args.repeat):  # the targets in turn, so drift on a shared machine hits each alike
            for name, url, pid in targets:
                runs[name].append(run_loadgen(tools / "loadgen.py", url, pid, 64, args.requests))
        for name, url, pid in targets:
            loaded = sorted(runs[name], key=lambda r: r["req_per_s"])[len(runs[name]) // 2]  # the median run
            idle = run_loadgen(tools / "loadgen.py", url, pid, 1, 500)
            rows.append((name, loaded, idle))
        print(
            f"{'proxy':<42} {'req/s @64':>10} {'CPU ms/req':>11} {'p50 ms @64':>11} {'p50 ms @1':>10} "
            f"{'added p50 @1':>13} {'errors':>7}"
        )
        for name, loaded, idle in rows:
            proxy_cpu = (loaded.get("cpu_pct") or {}).get("proxy")
            cpu = proxy_cpu / 100 / loaded["req_per_s"] * 1000 if proxy_cpu is not None else float("nan")
            print(
                f"{name:<42} {loaded['req_per_s']:>10.0f} {cpu:>11.2f} {loaded['p50_ms']:>11.2f} "
                f"{idle['p50_ms']:>10.2f} {idle['p50_ms'] - direct['p50_ms']:>13.2f} "
                f"{loaded['errors'] + idle['errors']:>7}"
            )
        print(
            f"(direct to the decode fake, one leg: {direct_loaded['req_per_s']:.0f} req/s @64, "
            f"unloaded p50 {direct['p50_ms']:.2f} ms)"
        )
        for name, loaded, _ in rows:
            share = loaded["req_per_s"] / direct_loaded["req_per_s"]
            print(f"{name}: {share:.0%} of the decode fake's own req/s (two legs per request; target >= 35%)")
        if args.toy_proxy:
            print(
                "throughput ratio ours (1P1D) / toy proxy: "
                f"{rows[0][1]['req_per_s'] / rows[-1][1]['req_per_s']:.1f}x (target >= 5x)"
            )
    finally:
        for p in reversed(procs):
            stop(p)


if __name__ == "__main__":
    main()

"""Does the gateway regress? Two or more builds' gateways, alternated against the same fakes.

`gateway_bench.py` measures one build; on this shared two-core machine its figures drift by 20% from
one minute to the next, so a regression between builds is only seen side by side. This script
exports each `--rev` (a git revision, or `.` for the working tree) with `git archive` into a
temporary directory, starts one gateway per build (`sibyl-console up --headless --backend vllm
--attach ...`, `--policy` as given, SLO admission off where the build has it (`--admission-on` leaves
it on), no keys file, tracing off) over the same two of `shared/tools/fake_upstream.py`
(zero-latency prefill and decode), and loads them in turn with `shared/tools/loadgen.py`
(streaming /v1/completions, 16 tokens, 64 concurrent), `--rounds` times. It prints each build's
median req/s and gateway CPU per request (from /proc), and, per round, the ratio of each build's
CPU per request to the first build's: the machine's drift moves both builds of a round alike, so
the median ratio is the comparison.

Usage: python -m benchmarks.gateway_ab --rev a295d97 --rev . [--policy sibyl] [--rounds 8]
       [--admission-on] [--requests 3000] [--shared ../shared] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Any

from adapters.ports import free_port
from benchmarks.harness import console_env, run_loadgen, start, start_console, stop, wait_http

ROOT = Path(__file__).resolve().parents[1]


def export(rev: str, into: Path) -> Path:
    """The tree of `rev` (`.`: the working tree itself) as a directory."""
    if rev == ".":
        return ROOT
    out = into / rev.replace("/", "_")
    out.mkdir()
    blob = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(out, filter="data")
    return out


def start_gateway(
    tree: Path, policy: str, prefill: str, decode: str, home: Path, admission: bool = False
) -> tuple[subprocess.Popen[bytes], str]:
    """One build's gateway over the fakes, on a free port, with its own home and run store;
    `admission`: SLO admission left at the build's default (on) instead of off."""
    config = home / "bench.toml"
    # the same path in every build: SLO admission (where the build has it) would judge the fakes' zero latency
    has_admission = (tree / "console" / "live" / "admission.py").exists()
    config.write_text("[admission]\nenabled = false\n" if has_admission and not admission else "")
    port = free_port()
    env = {**console_env(home), "PYTHONPATH": str(tree)}
    args = [str(config), "--backend", "vllm", "--attach", f"prefill={prefill};decode={decode}"]
    if policy != "default":
        args += ["--policy", policy]
    return start_console(port, args, env, cwd=tree), f"http://127.0.0.1:{port}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    tools = args.shared / "tools"
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="sibyl-gateway-ab-") as tmp:
        try:
            fakes = []
            for _ in range(2):
                port = free_port()
                p = start([sys.executable, str(tools / "fake_upstream.py"), "--port", str(port)])
                procs.append(p)
                wait_http(f"http://127.0.0.1:{port}/health", 30, p)
                fakes.append(f"http://127.0.0.1:{port}")
            gateways = []
            for k, rev in enumerate(args.rev):
                home = Path(tmp) / f"home{k}"
                home.mkdir()
                tree = export(rev, Path(tmp))
                proc, url = start_gateway(tree, args.policy, fakes[0], fakes[1], home, args.admission_on)
                procs.append(proc)
                gateways.append((rev, url, proc.pid))
            runs: dict[str, list[tuple[float, float]]] = {rev: [] for rev in args.rev}
            for r in range(args.rounds):
                for rev, url, pid in gateways:
                    x = run_loadgen(tools / "loadgen.py", url, pid, 64, args.requests)
                    if x["errors"]:
                        raise RuntimeError(f"{rev}: {x['errors']} errors in round {r}")
                    if x["cpu_pct"]["proxy"] is None:
                        raise RuntimeError("loadgen measured under 0.5 s, too short for CPU figures: raise --requests")
                    cpu_ms = x["cpu_pct"]["proxy"] / 100 / x["req_per_s"] * 1000
                    runs[rev].append((x["req_per_s"], cpu_ms))
                    print(
                        f"round {r + 1}/{args.rounds} {rev}: {x['req_per_s']:,.0f} req/s, {cpu_ms:.3f} ms CPU/request",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            for p in reversed(procs):
                stop(p)
    base = args.rev[0]
    rows = []
    for rev in args.rev:
        rps = [a for a, _ in runs[rev]]
        cpu = [b for _, b in runs[rev]]
        cpu_ratio = [b / a for (_, a), (_, b) in zip(runs[base], runs[rev], strict=True)]
        rps_ratio = [b / a for (a, _), (b, _) in zip(runs[base], runs[rev], strict=True)]
        rows.append(
            {
                "rev": rev,
                "req_per_s": statistics.median(rps),
                "cpu_ms_per_request": statistics.median(cpu),
                "cpu_ratio_median": statistics.median(cpu_ratio),
                "cpu_ratios": cpu_ratio,
                "req_per_s_ratio_median": statistics.median(rps_ratio),
            }
        )
    return {
        "policy": args.policy,
        "admission": args.admission_on,
        "rounds": args.rounds,
        "requests": args.requests,
        "rows": rows,
    }


def print_report(r: dict[str, Any]) -> None:
    base = r["rows"][0]["rev"]
    print(
        f"\nrouting {r['policy']}, SLO admission {'on' if r.get('admission') else 'off'}, 1P1D zero-latency fakes, "
        f"{r['requests']:,} requests x {r['rounds']} rounds, medians\n"
    )
    print(
        f"| build | req/s | CPU ms/request | CPU/request vs {base} (median of rounds) | per round | req/s vs {base} |"
    )
    print("|---|---:|---:|---:|---|---:|")
    for x in r["rows"]:
        rounds = ", ".join(f"{v:.2f}" for v in x["cpu_ratios"])
        print(
            f"| {x['rev']} | {x['req_per_s']:,.0f} | {x['cpu_ms_per_request']:.3f} | {x['cpu_ratio_median']:.3f} "
            f"| {rounds} | {x['req_per_s_ratio_median']:.3f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rev",
        action="append",
        required=True,
        help="a git revision, or . for the working tree (repeat; the first is the base)",
    )
    ap.add_argument(
        "--policy", default="sibyl", help="routing policy of every gateway (`default`: each build's own default)"
    )
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument(
        "--admission-on",
        action="store_true",
        help="leave SLO admission on (every build's default since issue 37) to compare what its decisions cost; "
        "only between builds that refuse nothing the fakes serve (issue 37's fix onward)",
    )
    ap.add_argument("--requests", type=int, default=3000, help="requests per gateway per round")
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if len(args.rev) < 2:
        ap.error("give at least two --rev to compare")
    r = run(args)
    print(json.dumps(r, indent=1) if args.json else "", end="")
    if not args.json:
        print_report(r)


if __name__ == "__main__":
    main()

"""The dashboard at scale: redraws per second and what serving it costs the console server.

Starts a console server (`up --headless --backend sim`, 32 prefill + 32 decode instances by default)
under steady closed-loop load from `shared/tools/loadgen.py`, then measures the server's CPU over
three windows of equal length: no dashboard, the dashboard attached, no dashboard again. The
dashboard is the real `SibylDashboard` (headless, in this process) talking to the server over its
control API only, as `sibyl-console tui` does. The dashboard's cost to the server is the CPU it used
with the dashboard minus the mean of the two windows around it (which brackets load drift).
Targets (issue 25): >= 2 redraws/s at 64 instances, < 5% of one core on the server.
Usage: python -m benchmarks.dashboard_scale [--prefill 32 --decode 32 --window-s 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from adapters.ports import free_port
from benchmarks.harness import console_env, start, start_console, stop
from benchmarks.report import md_header, md_row
from console.tui import app as dashboard_module
from console.tui.app import SibylDashboard
from console.tui.client import DashboardClient
from console.tui.messages import StateArrived

ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CountingDashboard(SibylDashboard):
    """The dashboard, counting the snapshots it applied (each repaints the table, SLO panel and charts)."""

    CSS_PATH = str(
        Path(dashboard_module.__file__).with_name("dashboard.tcss")
    )  # relative paths resolve beside the subclass
    applied: list[float]

    apply_s: list[float]

    def on_state_arrived(self, message: StateArrived) -> None:
        start = time.perf_counter()
        SibylDashboard.on_state_arrived(self, message)
        self.apply_s.append(time.perf_counter() - start)
        self.applied.append(time.monotonic())
        message.prevent_default()  # the base class's handler already ran


async def dashboard_window(url: str, token: str, pid: int, window_s: float) -> dict[str, float]:
    client = DashboardClient(url, token)
    app = CountingDashboard(client)
    app.applied, app.apply_s = [], []
    try:
        async with app.run_test(size=(200, 80)) as pilot:
            await pilot.pause(3.0)  # first frames, the event stream connected
            t0, c0, n0 = time.monotonic(), cpu_seconds(pid), len(app.applied)
            await asyncio.sleep(window_s)
            t1, c1, n1 = time.monotonic(), cpu_seconds(pid), len(app.applied)
            gaps = [b - a for a, b in zip(app.applied[n0:n1], app.applied[n0 + 1 : n1], strict=False)]
            applies = sorted(app.apply_s[n0:n1])
    finally:
        await client.aclose()
    return {
        "cpu": (c1 - c0) / (t1 - t0),
        "redraws_per_s": (n1 - n0) / (t1 - t0),
        "max_gap_s": max(gaps, default=float("nan")),
        "apply_p50_s": applies[len(applies) // 2] if applies else float("nan"),
        "apply_max_s": applies[-1] if applies else float("nan"),
    }


def quiet_window(pid: int, window_s: float) -> float:
    t0, c0 = time.monotonic(), cpu_seconds(pid)
    time.sleep(window_s)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=32)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=64, help="closed-loop load: concurrent streaming requests")
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        env = console_env(home)
        port = free_port()
        console = start_console(
            port,
            [
                "--backend",
                "sim",
                "--prefill",
                str(args.prefill),
                "--decode",
                str(args.decode),
                "--policy",
                "least_load",
            ],
            env,
        )
        url = f"http://127.0.0.1:{port}"
        load = None
        try:
            token = json.loads((home / "console.json").read_text())["token_file"]
            token = Path(token).read_text().strip()
            pid = json.loads((home / "console.json").read_text())["pid"]
            load = start(
                [
                    sys.executable,
                    str(args.shared / "tools" / "loadgen.py"),
                    "--url",
                    url,
                    "-c",
                    str(args.clients),
                    "-n",
                    "100000000",
                    "--stream",
                    "--max-tokens",
                    "64",
                ]
            )
            time.sleep(5)  # the load reaches its steady state
            before = quiet_window(pid, args.window_s)
            attached = asyncio.run(dashboard_window(url, token, pid, args.window_s))
            after = quiet_window(pid, args.window_s)
        finally:
            if load is not None:
                stop(load)
            stop(console)
    cost = attached["cpu"] - statistics.mean([before, after])
    result = {
        "instances": args.prefill + args.decode,
        "server_cpu_without": before,
        "server_cpu_with": attached["cpu"],
        "server_cpu_after": after,
        "dashboard_cost_cpu": cost,
        **{k: attached[k] for k in ("redraws_per_s", "max_gap_s", "apply_p50_s", "apply_max_s")},
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"dashboard at {result['instances']} instances under {args.clients} "
        f"closed-loop streaming clients, {args.window_s:g} s windows"
    )
    for line in md_header(
        [
            "instances",
            "redraws/s",
            "longest gap",
            "apply p50/max",
            "server CPU without",
            "with dashboard",
            "after",
            "dashboard's cost",
            "target",
        ],
        "rrrrrrrrl",
    ):
        print(line)
    print(
        md_row(
            [
                result["instances"],
                f"{attached['redraws_per_s']:.2f}",
                f"{attached['max_gap_s'] * 1e3:.0f} ms",
                f"{attached['apply_p50_s'] * 1e3:.0f}/{attached['apply_max_s'] * 1e3:.0f} ms",
                f"{before:.1%}",
                f"{attached['cpu']:.1%}",
                f"{after:.1%}",
                f"{cost:+.1%} of a core",
                ">= 2 redraws/s, < 5% of a core",
            ]
        )
    )


if __name__ == "__main__":
    main()

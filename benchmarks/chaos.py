"""Chaos replay: a real trace through an emulated cluster while its instances are killed and
restarted, hung and slowed at random (seeded, through the emulator's fault API), then an audit of
the run store.

A console (emulated, started here on free ports, stopped at the end) serves `sibyl-console replay`
of --limit requests of the trace. Meanwhile a seeded chaos loop, every --every seconds (±50%),
picks an instance and one fault: kill -9 its process and start it again on the same port after
--fault-s, hang it for --fault-s, or slow it ×5 for --fault-s; at most one instance is faulty at a
time and never the last healthy one of its role. Afterwards it checks, and prints:

- every request of the trace is in the replay's run exactly once, and exactly once in the
  console's run, under the same id; each one completed or failed with a reason;
- no request failed on an instance the console had already marked down (routing moved on);
- every instance that came back served requests again.

Usage: python -m benchmarks.chaos [--trace FILE] [--limit 400] [--speed 4] [--seed 7] [--every 2] [--fault-s 1.5]
Exit status 1 when an audit check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx

from adapters.emulator.process import EmulatorProcess
from adapters.pids import running
from adapters.ports import free_port
from adapters.store import RunStore
from benchmarks.harness import console_env, start_console, stop
from benchmarks.paths import AZURE_CONV, add_traces_option, traces_dir

ROOT = Path(__file__).resolve().parents[1]

MIN_LATER = 10
"""An instance back before at least this many more arrivals must have served one of them."""


class Chaos:
    """The seeded fault loop against one console's instances."""

    def __init__(self, url: str, auth: dict[str, str], profile: str, seed: int, every_s: float, fault_s: float) -> None:
        self.url, self.auth, self.profile = url, auth, profile
        self.rng = random.Random(seed)
        self.every_s, self.fault_s = every_s, fault_s
        self.stop = threading.Event()
        self.log: list[dict[str, Any]] = []
        self.restarted: list[EmulatorProcess] = []
        self.t0 = time.monotonic()

    def instances(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.url + "/control/state", headers=self.auth, timeout=10).json()["instances"])

    def run(self) -> None:
        while not self.stop.wait(self.every_s * self.rng.uniform(0.5, 1.5)):
            insts = self.instances()
            healthy = [i for i in insts if i["healthy"]]
            by_role = Counter(i["role"] for i in healthy)
            candidates = [i for i in healthy if by_role[i["role"]] > 1]
            if not candidates:
                continue
            inst = self.rng.choice(candidates)
            action = self.rng.choice(["kill", "hang", "slow"])
            self.log.append({"t": time.monotonic() - self.t0, "action": action, "instance": inst["id"]})
            print(f"  chaos t={self.log[-1]['t']:.1f}s: {action} {inst['id']}", file=sys.stderr, flush=True)
            getattr(self, action)(inst)

    def kill(self, inst: dict[str, Any]) -> None:
        os.killpg(inst["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while running(inst["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stop.wait(self.fault_s)
        port = int(inst["url"].rsplit(":", 1)[1])
        proc = EmulatorProcess(inst["role"], port, ["--profile", self.profile]).start()
        self.restarted.append(proc)
        proc.wait_ready(30)

    def _fault(self, inst: dict[str, Any], on: dict[str, Any], off: dict[str, Any]) -> None:
        httpx.put(inst["url"] + "/admin/faults", json=on, timeout=10)
        self.stop.wait(self.fault_s)
        httpx.put(inst["url"] + "/admin/faults", json=off, timeout=10)

    def hang(self, inst: dict[str, Any]) -> None:
        self._fault(inst, {"hang": True}, {"hang": False})

    def slow(self, inst: dict[str, Any]) -> None:
        self._fault(inst, {"slowdown": 5.0}, {"slowdown": 1.0})


def audit(store: RunStore, console_run: str, replay_run: str, limit: int) -> list[tuple[str, bool, str]]:
    """(check, passed, figures) for the run store after a chaos replay."""
    client = store.requests(replay_run)
    gateway = store.requests(console_run)
    c_ids, g_ids = Counter(r["request_id"] for r in client), Counter(r["request_id"] for r in gateway)
    checks = [
        (
            "every trace request once in the replay's run",
            len(client) == limit and max(c_ids.values(), default=0) == 1,
            f"{len(client)} rows, {len(c_ids)} ids, of {limit}",
        ),
        (
            "every trace request once in the console's run",
            set(g_ids) == set(c_ids) and max(g_ids.values(), default=0) == 1,
            f"{len(gateway)} rows, {len(g_ids)} ids",
        ),
    ]
    unexplained = [r for r in gateway if r["status"] != "ok" and not r["reason"]]
    failed = [r for r in gateway if r["status"] != "ok"]
    checks.append(
        (
            "each request completed or failed with a reason",
            not unexplained,
            f"{len(gateway) - len(failed)} ok, {len(failed)} failed, {len(unexplained)} without a reason",
        )
    )
    events = store.instance_events(console_run)
    # an instance is out of routing while marked down or while its circuit breaker is open
    down_at: dict[str, list[tuple[float, float]]] = {}
    out_for: dict[str, set[str]] = {}
    for e in events:
        why = {
            "down": ("health", True),
            "up": ("health", False),
            "circuit_open": ("breaker", True),
            "circuit_half_open": ("breaker", False),
            "circuit_closed": ("breaker", False),
        }.get(e["event"])
        if why is None:
            continue
        inst, (cause, starts) = e["instance_id"], why
        causes = out_for.setdefault(inst, set())
        was_out = bool(causes)
        (causes.add if starts else causes.discard)(cause)
        if causes and not was_out:
            down_at.setdefault(inst, []).append((e["t"], float("inf")))
        elif was_out and not causes:
            start, _ = down_at[inst][-1]
            down_at[inst][-1] = (start, e["t"])
    routed_to_down = [
        r
        for r in gateway
        if r["arrival"] is not None
        and any(
            a < r["arrival"] < b
            for inst in (r["prefill_instance"], r["decode_instance"])
            for a, b in down_at.get(inst or "", [])
        )
    ]
    checks.append(
        (
            "nothing routed to an instance while it was out (down or breaker open)",
            not routed_to_down,
            f"{len(routed_to_down)} requests; {sum(len(v) for v in down_at.values())} periods out",
        )
    )
    back = {inst: spans[-1][1] for inst, spans in down_at.items() if spans[-1][1] != float("inf")}
    later = {inst: [r for r in gateway if r["arrival"] is not None and r["arrival"] > t] for inst, t in back.items()}
    judged = {inst: rs for inst, rs in later.items() if len(rs) >= MIN_LATER}  # back with traffic still to come
    unused = [
        inst
        for inst, rs in judged.items()
        if not any(inst in (r["prefill_instance"], r["decode_instance"]) for r in rs)
    ]
    checks.append(
        (
            "instances that came back were used again",
            not unused,
            f"{len(back)} came back, {len(judged)} with ≥ {MIN_LATER} "
            f"requests still to come; unused after: {unused or 'none'}",
        )
    )
    return checks


def failure_reasons(store: RunStore, console_run: str) -> Counter[str]:
    """Failed requests by the first words of their reason (instance ids masked)."""
    out: Counter[str] = Counter()
    for r in store.requests(console_run):
        if r["status"] != "ok":
            words = " ".join(
                w if not (w[:1] in "pd" and w[1:].rstrip(":,").isdigit()) else "<inst>"
                for w in (r["reason"] or "").split()[:7]
            )
            out[words] += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=None, help=f"the trace to replay (default: TRACES/{AZURE_CONV})")
    add_traces_option(ap)
    ap.add_argument("--limit", type=int, default=400)
    ap.add_argument("--speed", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--every", type=float, default=2.0, help="mean seconds between faults")
    ap.add_argument(
        "--fault-s", type=float, default=1.5, help="how long a fault lasts (a killed instance stays down this long)"
    )
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=3)
    ap.add_argument("--profile", default="cpu-tiny-llama")
    a = ap.parse_args()
    if a.trace is None:
        a.trace = traces_dir(a.traces) / AZURE_CONV
    with TemporaryDirectory() as tmp:
        home = Path(tmp)
        port, token = free_port(), secrets.token_urlsafe(16)
        env = console_env(home, token)
        url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {token}"}
        console = start_console(
            port,
            ["--prefill", str(a.prefill), "--decode", str(a.decode), "--profile", a.profile, "--policy", "least_load"],
            env,
        )
        chaos = Chaos(url, auth, a.profile, a.seed, a.every, a.fault_s)
        try:
            console_run = httpx.get(url + "/control/run", headers=auth).json()["run_id"]
            loop = threading.Thread(target=chaos.run, daemon=True)
            loop.start()
            started = time.monotonic()
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "console.cli",
                    "replay",
                    str(a.trace),
                    "--limit",
                    str(a.limit),
                    "--speed",
                    str(a.speed),
                    "--url",
                    url,
                    "--json",
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            chaos.stop.set()
            loop.join(60)
            if out.returncode not in (0, 1) or not out.stdout.strip():
                raise RuntimeError(f"the replay failed: {out.stderr[-500:]}")
            replay = json.loads(out.stdout)
        finally:
            chaos.stop.set()
            stop(console, 60)
            for p in chaos.restarted:
                p.stop()
        store = RunStore(home / "runs.db")
        checks = audit(store, console_run, replay["run_id"], a.limit)
        reasons = failure_reasons(store, console_run)
    faults = Counter(x["action"] for x in chaos.log)
    print(
        f"# chaos replay: {a.limit} requests of {a.trace.name} at speed {a.speed:g}, "
        f"{a.prefill}P{a.decode}D {a.profile}, seed {a.seed}, {time.monotonic() - started:.0f} s"
    )
    print(
        f"faults: {len(chaos.log)} ({', '.join(f'{k} {v}' for k, v in sorted(faults.items()))}); "
        f"replay: {replay.get('done')} done, {replay.get('failed')} failed\n"
    )
    print("| check | result | figures |\n|---|---|---|")
    for name, ok, figures in checks:
        print(f"| {name} | {'pass' if ok else 'FAIL'} | {figures} |")
    if reasons:
        print("\nfailed requests by reason:")
        for why, n in reasons.most_common():
            print(f"  {n:4d}  {why} …")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

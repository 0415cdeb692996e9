"""Soak: an emulated cluster under steady streaming load for M minutes, watched for drift and leaks.

Starts its own console (`sibyl-console up --headless --port 0`, emulator backend, its own
SIBYL_HOME and SIBYL_DB in a temporary folder), then runs C closed-loop streaming clients
(asyncio + aiohttp, OpenAI `/v1/completions` with `ignore_eos` and a fixed `max_tokens`) through
the gateway until M minutes have passed, optionally swapping the routing policy every
`--swap-every` seconds (least_load -> round_robin -> sibyl -> ... through the control API, with
the token from the console's token file).

Reported per window (`--window-s`, default 60 s; the first `--warmup` seconds are a window of
their own and are not judged): requests and output tokens per second, errors, E2E and TPOT
p50/p99 (client side), and the RSS (VmRSS from /proc/PID/status) of the gateway and of every
instance pid that /control/state lists. At the end: p99 drift of E2E and TPOT (last window vs
the first one after warm-up; only growth counts), RSS growth per process from the end of
warm-up to the end, total errors, and PASS/FAIL against `--max-errors` (0), `--max-p99-drift`
(0.10) and `--max-rss-growth` (0.10).

The console is always stopped (SIGTERM, SIGKILL after `--grace` seconds) and the script checks
that every process it started is gone. Markdown table on stdout; `--json` prints JSON on stdout
instead (and the table on stderr). Exit code 0 on PASS, 1 on FAIL, 2 when the cluster could not
start.

Usage:
  python -m benchmarks.soak                                    # the long soak: 30 min, 200 streams
  python -m benchmarks.soak --minutes 1 --clients 50 --warmup 10 --window-s 10   # a cheap one
  python -m benchmarks.soak --minutes 5 --clients 100 --swap-every 60 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

from adapters.ports import free_port
from adapters.vllm.pd_protocol import SSETokenCounter
from benchmarks.soak_report import build_report, markdown

ROOT = Path(__file__).resolve().parents[1]

POLICY_CYCLE = ["least_load", "round_robin", "sibyl"]


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB (None when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def proc_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2] != "Z"


def belongs_to(pid: int, home: Path) -> bool:
    """The process was started with our SIBYL_HOME (guards against a reused pid)."""
    try:
        return f"SIBYL_HOME={home}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


# --- the console -------------------------------------------------------------------------------------
@dataclass
class Cluster:
    proc: subprocess.Popen[bytes]
    home: Path
    db: Path
    log: Path
    url: str = ""
    token: str = ""
    run_id: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    """name -> pid of every process the soak watches: `gateway` and each instance id."""

    def control(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=10)


def start_cluster(work: Path, args: argparse.Namespace) -> Cluster:
    home, db, logf = work / "home", work / "runs.db", work / "console.log"
    port = free_port()
    env = {**os.environ, "SIBYL_HOME": str(home), "SIBYL_DB": str(db)}
    env.pop("SIBYL_TOKEN", None)
    # SLO admission off: the soak holds a steady closed-loop load to watch drift, errors and memory;
    # with admission on, the clients beyond what meets the SLO would be refused (429) by design
    config = work / "soak.toml"
    config.write_text("[admission]\nenabled = false\n")
    cmd = [
        sys.executable,
        "-m",
        "console.cli",
        "up",
        str(config),
        "--headless",
        "--port",
        str(port),
        "--prefill",
        str(args.prefill),
        "--decode",
        str(args.decode),
        "--profile",
        args.profile,
        "--policy",
        args.policy,
    ]
    with open(logf, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    cluster = Cluster(proc, home, db, logf)
    deadline = time.monotonic() + args.start_timeout
    announce = home / "console.json"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the console exited with {proc.returncode}:\n{logf.read_text()[-3000:]}")
        if announce.exists():
            with contextlib.suppress(httpx.HTTPError, ValueError, OSError):
                data = json.loads(announce.read_text())
                if httpx.get(data["url"] + "/health", timeout=1).status_code == 200:
                    cluster.url, cluster.run_id = data["url"], data["run_id"]
                    cluster.token = Path(data["token_file"]).read_text().strip()
                    break
        time.sleep(0.1)
    else:
        raise RuntimeError(f"the console did not serve within {args.start_timeout:.0f} s:\n{logf.read_text()[-3000:]}")
    with cluster.control() as c:
        state = c.get("/control/state").json()
    cluster.pids = {"gateway": proc.pid, **{i["id"]: i["pid"] for i in state["instances"] if i.get("pid")}}
    return cluster


def stop_cluster(cluster: Cluster, grace: float) -> dict[str, Any]:
    """SIGTERM the console, SIGKILL after `grace`; then make sure every watched process is gone."""
    proc, how = cluster.proc, "already exited"
    if proc.poll() is None:
        how = "SIGTERM"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            how = "SIGKILL after grace"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # instances stop with the console (or by their parent-death signal); give them a moment
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(proc_alive(p) for p in cluster.pids.values()):
        time.sleep(0.1)
    leftover = {name: pid for name, pid in cluster.pids.items() if proc_alive(pid)}
    for pid in leftover.values():
        if belongs_to(pid, cluster.home):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return {"how": how, "exit_code": proc.returncode, "leftover": leftover}


# --- the load ----------------------------------------------------------------------------------------
@dataclass
class Result:
    end: float
    """seconds since the load started"""
    ok: bool
    e2e: float
    ttft: float | None
    tpot: float | None
    tokens: int
    reason: str = ""


@dataclass
class Soak:
    url: str
    clients: int
    duration_s: float
    max_tokens: int
    prompt_tokens: int
    results: list[Result] = field(default_factory=list)
    t0: float = 0.0
    died: dict[str, Any] | None = None
    """When and how the console exited before the end (the clients stop at once)."""

    async def one(self, session: aiohttp.ClientSession, k: int, i: int) -> Result:
        body = {
            "prompt": [(k * 131 + i * 7 + j * 17) % 1000 + 1 for j in range(self.prompt_tokens)],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        sent = time.monotonic()
        first: float | None = None
        counter = SSETokenCounter()
        reason = ""
        try:
            async with session.post(
                self.url + "/v1/completions",
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json", "X-Request-Id": f"soak-{k}-{i}"},
            ) as r:
                if r.status != 200:
                    reason = f"HTTP {r.status}: {(await r.read())[:200].decode(errors='replace')}"
                else:
                    async for chunk in r.content.iter_any():
                        if counter.feed(chunk) and first is None:
                            first = time.monotonic()
                    if not counter.done or counter.error is not None:
                        reason = f"stream ended early: {counter.error or 'no [DONE]'}"
                    elif counter.tokens != self.max_tokens:
                        reason = f"{counter.tokens} tokens instead of {self.max_tokens}"
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            reason = f"{type(e).__name__}: {e}"
        end = time.monotonic()
        n = counter.tokens
        ok = not reason
        tpot = ((end - first) / (n - 1) if n > 1 else 0.0) if ok and first is not None else None
        return Result(
            end - self.t0,
            ok,
            end - sent,
            (first - sent) if ok and first is not None else None,
            tpot,
            n if ok else 0,
            reason,
        )

    async def client(self, session: aiohttp.ClientSession, k: int) -> None:
        i = 0
        while time.monotonic() - self.t0 < self.duration_s and self.died is None:
            res = await self.one(session, k, i)
            self.results.append(res)
            i += 1
            if not res.ok:
                await asyncio.sleep(0.1)  # no hot loop against a broken gateway


async def drive(
    soak: Soak, cluster: Cluster, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run the clients, the RSS sampler and the policy swapper; return (rss samples, swaps)."""
    samples: list[dict[str, Any]] = []
    swaps: list[dict[str, Any]] = []
    soak.t0 = time.monotonic()

    async def sampler() -> None:
        while True:
            samples.append(
                {"t": time.monotonic() - soak.t0, "rss_kib": {n: rss_kib(p) for n, p in cluster.pids.items()}}
            )
            await asyncio.sleep(args.sample_s)

    async def swapper() -> None:
        k = 0
        async with httpx.AsyncClient(
            base_url=cluster.url, headers={"Authorization": f"Bearer {cluster.token}"}, timeout=10
        ) as c:
            while True:
                await asyncio.sleep(args.swap_every)
                if time.monotonic() - soak.t0 >= soak.duration_s:
                    return
                name = POLICY_CYCLE[k % len(POLICY_CYCLE)]
                k += 1
                t = time.monotonic() - soak.t0
                try:
                    r = await c.put("/control/policies/routing", json={"name": name, "source": "soak"})
                    swaps.append(
                        {"t": round(t, 1), "policy": name, "ok": r.status_code == 200, "status": r.status_code}
                    )
                except httpx.HTTPError as e:
                    swaps.append({"t": round(t, 1), "policy": name, "ok": False, "status": f"{type(e).__name__}: {e}"})
                log(f"routing -> {name} at {t:.0f} s ({'ok' if swaps[-1]['ok'] else swaps[-1]['status']})")

    async def watchdog() -> None:
        while cluster.proc.poll() is None:
            await asyncio.sleep(0.2)
        soak.died = {"t": round(time.monotonic() - soak.t0, 1), "exit_code": cluster.proc.returncode}
        log(
            f"the console exited with {cluster.proc.returncode} after {soak.died['t']} s; stopping the clients "
            f"(its log: {cluster.log} when --workdir keeps it)"
        )

    async def progress() -> None:
        seen = 0
        while True:
            await asyncio.sleep(args.window_s)
            new = soak.results[seen:]
            seen += len(new)
            errs = sum(not r.ok for r in new)
            log(
                f"{time.monotonic() - soak.t0:5.0f} s: {len(new) / args.window_s:6.1f} req/s, {errs} errors, "
                f"gateway RSS {(rss_kib(cluster.proc.pid) or 0) / 1024:.0f} MiB"
            )

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    helpers = [asyncio.create_task(sampler()), asyncio.create_task(progress()), asyncio.create_task(watchdog())]
    if args.swap_every > 0:
        helpers.append(asyncio.create_task(swapper()))
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(soak.client(session, k) for k in range(soak.clients)))
    finally:
        for h in helpers:
            h.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
    samples.append({"t": time.monotonic() - soak.t0, "rss_kib": {n: rss_kib(p) for n, p in cluster.pids.items()}})
    return samples, swaps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the load runs, warm-up included (default 30)")
    ap.add_argument("--seconds", type=float, help="how long the load runs in seconds (overrides --minutes)")
    ap.add_argument("--clients", type=int, default=200, help="concurrent streaming clients (default 200)")
    ap.add_argument(
        "--warmup", type=float, default=60.0, help="seconds at the start that are reported but not judged (default 60)"
    )
    ap.add_argument("--window-s", type=float, default=60.0, help="report window length in seconds (default 60)")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--profile", default="h20-qwen3-32b", help="emulator performance profile (default h20-qwen3-32b)")
    ap.add_argument("--policy", default="sibyl", help="routing policy at start (default sibyl)")
    ap.add_argument("--max-tokens", type=int, default=64, help="forced output length of every request (default 64)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (default 128)")
    ap.add_argument(
        "--swap-every", type=float, default=0.0, help="swap the routing policy every S seconds (0: never; e.g. 60)"
    )
    ap.add_argument("--sample-s", type=float, default=1.0, help="RSS sampling period (default 1 s)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="a request taking longer counts as an error")
    ap.add_argument("--max-errors", type=int, default=0, help="target: at most this many failed requests (default 0)")
    ap.add_argument(
        "--max-p99-drift",
        type=float,
        default=0.10,
        help="target: p99 E2E and TPOT growth, last vs first window (default 0.10)",
    )
    ap.add_argument(
        "--max-rss-growth",
        type=float,
        default=0.10,
        help="target: RSS growth of every process after warm-up (default 0.10)",
    )
    ap.add_argument("--strict-windows", action="store_true", help="FAIL when fewer than two windows follow the warm-up")
    ap.add_argument(
        "--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL when stopping (default 30)"
    )
    ap.add_argument("--start-timeout", type=float, default=90.0)
    ap.add_argument(
        "--workdir",
        type=Path,
        help="keep SIBYL_HOME, the DB and console.log here (default: a temporary folder, removed)",
    )
    ap.add_argument("--json", action="store_true", help="print the report as JSON on stdout (the table goes to stderr)")
    args = ap.parse_args(argv)
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    args.minutes = duration / 60
    if args.warmup >= duration:
        ap.error("--warmup must be shorter than the run")
    window = args.window_s
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="sibyl-soak-")
    work = args.workdir or Path(tmp.name)  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)

    def interrupted(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally below, which stops the console

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    cluster: Cluster | None = None
    stopped: dict[str, Any] = {"how": "not started", "exit_code": None, "leftover": {}}
    try:
        log(f"starting a {args.prefill}P{args.decode}D emulated cluster ({args.profile}) in {work}")
        try:
            cluster = start_cluster(work, args)
        except RuntimeError as e:
            print(f"soak: {e}", file=sys.stderr)
            return 2
        log(
            f"gateway {cluster.url}, run {cluster.run_id}, pids {cluster.pids}; "
            f"{args.clients} clients for {duration:.0f} s"
        )
        soak = Soak(cluster.url, args.clients, duration, args.max_tokens, args.prompt_tokens)
        samples, swaps = asyncio.run(drive(soak, cluster, args))
    finally:
        if cluster is not None:
            stopped = stop_cluster(cluster, args.grace)
            log(f"console stopped ({stopped['how']}, exit {stopped['exit_code']})")
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.cleanup()
    assert cluster is not None
    rep = build_report(soak, samples, swaps, args, window, stopped, cluster)
    table = markdown(rep)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(rep, indent=2))
    else:
        print(table)
    return 0 if rep["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())

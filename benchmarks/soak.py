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
from benchmarks.report import md_header, md_row, num, to_ms

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


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


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


# --- the report --------------------------------------------------------------------------------------
def windows_of(duration: float, warmup: float, window: float) -> list[tuple[str, float, float]]:
    """("warmup", 0, warmup) then windows of `window` s; a last partial window shorter than half is dropped.

    A window holds the requests that finished in it; those still running at the deadline finish
    while the clients drain and count in the totals only."""
    out: list[tuple[str, float, float]] = []
    if warmup > 0:
        out.append(("warmup", 0.0, warmup))
    start, k = warmup, 1
    while start < duration - 1e-9:
        end = min(start + window, duration)
        if end - start >= window / 2 or k == 1:
            out.append((f"w{k}", start, end))
        start, k = end, k + 1
    return out


def rss_at(samples: list[dict[str, Any]], t: float) -> dict[str, int | None]:
    """The last RSS sample taken at or before t (the first one if none)."""
    best = samples[0]
    for s in samples:
        if s["t"] <= t + 1e-6:
            best = s
    return dict(best["rss_kib"])


def drift(first: float | None, last: float | None) -> float | None:
    if first is None or last is None or first <= 0:
        return None
    return (last - first) / first


def build_report(
    soak: Soak,
    samples: list[dict[str, Any]],
    swaps: list[dict[str, Any]],
    args: argparse.Namespace,
    window: float,
    stopped: dict[str, Any],
    cluster: Cluster,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    duration = soak.duration_s
    for name, a, b in windows_of(duration, args.warmup, window):
        rs = [r for r in soak.results if a <= r.end < b]
        ok = [r for r in rs if r.ok]
        span = b - a
        e2e = [r.e2e for r in ok]
        tpot = [r.tpot for r in ok if r.tpot is not None]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        rows.append(
            {
                "window": name,
                "start_s": round(a, 1),
                "end_s": round(b, 1),
                "warmup": name == "warmup",
                "requests": len(ok),
                "errors": len(rs) - len(ok),
                "req_per_s": len(ok) / span,
                "tokens_per_s": sum(r.tokens for r in ok) / span,
                "e2e_p50_ms": to_ms(pct(e2e, 50)),
                "e2e_p99_ms": to_ms(pct(e2e, 99)),
                "ttft_p99_ms": to_ms(pct(ttft, 99)),
                "tpot_p50_ms": to_ms(pct(tpot, 50)),
                "tpot_p99_ms": to_ms(pct(tpot, 99)),
                "rss_mib": {n: (v / 1024 if v is not None else None) for n, v in rss_at(samples, b).items()},
            }
        )
    judged = [w for w in rows if not w["warmup"]]
    first, last = (judged[0], judged[-1]) if len(judged) >= 2 else (None, None)  # one window: no drift to speak of
    base = rss_at(samples, args.warmup)
    end = samples[-1]["rss_kib"]
    growth: dict[str, dict[str, Any]] = {}
    for n in cluster.pids:
        b0, b1 = base.get(n), end.get(n)
        growth[n] = {
            "after_warmup_mib": None if b0 is None else b0 / 1024,
            "end_mib": None if b1 is None else b1 / 1024,
            "growth": (b1 - b0) / b0 if b0 and b1 is not None else None,
        }
    errors = [r for r in soak.results if not r.ok]
    drained = [r for r in soak.results if r.end >= duration]
    reasons: dict[str, int] = {}
    for r in errors:
        key = r.reason[:120]
        reasons[key] = reasons.get(key, 0) + 1
    drifts = {
        "e2e_p99": drift(first["e2e_p99_ms"], last["e2e_p99_ms"]) if first and last else None,
        "tpot_p99": drift(first["tpot_p99_ms"], last["tpot_p99_ms"]) if first and last else None,
    }
    failures = []
    if len(errors) > args.max_errors:
        failures.append(f"{len(errors)} gateway errors > {args.max_errors}")
    for k, d in drifts.items():
        if d is not None and d > args.max_p99_drift:
            failures.append(f"{k} drift {d:+.1%} > {args.max_p99_drift:.0%}")
    if len(judged) < 2 and args.strict_windows:
        failures.append("fewer than two windows after warm-up: no drift to judge (shorter --window-s?)")
    for n, g in growth.items():
        if g["growth"] is not None and g["growth"] > args.max_rss_growth:
            failures.append(f"{n} RSS grew {g['growth']:+.1%} > {args.max_rss_growth:.0%}")
    bad_swaps = [s for s in swaps if not s["ok"]]
    if bad_swaps:
        failures.append(f"{len(bad_swaps)} policy swaps failed")
    if soak.died is not None:
        failures.append(f"the console exited before the end, after {soak.died['t']} s (exit {soak.died['exit_code']})")
    if stopped["leftover"]:
        failures.append(f"processes still alive after the stop: {stopped['leftover']}")
    if not soak.results:
        failures.append("no request completed")
    return {
        "config": {
            "minutes": args.minutes,
            "duration_s": duration,
            "clients": soak.clients,
            "warmup_s": args.warmup,
            "window_s": window,
            "prefill": args.prefill,
            "decode": args.decode,
            "profile": args.profile,
            "policy": args.policy,
            "max_tokens": soak.max_tokens,
            "prompt_tokens": soak.prompt_tokens,
            "swap_every_s": args.swap_every,
        },
        "run_id": cluster.run_id,
        "pids": cluster.pids,
        "windows": rows,
        "swaps": swaps,
        "totals": {
            "requests": len(soak.results) - len(errors),
            "errors": len(errors),
            "error_reasons": reasons,
            "drained_after_deadline": len(drained),
            "req_per_s": (len(soak.results) - len(errors)) / duration,
            "tokens_per_s": sum(r.tokens for r in soak.results) / duration,
        },
        "p99_drift": drifts,
        "rss_growth": growth,
        "stop": stopped,
        "console_died": soak.died,
        "targets": {
            "max_errors": args.max_errors,
            "max_p99_drift": args.max_p99_drift,
            "max_rss_growth": args.max_rss_growth,
        },
        "failures": failures,
        "verdict": "FAIL" if failures else "PASS",
    }


def _pc(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


def markdown(rep: dict[str, Any]) -> str:
    c = rep["config"]
    names = list(rep["pids"])
    lines = [
        f"Soak: {c['prefill']}P{c['decode']}D emulated ({c['profile']}), {c['clients']} streaming clients, {c['duration_s']:.0f} s "
        f"(warm-up {c['warmup_s']:.0f} s, windows {c['window_s']:.0f} s), max_tokens {c['max_tokens']}, prompt {c['prompt_tokens']} tokens"
        + (
            f", routing swapped every {c['swap_every_s']:.0f} s"
            if c["swap_every_s"] > 0
            else f", routing {c['policy']}"
        ),
        "",
        *md_header(
            [
                "window",
                "req/s",
                "tok/s",
                "errors",
                "E2E p50 ms",
                "E2E p99 ms",
                "TPOT p50 ms",
                "TPOT p99 ms",
                *(f"{n} MiB" for n in names),
            ],
            "l" + "r" * (7 + len(names)),
        ),
    ]
    for w in rep["windows"]:
        label = f"{w['window']} ({w['start_s']:.0f}–{w['end_s']:.0f} s)"
        lines.append(
            md_row(
                [
                    label,
                    f"{w['req_per_s']:.1f}",
                    f"{w['tokens_per_s']:.0f}",
                    w["errors"],
                    num(w["e2e_p50_ms"]),
                    num(w["e2e_p99_ms"]),
                    num(w["tpot_p50_ms"], ".1f"),
                    num(w["tpot_p99_ms"], ".1f"),
                    *(num(w["rss_mib"].get(n), ".1f") for n in names),
                ]
            )
        )
    t, d = rep["totals"], rep["p99_drift"]
    lines += [
        "",
        f"Totals: {t['requests']} requests ({t['req_per_s']:.1f}/s, {t['tokens_per_s']:.0f} tok/s; {t['drained_after_deadline']} of them "
        f"finished after the deadline, in no window), {t['errors']} errors"
        + (f" {t['error_reasons']}" if t["errors"] else ""),
        f"p99 drift (last vs first window after warm-up): E2E {_pc(d['e2e_p99'])}, TPOT {_pc(d['tpot_p99'])}"
        + (" (needs two windows after warm-up: pass a shorter --window-s)" if d["e2e_p99"] is None else ""),
        "RSS growth after warm-up: "
        + ", ".join(
            f"{n} {num(g['after_warmup_mib'], '.1f')}→{num(g['end_mib'], '.1f')} MiB ({_pc(g['growth'])})"
            for n, g in rep["rss_growth"].items()
        ),
        f"Stop: {rep['stop']['how']} (exit {rep['stop']['exit_code']}), leftover processes: {rep['stop']['leftover'] or 'none'}",
        f"{rep['verdict']}"
        + (
            ": " + "; ".join(rep["failures"])
            if rep["failures"]
            else f" (errors ≤ {rep['targets']['max_errors']}, p99 drift ≤ {rep['targets']['max_p99_drift']:.0%}, "
            f"RSS growth ≤ {rep['targets']['max_rss_growth']:.0%})"
        ),
    ]
    return "\n".join(lines)


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
            f"gateway {cluster.url}, run {cluster.run_id}, pids {cluster.pids}; {args.clients} clients for {duration:.0f} s"
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

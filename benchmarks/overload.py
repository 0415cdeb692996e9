"""Overload: a burst and sustained loads past capacity at an emulated 1P1D console, with SLO
admission off (the old defaults) and on (the defaults now).

Each load sends streamed completions (token-id prompts of --prompt tokens, --output tokens with
ignore_eos) from one client whose timeout is --timeout seconds: a burst of --burst requests at
once (issue 28's 600), then --duration seconds of evenly spaced arrivals at each multiple of the
cluster's capacity in --rates. Capacity is what the profile says 1P1D sustains: the lesser of the
prefill instance's rate for such prompts and the decode instance's rate at its SLO admission
slots. For every request the client records what it got and when:

- answered: 200 and every token; shed: 429; expired: 503; timeout: no answer, or not all of it,
  within --timeout; other: anything else (another status, a broken stream);
- wait: seconds from sending to the first byte of the answer (the first token, or the error);
  `rej max` is the longest a 429/503 took;
- Retry-After present on every 429/503 (the `ra` column counts those without it);
- attainment of the answered: TTFT ≤ the SLO's 2 s and mean TPOT ≤ its 100 ms, measured here
  (from sending, so it includes the client's own queueing under a burst) and as the console
  measures it (from the gateway's arrival, the `console` column: the run store's slo_met).

With --tenants, two tenants share the cluster (each with its API key, SLO admission on): `flood`
sends --flood times capacity and `steady` --steady times capacity, evenly spaced, for --duration
seconds, once without per-tenant limits, once with `flood` held to --flood-in-flight requests in
flight and (with --flood-tpm) once to that many tokens per minute (prompt + max_tokens, unused output
refunded; the bucket holds a minute's worth, so it binds only after a minute's burst); a row per tenant.
--hold S sets `[admission] extra_wait_s = S`: requests that cannot start at once are held up to S s
past their TTFT target and released fairly between the tenants.

Usage: python -m benchmarks.overload [--burst 600] [--rates 2,3] [--duration 20] [--modes off,on]
       [--tenants] [--flood 3] [--steady 0.5] [--flood-in-flight 8] [--flood-tpm 0] [--hold 0]
       [--profile h20-qwen3-32b] [--timeout 90] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import numpy as np

from adapters.ports import free_port
from adapters.store import RunStore
from benchmarks.harness import console_env, start_console, stop
from benchmarks.report import num
from console.live.tenants import keys_file_line
from core.admission import SloAdmission, tpot_slots
from core.perf import get_profile
from core.slo import SLOClass

SLO = SLOClass()
"""The console's default class: TTFT 2 s, TPOT 100 ms."""


@dataclass
class Outcome:
    status: int
    """HTTP status; 0 when there was no answer (timeout or connection error)."""
    wait_s: float
    """Sending → the first byte of the answer (first token or error body); the timeout if none."""
    tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    retry_after: bool = False
    complete: bool = False
    timed_out: bool = False
    """No answer, or not all of it, within the client's timeout."""


def capacity(profile_name: str, prompt: int, output: int) -> float:
    """Requests per second 1P1D sustains on the profile within the default SLO (prefill or decode bound)."""
    p = get_profile(profile_name)
    k = max(1, p.max_num_batched_tokens // prompt)  # prompts one prefill step takes
    prefill_rate = k / float(p.prefill_batch_time([prompt] * k))
    slots = tpot_slots(p, SloAdmission().headroom * SLO.tpot_s, p.ps_context_tokens)
    decode_rate = slots / (output * p.step_time(slots, slots * p.ps_context_tokens))
    return min(prefill_rate, decode_rate)


async def one(
    client: httpx.AsyncClient, url: str, prompt: int, output: int, k: int, timeout: float, key: str | None = None
) -> Outcome:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    body = {
        "model": "sibyl-model",
        "prompt": [7 + (k + j) % 900 for j in range(prompt)],
        "max_tokens": output,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.monotonic()
    out = Outcome(0, timeout)
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    out.status, out.wait_s = r.status_code, time.monotonic() - t0
                    out.retry_after = "retry-after" in r.headers
                    return out
                out.status = 200
                first = last = None
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        out.complete = out.complete or line == "data: [DONE]"
                        continue
                    if '"text":""' in line or '"choices":[]' in line:
                        continue
                    now = time.monotonic()
                    if first is None:
                        first = now
                        out.wait_s = out.ttft_s = now - t0
                    last = now
                    out.tokens += 1
                out.complete = out.complete and out.tokens == output
                if first is not None and last is not None and out.tokens > 1:
                    out.tpot_s = (last - first) / (out.tokens - 1)
    except (TimeoutError, httpx.TimeoutException):
        out.complete, out.timed_out = False, True
    except httpx.HTTPError:
        out.complete = False
    return out


async def load(
    url: str, n: int, spacing_s: float, prompt: int, output: int, timeout: float, key: str | None = None, k0: int = 0
) -> list[Outcome]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        tasks = []
        start = time.monotonic()
        for k in range(n):
            if spacing_s:
                await asyncio.sleep(max(0.0, start + k * spacing_s - time.monotonic()))
            tasks.append(asyncio.create_task(one(client, url, prompt, output, k0 + k, timeout, key)))
        return list(await asyncio.gather(*tasks))


def summarize(
    label: str, mode: str, outs: list[Outcome], timeout: float, rows: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    ok = [o for o in outs if o.status == 200 and o.complete]
    waits = np.array([o.wait_s for o in outs])
    met = [o for o in ok if o.ttft_s is not None and o.ttft_s <= SLO.ttft_s and (o.tpot_s or 0.0) <= SLO.tpot_s]
    rejected = [o for o in outs if o.status in (429, 503)]
    late = [o for o in outs if o.timed_out]
    return {
        "load": label,
        "admission": mode,
        "requests": len(outs),
        "answered": len(ok),
        "shed": sum(o.status == 429 for o in outs),
        "expired": sum(o.status == 503 for o in outs),
        "timeout": len(late),
        "other": len(outs) - len(ok) - len(rejected) - len(late),
        "no_retry_after": sum(not o.retry_after for o in rejected),
        "wait_p50_s": float(np.percentile(waits, 50)),
        "wait_p99_s": float(np.percentile(waits, 99)),
        "wait_max_s": float(waits.max()),
        "reject_wait_max_s": max((o.wait_s for o in rejected), default=None),
        "attainment": len(met) / len(ok) if ok else None,
        "ttft_p50_s": float(np.median([o.ttft_s for o in ok if o.ttft_s is not None])) if ok else None,
        "console_attainment": _console_attainment(rows),
    }


def _console_attainment(rows: list[dict[str, Any]] | None) -> float | None:
    """SLO attainment of the requests the console answered in full, as it recorded them."""
    ok = [r for r in rows or [] if r["status"] == "ok"]
    return sum(bool(r["slo_met"]) for r in ok) / len(ok) if ok else None


def run_one(mode: str, loads: list[tuple[str, int, float]], a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for label, n, spacing in loads:
        with TemporaryDirectory() as tmp:
            home = Path(tmp)
            cfg = home / "console.toml"
            cfg.write_text(f"[admission]\nenabled = {'true' if mode == 'on' else 'false'}\n")
            port = free_port()
            console = start_console(
                port,
                [str(cfg), "--prefill", "1", "--decode", "1", "--profile", a.profile],
                console_env(home, secrets.token_urlsafe(16)),
            )
            try:
                run_id = json.loads((home / "console.json").read_text())["run_id"]
                outs = asyncio.run(load(f"http://127.0.0.1:{port}", n, spacing, a.prompt, a.output, a.timeout))
            finally:
                stop(console)
            stored = RunStore(home / "runs.db").requests(run_id)
        row = summarize(label, mode, outs, a.timeout, stored)
        rows.append(row)
        print(_line(row), flush=True)
    return rows


FLOOD_KEY, STEADY_KEY = "sk-bench-flood-" + secrets.token_hex(8), "sk-bench-steady-" + secrets.token_hex(8)


def run_tenants(cap: float, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Two tenants at --flood and --steady times capacity, without and with each limit on `flood`."""
    flood_rate, steady_rate = a.flood * cap, a.steady * cap
    cases: list[tuple[str, dict[str, int]]] = [("none", {})]
    if a.flood_in_flight:
        cases.append((f"{a.flood_in_flight} in fl", {"max_in_flight": a.flood_in_flight}))
    if a.flood_tpm:
        cases.append((f"tpm {a.flood_tpm // 1000}k", {"tokens_per_minute": a.flood_tpm}))
    rows = []
    for limits, limited in cases:
        with TemporaryDirectory() as tmp:
            home = Path(tmp)
            keys = home / "tenants.toml"
            keys.write_text(keys_file_line("flood", FLOOD_KEY, **limited) + "\n" + keys_file_line("steady", STEADY_KEY))
            cfg = home / "console.toml"
            cfg.write_text(f"[admission]\nextra_wait_s = {a.hold}\n")
            port = free_port()
            console = start_console(
                port,
                [str(cfg), "--prefill", "1", "--decode", "1", "--profile", a.profile, "--tenants", str(keys)],
                console_env(home, secrets.token_urlsafe(16)),
            )
            url = f"http://127.0.0.1:{port}"
            try:
                run_id = json.loads((home / "console.json").read_text())["run_id"]

                async def both(url: str) -> tuple[list[Outcome], list[Outcome]]:
                    n_f, n_s = int(flood_rate * a.duration), int(steady_rate * a.duration)
                    f, s = await asyncio.gather(
                        load(url, n_f, 1 / flood_rate, a.prompt, a.output, a.timeout, FLOOD_KEY),
                        load(url, n_s, 1 / steady_rate, a.prompt, a.output, a.timeout, STEADY_KEY, k0=10**6),
                    )
                    return f, s

                flood, steady = asyncio.run(both(url))
            finally:
                stop(console)
            stored = RunStore(home / "runs.db").requests(run_id)
        for tenant, rate, outs in (("flood", a.flood, flood), ("steady", a.steady, steady)):
            mine = [r for r in stored if r["tenant"] == tenant]
            row = summarize(f"{tenant} {rate:g}x", limits, outs, a.timeout, mine)
            row["limited"] = sum((r["reason"] or "").startswith("tenant ") for r in mine)
            rows.append(row)
            print(f"{_line(row)} {row['limited']:>7}", flush=True)
    return rows


HEADER = (
    f"{'load':<16} {'admission':<9} {'n':>4} {'answered':>8} {'shed':>5} {'expired':>7} {'timeout':>7} {'other':>5} "
    f"{'ra':>3} {'wait p50':>8} {'p99':>6} {'max':>6} {'rej max':>7} {'attain':>7} {'console':>7} {'TTFT p50':>8}"
)


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['load']:<16} {r['admission']:<9} {r['requests']:>4} {r['answered']:>8} {r['shed']:>5} {r['expired']:>7} "
        f"{r['timeout']:>7} {r['other']:>5} {r['no_retry_after']:>3} {num(r['wait_p50_s'], '.1f'):>8} "
        f"{num(r['wait_p99_s'], '.1f'):>6} "
        f"{num(r['wait_max_s'], '.1f'):>6} {num(r['reject_wait_max_s'], '.2f'):>7} {num(r['attainment'], '.0%'):>7} "
        f"{num(r['console_attainment'], '.0%'):>7} {num(r['ttft_p50_s'], '.1f'):>8}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--burst", type=int, default=600, help="requests sent at once (0: no burst)")
    ap.add_argument("--rates", default="2,3", help="multiples of capacity for the sustained loads (empty: none)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of each sustained load")
    ap.add_argument("--modes", default="off,on", help="SLO admission off (old defaults) and/or on")
    ap.add_argument("--profile", default="h20-qwen3-32b")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=90.0, help="the client's timeout per request")
    ap.add_argument("--tenants", action="store_true", help="also run the two-tenant case (one flooding)")
    ap.add_argument("--flood", type=float, default=3.0, help="the flooding tenant's load, times capacity")
    ap.add_argument("--steady", type=float, default=0.5, help="the other tenant's load, times capacity")
    ap.add_argument("--flood-in-flight", type=int, default=8, help="the flooding tenant's max_in_flight (0: no case)")
    ap.add_argument(
        "--flood-tpm",
        type=int,
        default=0,
        help="the flooding tenant's tokens_per_minute (0: no case; a minute's burst)",
    )
    ap.add_argument(
        "--hold",
        type=float,
        default=0.0,
        help="tenants case: [admission] extra_wait_s (0, the default: nothing is held, so nothing is released fairly)",
    )
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    cap = capacity(a.profile, a.prompt, a.output)
    loads: list[tuple[str, int, float]] = []
    if a.burst:
        loads.append((f"burst {a.burst}", a.burst, 0.0))
    for x in filter(None, a.rates.split(",")):
        rate = float(x) * cap
        loads.append((f"{x}x ({rate:.1f}/s)", int(rate * a.duration), 1.0 / rate))
    print(
        f"1P1D {a.profile}: capacity {cap:.1f} requests/s ({a.prompt}-token prompts, {a.output} tokens); "
        f"SLO TTFT {SLO.ttft_s:g} s, TPOT {SLO.tpot_s * 1000:g} ms; client timeout {a.timeout:g} s"
    )
    if loads:
        print(HEADER, flush=True)
    rows = [r for mode in a.modes.split(",") if loads for r in run_one(mode, loads, a)]
    if a.tenants:
        print(
            f"two tenants, SLO admission on (extra_wait_s {a.hold:g}); `admission`: the flooding tenant's limit\n"
            f"{HEADER} {'limited':>7}"
        )
        rows += run_tenants(cap, a)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

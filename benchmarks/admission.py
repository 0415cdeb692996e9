"""Sheds what it must, no more (issue 37): SLO admission on and off around the load C an emulated 1P1D serves.

An emulated 1P1D console (the default profile, h20-qwen3-32b, and the default admission settings) is
loaded open-loop: Poisson arrivals at rate λ over a real trace's lengths. The lengths are drawn
(seeded) from --trace (default: the BF-IO authors' 8,000-row BurstGPT sample in ../shared/traces);
a prompt that an idle 1P1D could not answer within the TTFT target even alone (the profile's prefill,
KV hand-off and one decode step) is left out, since no admission can serve it, and outputs are
clipped at --max-output tokens (sent as max_tokens with ignore_eos). The arrival gaps and the
lengths are the same sequence at every λ and in both modes (only the time scale changes), so on and
off see the very same requests.

1. C: with `[admission] enabled = false`, a short grid on λ, each point as long as the runs
   (--duration; starting at half the profile's own rate for these lengths, up ×1.25 after a pass or
   down ×0.8 after a miss, then bisecting between the highest pass and the lowest miss above it
   while --grid-runs last) finds the highest λ whose SLO attainment (requests answered within TTFT
   2 s and TPOT 100 ms, measured by the client from sending, over all requests) is ≥ 95%. A longer
   run reaches further into the sequence, so C found on shorter points overstates the runs' own:
   seed 37's 30 s points gave C = 2.42/s, and 160 s at 0.8 of that (1.94/s) left admission off at
   95.0%, C itself for that length.
2. Then at 0.8, 1.2, 2 and 3 × C, admission off and on alternately, one fresh console per run.

Per run: requests; refused (429/503) share; answered (200, every token) share; answered within the
SLO share; attainment of the admitted (within SLO / not refused); refusal latency p99 and max
(sending → the 429/503 reply); whether every refusal carried Retry-After. A client gives up on a
request once it could no longer meet the SLO even if answered (TTFT + TPOT × (max output − 1) + 1 s
after sending), so a run ends at most that long after its last arrival. For admission-on runs, what
admission refused by cause, with the last refused request's projection against its bound, the TTFT
drift it measured, and the prefill instance's projected backlog (sampled every 2 s) beside what its
engine reported waiting.

Targets: 0.8·C ≤ 1% refused; 1.2·C answered (on) ≥ 95% of off's answered within the SLO; 2·C and
3·C ≥ 90% of the admitted within the SLO and every refusal within 1 s with Retry-After.

--capacity skips the grid; --on-setting KEY=VALUE adds an [admission] line to the 'on' runs (a what-if
beside the defaults, never a default). Ctrl-C (or SIGTERM) stops the console of the run under way.

Usage: python -m benchmarks.admission [--quick] [--duration 40] [--grid-duration SECONDS] [--grid-runs 5]
       [--capacity C] [--loads 0.8,1.2,2,3] [--trace FILE] [--seed 37] [--max-output 256]
       [--on-setting headroom=1.0] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import numpy as np

from adapters.ports import free_port
from adapters.store import RunStore
from benchmarks.harness import console_env, start, stop, wait_http
from benchmarks.overload import Outcome, one
from benchmarks.paths import BURSTGPT_SAMPLE, add_traces_option, traces_dir
from benchmarks.report import num
from benchmarks.reproduce_bfio import read_lengths
from core.admission import SloAdmission, tpot_slots
from core.perf import PerfProfile, get_profile
from core.slo import SLOClass

SLO = SLOClass()
"""The console's default class: TTFT 2 s, TPOT 100 ms."""
PROFILE = "h20-qwen3-32b"
"""`up`'s default profile."""
ATTAINMENT_C = 0.95
"""C is the highest load whose admission-off attainment is at least this."""


@dataclass
class Workload:
    """The fixed request sequence: unit-rate Poisson gaps, prompt and output lengths."""

    gaps: np.ndarray
    prompts: np.ndarray
    outputs: np.ndarray
    source: str
    left_out: float
    """Share of the trace's rows left out as infeasible alone."""

    def at(self, rate: float, duration_s: float) -> list[tuple[float, int, int]]:
        """(send offset s, prompt tokens, output tokens) of the arrivals within `duration_s` at `rate`/s."""
        times = np.cumsum(self.gaps) / rate
        n = int(np.searchsorted(times, duration_s))
        return [(float(times[k]), int(self.prompts[k]), int(self.outputs[k])) for k in range(n)]


def idle_ttft(p: PerfProfile, prompt: np.ndarray) -> np.ndarray:
    """The profile's TTFT of each prompt on an idle 1P1D: prefill alone, KV hand-off, one decode step."""
    after = p.kv_transfer_base_s + p.kv_transfer_per_token_s * prompt + p.decode_step_base_s
    after = after + p.decode_step_per_seq_s + p.decode_step_per_kv_token_s * prompt  # one decode step of it
    return np.asarray(p.prefill_time(prompt) + after)


def workload(path: Path, seed: int, max_output: int, p: PerfProfile, n: int = 20_000) -> Workload:
    prompts, outputs = read_lengths(path)
    feasible = idle_ttft(p, prompts.astype(float)) <= SLO.ttft_s
    rng = np.random.default_rng(seed)
    idx = rng.choice(np.flatnonzero(feasible), size=n)
    return Workload(
        gaps=rng.exponential(1.0, size=n),
        prompts=prompts[idx],
        outputs=np.minimum(outputs[idx], max_output),
        source=str(path),
        left_out=float(1 - feasible.mean()),
    )


def profile_rate(p: PerfProfile, w: Workload) -> float:
    """Requests/s the profile's 1P1D sustains on these lengths: the lesser of the prefill instance
    (mean prompt time, the step's fixed cost shared by none) and the decode instance at its slots."""
    prefill_rate = 1.0 / float(np.mean(p.prefill_time(w.prompts.astype(float))))
    slots = tpot_slots(p, SloAdmission().headroom * SLO.tpot_s, p.ps_context_tokens)
    decode_rate = slots / (float(np.mean(w.outputs)) * p.step_time(slots, slots * p.ps_context_tokens))
    return min(prefill_rate, decode_rate)


@dataclass
class Sent:
    out: Outcome
    lag_s: float
    """How late the client sent it against its scheduled arrival."""
    prompt: int


async def drive(
    url: str, token: str, arrivals: list[tuple[float, int, int]], patience_s: float
) -> tuple[list[Sent], list[dict[str, Any]], dict[str, Any]]:
    """Send every arrival on time; sample /control/state every 2 s. Returns what each got, the
    samples and the state at the end."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    auth = {"Authorization": f"Bearer {token}"}
    samples: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(patience_s), limits=limits) as client:

        async def sample() -> None:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    samples.append((await client.get(url + "/control/state", headers=auth, timeout=5)).json())
                await asyncio.sleep(2.0)

        async def send(k: int, prompt: int, output: int, lag: float) -> Sent:
            return Sent(await one(client, url, prompt, output, k, patience_s), lag, prompt)

        sampler = asyncio.create_task(sample())
        tasks = []
        start = time.monotonic()
        for k, (t, prompt, output) in enumerate(arrivals):
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            tasks.append(asyncio.create_task(send(k, prompt, output, time.monotonic() - start - t)))
        sent = list(await asyncio.gather(*tasks))
        sampler.cancel()
        final = (await client.get(url + "/control/state", headers=auth, timeout=10)).json()
    return sent, samples, final


def within_slo(o: Outcome) -> bool:
    return (
        o.status == 200
        and o.complete
        and o.ttft_s is not None
        and o.ttft_s <= SLO.ttft_s
        and (o.tpot_s or 0.0) <= SLO.tpot_s
    )


def summarize(label: str, mode: str, rate: float, sent: list[Sent]) -> dict[str, Any]:
    """The run's row (`detail`: each request's prompt, status, wait and TTFT, in sending order)."""
    outs = [s.out for s in sent]
    n = len(outs)
    refused = [o for o in outs if o.status in (429, 503)]
    answered = [o for o in outs if o.status == 200 and o.complete]
    met = sum(within_slo(o) for o in outs)
    admitted = n - len(refused)
    waits = np.array([o.wait_s for o in refused])
    return {
        "load": label,
        "rate": rate,
        "admission": mode,
        "requests": n,
        "refused": len(refused),
        "shed_429": sum(o.status == 429 for o in refused),
        "expired_503": sum(o.status == 503 for o in refused),
        "answered": len(answered),
        "within_slo": met,
        "gave_up": sum(o.timed_out for o in outs),
        "other": n - len(refused) - len(answered) - sum(o.timed_out for o in outs),
        "refused_share": len(refused) / n if n else 0.0,
        "answered_share": len(answered) / n if n else 0.0,
        "within_slo_share": met / n if n else 0.0,
        "attainment_admitted": met / admitted if admitted else None,
        "refusal_p99_s": float(np.percentile(waits, 99)) if len(waits) else None,
        "refusal_max_s": float(waits.max()) if len(waits) else None,
        "retry_after_all": all(o.retry_after for o in refused) if refused else None,
        "send_lag_max_s": max((s.lag_s for s in sent), default=0.0),
        "loadavg": os.getloadavg()[0],
        "detail": [
            [s.prompt, s.out.status, round(s.out.wait_s, 3), s.out.ttft_s and round(s.out.ttft_s, 3)] for s in sent
        ],
    }


def diagnose(samples: list[dict[str, Any]], final: dict[str, Any], stored: list[dict[str, Any]]) -> dict[str, Any]:
    """What admission refused by cause (projected vs bound), its measured drift, and the prefill
    instance's projected backlog beside its engine's waiting count over the run."""
    queue = final.get("queue") or {}
    adm = queue.get("admission") or {}
    causes = {c: r for c, r in (queue.get("refusals") or {}).items() if r.get("count")}
    prefill = [i for s in samples for i in s.get("instances", []) if i.get("role") == "prefill"]
    check: dict[str, Any] = next(
        (i.get("calibration", {}).get("check", {}) for i in final.get("instances", []) if i.get("role") == "prefill"),
        {},
    )
    reasons: dict[str, int] = {}
    for r in stored:
        if r["status"] != "ok":
            key = (r["reason"] or r["status"]).split(":")[0][:60]
            reasons[key] = reasons.get(key, 0) + 1
    return {
        "causes": causes,
        "held_unverified": adm.get("held_unverified"),
        "ttft_drift": (adm.get("ttft_drift_min"), adm.get("ttft_drift_max")),
        "ttft_wait_drift": (adm.get("ttft_wait_drift_min"), adm.get("ttft_wait_drift_max")),
        "backlog_max_s": max((i.get("backlog_s") or 0.0 for i in prefill), default=None),
        "waiting_max": max((i.get("waiting") or 0 for i in prefill), default=None),
        "prefill_check": check.get("prefill"),
        "store_reasons": reasons,
        "console_slo_met": sum(bool(r["slo_met"]) for r in stored if r["status"] == "ok"),
    }


def announced_run(home: Path, port: int, console: subprocess.Popen[bytes], timeout_s: float = 15) -> str:
    """The run id the console at `port` announced in `home` (it may answer /health a moment before)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and console.poll() is None:
        try:
            data = json.loads((home / "console.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.1)
            continue
        if not str(data.get("url", "")).rstrip("/").endswith(f":{port}"):
            raise RuntimeError(f"port {port} answered, but the console announced {data.get('url')}")
        return str(data["run_id"])
    raise RuntimeError(f"the console on port {port} announced no run in {home}")


def up_command(port: int, cfg: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "console.cli",
        "up",
        "--headless",
        "--port",
        str(port),
        str(cfg),
        "--prefill",
        "1",
        "--decode",
        "1",
    ]


def run_case(
    mode: str, rate: float, label: str, w: Workload, duration_s: float, a: argparse.Namespace
) -> dict[str, Any]:
    """One fresh console (admission `mode`), loaded at `rate` for `duration_s`; its row."""
    arrivals = w.at(rate, duration_s)
    patience = SLO.ttft_s + SLO.tpot_s * (a.max_output - 1) + 1.0
    with TemporaryDirectory() as tmp:
        home = Path(tmp)
        cfg = home / "console.toml"
        extra = "".join(f"{kv}\n" for kv in a.on_setting) if mode == "on" else ""
        cfg.write_text(f"[admission]\nenabled = {'true' if mode == 'on' else 'false'}\n{extra}")
        token = secrets.token_urlsafe(16)
        port = free_port()
        t0 = time.monotonic()
        console = start(up_command(port, cfg), console_env(home, token))
        try:
            wait_http(f"http://127.0.0.1:{port}/health", 90, console)
            run_id = announced_run(home, port, console)
            sent, samples, final = asyncio.run(drive(f"http://127.0.0.1:{port}", token, arrivals, patience))
        finally:
            stop(console)
        stored = RunStore(home / "runs.db").requests(run_id)
    row = summarize(label, mode, rate, sent)
    row["wall_s"] = time.monotonic() - t0
    row["diagnosis"] = diagnose(samples, final, stored)
    return row


def find_capacity(w: Workload, start: float, a: argparse.Namespace) -> tuple[float, list[dict[str, Any]]]:
    """The highest λ on the grid whose admission-off attainment (within SLO / all) is ≥ 95%."""
    grid: list[dict[str, Any]] = []
    passed: list[float] = []
    missed: list[float] = []

    def probe(rate: float) -> bool:
        row = run_case("off", rate, f"grid {rate:.2f}/s", w, a.grid_duration, a)
        ok = row["within_slo_share"] >= ATTAINMENT_C
        row["pass"] = ok
        grid.append(row)
        print(
            f"  λ {rate:5.2f}/s  n {row['requests']:>4}  attainment {row['within_slo_share']:6.1%}  "
            f"{'≥' if ok else '<'} 95%  ({row['wall_s']:.0f} s, load {row['loadavg']:.1f})",
            flush=True,
        )
        (passed if ok else missed).append(rate)
        return ok

    while len(grid) < a.grid_runs:
        lo = max(passed, default=None)
        hi = min((x for x in missed if lo is None or x > lo), default=None)
        if lo is not None and hi is not None:
            if hi / lo < 1.06:
                break
            probe(float(np.sqrt(lo * hi)))
        else:
            probe(lo * 1.25 if lo is not None else hi * 0.8 if hi is not None else start)
    if not passed:
        raise SystemExit(f"no load on the grid kept admission-off attainment ≥ 95% (lowest {min(missed):.2f}/s)")
    if not any(x > max(passed) for x in missed):
        print(f"  (no miss above {max(passed):.2f}/s within {a.grid_runs} runs: C is a lower bound)")
    return max(passed), grid


def refused_by_off(on: dict[str, Any], off: dict[str, Any]) -> str:
    """What admission-off did with the requests the on run refused (the same sequence, by position)."""
    pairs = [(a, b) for a, b in zip(on["detail"], off["detail"], strict=False) if a[1] in (429, 503)]
    served = sorted(b[3] for _, b in pairs if b[1] == 200 and b[3] is not None and b[3] <= SLO.ttft_s)
    span = f" (TTFT {served[0]:.2f}–{served[-1]:.2f} s)" if served else ""
    longest = max(a[0] for a, _ in pairs)
    return (
        f"off answered {len(served)} of the {len(pairs)} refused within the TTFT target{span}; "
        f"the longest refused prompt {longest} tokens"
    )


def verdicts(rows: list[dict[str, Any]]) -> dict[str, str]:
    by = {(r["load"], r["admission"]): r for r in rows}
    out: dict[str, str] = {}
    for (load, mode), on in by.items():
        if mode != "on":
            continue
        off = by.get((load, "off"))
        x = float(load.rstrip("C"))
        if x < 1:
            ok = on["refused_share"] <= 0.01
            out[load] = f"{'met' if ok else 'not met'}: {on['refused_share']:.1%} refused (≤ 1%)"
            if on["refused"] and off is not None:
                out[load] += "; " + refused_by_off(on, off)
        elif x < 2 and off is not None:
            ratio = on["answered_share"] / off["within_slo_share"] if off["within_slo_share"] else float("inf")
            ok = ratio >= 0.95
            out[load] = (
                f"{'met' if ok else 'not met'}: answered {on['answered_share']:.1%} = {ratio:.0%} of off's "
                f"{off['within_slo_share']:.1%} within SLO (≥ 95%)"
            )
        else:
            att = on["attainment_admitted"] or 0.0
            fast = on["refusal_max_s"] is None or on["refusal_max_s"] <= 1.0
            ra = on["retry_after_all"] is not False
            ok = att >= 0.9 and fast and ra
            out[load] = (
                f"{'met' if ok else 'not met'}: {att:.1%} of admitted within SLO (≥ 90%), refusals max "
                f"{num(on['refusal_max_s'], '.2f')} s (≤ 1), Retry-After {'on all' if ra else 'MISSING'}"
            )
    return out


HEADER = (
    f"{'load':<5} {'λ/s':>5} {'adm':<3} {'n':>4} {'refused':>7} {'answered':>8} {'in SLO':>7} {'att.adm':>7} "
    f"{'rej p99':>7} {'rej max':>7} {'RA':>3} {'gave up':>7} {'lag':>5} {'load':>5}"
)


def line(r: dict[str, Any]) -> str:
    ra = "-" if r["retry_after_all"] is None else ("all" if r["retry_after_all"] else "NO")
    return (
        f"{r['load']:<5} {r['rate']:>5.2f} {r['admission']:<3} {r['requests']:>4} {r['refused_share']:>7.1%} "
        f"{r['answered_share']:>8.1%} {r['within_slo_share']:>7.1%} {num(r['attainment_admitted'], '.1%'):>7} "
        f"{num(r['refusal_p99_s'], '.2f'):>7} {num(r['refusal_max_s'], '.2f'):>7} {ra:>3} {r['gave_up']:>7} "
        f"{r['send_lag_max_s']:>5.2f} {r['loadavg']:>5.1f}"
    )


def diagnosis_line(r: dict[str, Any]) -> str:
    d = r["diagnosis"]
    causes = (
        ", ".join(
            f"{c} {v['count']} (last projected {v['last_projected_s']:.2f} s vs bound {v['bound_s']:.2f} s)"
            for c, v in d["causes"].items()
        )
        or "none"
    )
    check = d["prefill_check"] or {}
    meas = f"prefill measured {check['measured_s']:.3f} s vs projected {check['projected_s']:.3f} s; " if check else ""
    return (
        f"      refused by cause: {causes}; held unverified {d['held_unverified']}; TTFT drift "
        f"{num(d['ttft_drift'][0], '.2f')}–{num(d['ttft_drift'][1], '.2f')} (own service), "
        f"{num(d['ttft_wait_drift'][0], '.2f')}–{num(d['ttft_wait_drift'][1], '.2f')} (queue); {meas}backlog max "
        f"{num(d['backlog_max_s'], '.2f')} s, engine waiting max {d['waiting_max']}; console slo_met "
        f"{d['console_slo_met']}"
    )


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
    signal.signal(signal.SIGTERM, _interrupt)  # the consoles are stopped on the way out either way
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run of about 2 minutes (short loads, 2 grid points)")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of load per run")
    ap.add_argument(
        "--grid-duration", type=float, help="seconds of load per grid run (default: --duration, the runs' own length)"
    )
    ap.add_argument("--grid-runs", type=int, default=5, help="at most this many grid runs to find C")
    ap.add_argument("--capacity", type=float, help="skip the grid: C in requests/s")
    ap.add_argument("--loads", default="0.8,1.2,2,3", help="multiples of C")
    ap.add_argument("--trace", type=Path, help=f"lengths file (default: TRACES/{BURSTGPT_SAMPLE})")
    add_traces_option(ap)
    ap.add_argument("--seed", type=int, default=37)
    ap.add_argument("--max-output", type=int, default=256, help="outputs clipped at this many tokens")
    ap.add_argument(
        "--on-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an [admission] line for the 'on' runs, for a what-if beside the defaults (e.g. headroom=1.0)",
    )
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    if a.quick:
        a.duration, a.grid_duration, a.grid_runs, a.max_output = 8.0, 8.0, 3, 64
    a.grid_duration = a.grid_duration or a.duration
    p = get_profile(PROFILE)
    w = workload(a.trace or traces_dir(a.traces) / BURSTGPT_SAMPLE, a.seed, a.max_output, p)
    mu = profile_rate(p, w)
    t_start = time.monotonic()
    settings = ", ".join(a.on_setting) or "default admission"
    print(
        f"{datetime.date.today()} · emulated 1P1D {PROFILE}, {settings}; load average at start "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)"
    )
    print(
        f"workload: Poisson arrivals (seed {a.seed}) over {w.source} lengths ({w.left_out:.1%} of its rows left out "
        f"as infeasible alone; prompt mean {w.prompts.mean():.0f}, output mean {w.outputs.mean():.0f} clipped at "
        f"{a.max_output}); SLO TTFT {SLO.ttft_s:g} s, TPOT {SLO.tpot_s * 1000:g} ms; profile rate {mu:.2f}/s",
        flush=True,
    )
    if a.capacity:
        cap, grid = a.capacity, list[dict[str, Any]]()
    else:
        print(f"finding C (admission off, {a.grid_duration:g} s per point):", flush=True)
        cap, grid = find_capacity(w, 0.6 * mu if a.quick else 0.5 * mu, a)
    print(f"C = {cap:.2f} requests/s ({time.monotonic() - t_start:.0f} s so far)\n{HEADER}", flush=True)
    rows: list[dict[str, Any]] = []
    for x in a.loads.split(","):
        for mode in ("off", "on"):
            row = run_case(mode, float(x) * cap, f"{x}C", w, a.duration, a)
            rows.append(row)
            print(line(row), flush=True)
            if mode == "on":
                print(diagnosis_line(row), flush=True)
    print("\nverdicts:")
    found = verdicts(rows)
    for load, v in found.items():
        print(f"  {load:<5} {v}")
    print(
        f"done in {time.monotonic() - t_start:.0f} s; load average at end "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    if a.json:
        a.json.write_text(json.dumps({"capacity": cap, "grid": grid, "rows": rows, "verdicts": found}, indent=2))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted: every console started here is stopped", file=sys.stderr)
        sys.exit(130)

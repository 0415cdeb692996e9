"""The soak's report: per-window rates, latency percentiles and RSS, drift and growth judged against the targets."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from benchmarks.report import md_header, md_row, num, to_ms

if TYPE_CHECKING:
    from benchmarks.soak import Cluster, Soak


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


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
        f"Soak: {c['prefill']}P{c['decode']}D emulated ({c['profile']}), {c['clients']} streaming clients, "
        f"{c['duration_s']:.0f} s (warm-up {c['warmup_s']:.0f} s, windows {c['window_s']:.0f} s), "
        f"max_tokens {c['max_tokens']}, prompt {c['prompt_tokens']} tokens"
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
        f"Totals: {t['requests']} requests ({t['req_per_s']:.1f}/s, {t['tokens_per_s']:.0f} tok/s; "
        f"{t['drained_after_deadline']} of them finished after the deadline, in no window), {t['errors']} errors"
        + (f" {t['error_reasons']}" if t["errors"] else ""),
        f"p99 drift (last vs first window after warm-up): E2E {_pc(d['e2e_p99'])}, TPOT {_pc(d['tpot_p99'])}"
        + (" (needs two windows after warm-up: pass a shorter --window-s)" if d["e2e_p99"] is None else ""),
        "RSS growth after warm-up: "
        + ", ".join(
            f"{n} {num(g['after_warmup_mib'], '.1f')}→{num(g['end_mib'], '.1f')} MiB ({_pc(g['growth'])})"
            for n, g in rep["rss_growth"].items()
        ),
        f"Stop: {rep['stop']['how']} (exit {rep['stop']['exit_code']}), "
        f"leftover processes: {rep['stop']['leftover'] or 'none'}",
        f"{rep['verdict']}"
        + (
            ": " + "; ".join(rep["failures"])
            if rep["failures"]
            else f" (errors ≤ {rep['targets']['max_errors']}, p99 drift ≤ {rep['targets']['max_p99_drift']:.0%}, "
            f"RSS growth ≤ {rep['targets']['max_rss_growth']:.0%})"
        ),
    ]
    return "\n".join(lines)

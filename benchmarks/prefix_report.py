"""The prefix sweep's report: each policy's metrics against least_load, the ideal and the oracle; issue 27's targets."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.prefix_cells import APPROX, BASELINE, OPERATING_POINT, OPERATING_POINTS, ORACLE, PRECISE
from benchmarks.report import by_cell, md_header, md_row


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _delta(x: float | None, base: float | None) -> float | None:
    return None if x is None or not base else x / base - 1


def table_rows(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> list[dict[str, Any]]:
    """Per cell and policy: the metrics and their comparisons (vs least_load, the ideal, the oracle)."""
    out = []
    for cell, pol in by_cell(rows).items():
        base = pol.get(BASELINE, {})
        oracle_hit = pol.get(ORACLE, {}).get("prefix_hit_rate")
        for p in policies:
            r = pol.get(p)
            if r is None:
                continue
            ideal = r.get("ideal_hit_rate") or 0.0
            hit = r.get("prefix_hit_rate") or 0.0
            out.append(
                {
                    "cell": cell,
                    "policy": p,
                    "ttft_p50": r["ttft_p50"],
                    "ttft_p99": r["ttft_p99"],
                    "ttft_mean": r["ttft_mean"],
                    "tpot_p99": r["tpot_p99"],
                    "hit_rate": hit,
                    "ideal_hit_rate": ideal,
                    "of_ideal": hit / ideal if ideal else None,
                    "of_oracle": hit / oracle_hit if oracle_hit else None,
                    "kv_transferred_share": r.get("kv_transferred_share"),
                    "d_ttft_p99": _delta(r["ttft_p99"], base.get("ttft_p99")),
                    "d_ttft_mean": _delta(r["ttft_mean"], base.get("ttft_mean")),
                    "d_tpot_p99": _delta(r["tpot_p99"], base.get("tpot_p99")),
                    "failed": r.get("failed"),
                }
            )
    return out


def targets(
    rows: Sequence[dict[str, Any]], cell: str = OPERATING_POINT.key, control: bool = True
) -> list[tuple[str, str, str, bool | None]]:
    """Issue 27's targets at an operating point (and on the control): (target, ours, detail, met)."""
    pol = by_cell(rows).get(cell, {})
    out: list[tuple[str, str, str, bool | None]] = []
    pre, app, ora, ll = (pol.get(k) for k in (PRECISE, APPROX, ORACLE, BASELINE))
    if pre and ora and ll:
        share = pre["prefix_hit_rate"] / ora["prefix_hit_rate"] if ora["prefix_hit_rate"] else None
        out.append(
            (
                "precise hit rate ≥ 90% of the oracle's",
                _pct(share),
                f"{pre['prefix_hit_rate']:.1%} vs {ora['prefix_hit_rate']:.1%}",
                None if share is None else share >= 0.9,
            )
        )
        for metric, need, what in (
            ("ttft_p99", -0.5, "P99 TTFT cut ≥ 50% vs least_load"),
            ("ttft_mean", -0.3, "mean TTFT cut ≥ 30% vs least_load"),
        ):
            d = _delta(pre[metric], ll[metric])
            out.append(
                (
                    what,
                    "-" if d is None else f"{-d:.0%}",
                    f"{fmt_s(pre[metric])} s vs {fmt_s(ll[metric])} s",
                    None if d is None else d <= need,
                )
            )
        d = _delta(pre["tpot_p99"], ll["tpot_p99"])
        out.append(
            (
                "P99 TPOT within +2% of least_load",
                "-" if d is None else f"{d:+.1%}",
                f"{fmt_s(pre['tpot_p99'] * 1e3)} ms vs {fmt_s(ll['tpot_p99'] * 1e3)} ms",
                None if d is None else d <= 0.02,
            )
        )
    if pre and app:
        gap = (pre["prefix_hit_rate"] - app["prefix_hit_rate"]) * 100
        out.append(
            (
                "approximate within 10 points of precise (hit rate)",
                f"{gap:.1f} points",
                f"{app['prefix_hit_rate']:.1%} vs {pre['prefix_hit_rate']:.1%}",
                gap <= 10,
            )
        )
    for c, cp in by_cell(rows).items() if control else ():
        if not c.startswith("azure-conv/") or BASELINE not in cp:
            continue
        base = cp[BASELINE]
        worst = ("", -math.inf, "")
        for p, r in cp.items():
            for m in ("ttft_p99", "ttft_mean", "tpot_p99"):
                d = _delta(r[m], base[m])
                if d is not None and d > worst[1]:
                    worst = (p, d, m)
        out.append(
            (
                f"{c}: no policy > 2% worse than least_load",
                f"{worst[1]:+.1%}",
                f"worst: {worst[0]} on {worst[2]}",
                worst[1] <= 0.02,
            )
        )
    return out


def markdown(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> str:
    lines = [
        "TTFT in s, P99 TPOT in ms; hit = prefill-side prefix hit rate; /ideal = hit / the ideal "
        "(every shared prefix reused); /oracle = hit / the oracle's; KV moved = KV tokens pulled "
        "P→D / prompt tokens; Δ = vs least_load.",
        "",
        *md_header(
            [
                "cell",
                "policy",
                "TTFT p50",
                "TTFT p99",
                "TTFT mean",
                "P99 TPOT",
                "hit",
                "/ideal",
                "/oracle",
                "KV moved",
                "ΔP99 TTFT",
                "Δmean TTFT",
                "ΔP99 TPOT",
                "failed",
            ],
            "ll" + "r" * 12,
        ),
    ]
    for r in table_rows(rows, policies):
        lines.append(md_row([
            r["cell"], r["policy"], fmt_s(r["ttft_p50"]), fmt_s(r["ttft_p99"]), fmt_s(r["ttft_mean"]),
            "-" if r["tpot_p99"] is None else f"{r['tpot_p99'] * 1e3:.2f}", _pct(r["hit_rate"]),
            _pct(r["of_ideal"]), _pct(r["of_oracle"]), _pct(r["kv_transferred_share"]),
            *("-" if r[k] is None else f"{r[k]:+.1%}" for k in ("d_ttft_p99", "d_ttft_mean", "d_tpot_p99")),
            r["failed"],
        ]))  # fmt: skip
    floor = [(c, next(iter(p.values()))) for c, p in by_cell(rows).items()]
    lines += [
        "",
        "Per cell: the ideal hit rate and the no-queue P99 prefill floor (s) with ideal reuse and without:",
        "",
        *md_header(["cell", "ideal hit", "floor P99 (ideal reuse)", "floor P99 (no reuse)"], "lrrr"),
    ]
    for c, r in floor:
        lines.append(
            md_row(
                [c, _pct(r.get("ideal_hit_rate")), fmt_s(r.get("floor_p99_s")), fmt_s(r.get("floor_p99_no_reuse_s"))]
            )
        )
    for k, op in enumerate(OPERATING_POINTS):
        tg = targets(rows, op.key, control=k == 0)
        if tg:
            lines += [
                "",
                f"Targets (issue 27) at {op.key}{' and on the control' if k == 0 else ''}:",
                "",
                *md_header(["target", "ours", "detail", "met"], "lrll"),
            ]
            for what, ours, detail, met in tg:
                lines.append(md_row([what, ours, detail, "-" if met is None else ("yes" if met else "no")]))
    return "\n".join(lines) + "\n"


def write_report(rows: Sequence[dict[str, Any]], out: Path, policies: Sequence[str]) -> tuple[Path, Path]:
    md, js = out.with_suffix(".md"), out.with_suffix(".json")
    md.write_text(markdown(rows, policies))
    js.write_text(
        json.dumps(
            {
                "rows": table_rows(rows, policies),
                "targets": {
                    op.key: [
                        dict(zip(("target", "ours", "detail", "met"), t, strict=True))
                        for t in targets(rows, op.key, control=k == 0)
                    ]
                    for k, op in enumerate(OPERATING_POINTS)
                },
            },
            indent=1,
            default=str,
        )
        + "\n"
    )
    return md, js

"""How `runs show` prints a run's policy timeline and decision quality, with each pool's when it ran several."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table


def run_pools(events: Sequence[Mapping[str, Any]], summary: Mapping[str, Any] | None) -> list[str]:
    """The pools a run had, when it had several (its summary's, else those its policy events name, in order of first
    appearance); [] for a run of one pool, or one recorded before pools were (schema 10)."""
    named = list(dict.fromkeys(str(e["pool"]) for e in events if e.get("pool") is not None))
    summarized = list((summary or {}).get("pools") or {})
    pools = summarized + [p for p in named if p not in summarized]
    return pools if len(pools) > 1 else []


def timeline_table(events: Sequence[Mapping[str, Any]], *, by_pool: bool) -> Table:
    """The policy timeline: a row per policy event; with `by_pool`, the pool whose policy it was ("-": not recorded)."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="policy timeline")
    for col in ("t (s)", *(("pool",) if by_pool else ()), "kind", "old", "new", "params", "source"):
        t.add_column(col)
    for e in events:
        pool = (escape(e.get("pool") or "-"),) if by_pool else ()
        t.add_row(f"{e['t']:.2f}", *pool, e["kind"], e["old"] or "-", e["new"], json.dumps(e["params"]), e["source"])
    return t


def quality_lines(q: Mapping[str, Any] | None) -> list[str]:
    """Decision quality as `runs show` prints it (a live run's summary keeps it)."""
    if not q:
        return []
    out = []
    if q.get("decode_scored"):
        out.append(
            f"decision quality: {q['decode_still_best']:.1%} of {q['decode_scored']} decode choices were still the "
            "least loaded instance when decoding began"
        )
    if q.get("prefix_decisions"):
        share = q.get("prefix_hit_share")
        out.append(
            f"prefix hits: {q['prefix_achieved_tokens']} of {q['prefix_achievable_tokens']} "
            f"achievable cached tokens achieved ({'-' if share is None else f'{share:.1%}'}) "
            f"over {q['prefix_decisions']} requests with prefix keys"
        )
    rec = q.get("records")
    if rec:
        out.append(
            f"decision records: {rec['records']} for {rec['requests_sampled']} requests (sample_rate "
            f"{rec['sample_rate']}, at most {rec['max_per_s']}/s; left out {rec['skipped_by_rate']} by "
            f"the rate, {rec['skipped_by_bound']} over the bound); `runs why RUN REQUEST_ID` shows them"
        )
    return out


def run_quality_lines(summary: Mapping[str, Any] | None) -> list[str]:
    """A run's decision quality: each pool's, headed by the pool's name and model, when its summary has several
    (`pools`); else the run's (`decision_quality`, the first pool's)."""
    pools: Mapping[str, Any] = (summary or {}).get("pools") or {}
    if len(pools) < 2:
        return quality_lines((summary or {}).get("decision_quality"))
    out = []
    for name, pool in pools.items():
        model = f" (model {pool['model']})" if pool.get("model") not in (None, name) else ""
        lines = quality_lines(pool.get("decision_quality"))
        out.append(f"pool {name}{model}:" + ("" if lines else " no decisions scored"))
        out.extend(f"  {line}" for line in lines)
    return out

"""Read a vLLM (or emulator) `/metrics` page: the numbers the console samples, histograms and counters as deltas."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from core.calibration.online import HistogramDelta


@dataclass
class MetricsSample:
    """One scrape of one instance; token totals are cumulative counters."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prompt_tokens_total: float = 0.0
    generation_tokens_total: float = 0.0
    preemptions_total: float = 0.0
    success_total: float = 0.0
    failed_transfers_total: float = 0.0
    prefix_cache_queries_total: float = 0.0
    """Prompt tokens looked up in the instance's prefix cache (vllm:prefix_cache_queries)."""
    prefix_cache_hits_total: float = 0.0
    """Prompt tokens found there (vllm:prefix_cache_hits)."""
    lora_running: tuple[str, ...] | None = None
    """The adapters its latest step ran under (`running_lora_adapters` of vllm:lora_requests_info's newest
    series); None: the instance exports no LoRA info (not started with --enable-lora)."""
    lora_at: float = 0.0
    """When that step ran (the series' value: vLLM sets it to the wall-clock time)."""


_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
_COUNTERS = {
    "vllm:prompt_tokens": "prompt_tokens_total",
    "vllm:generation_tokens": "generation_tokens_total",
    "vllm:num_preemptions": "preemptions_total",
    "vllm:request_success": "success_total",
    "vllm:nixl_num_failed_transfers": "failed_transfers_total",
    "vllm:prefix_cache_queries": "prefix_cache_queries_total",
    "vllm:prefix_cache_hits": "prefix_cache_hits_total",
}


LORA_INFO = "vllm:lora_requests_info"
"""vLLM's LoRA gauge: one series per (max_lora, waiting_lora_adapters, running_lora_adapters) ever seen, each
set to the wall-clock time of the last step that ran with those values (the newest is the current one)."""

_SAMPLES = {
    **{name: attr for name, attr in _GAUGES.items()},
    **{f"{name}_total": attr for name, attr in _COUNTERS.items()},
}
"""The sample names read (a counter family `x` exposes its value as `x_total`) and their fields."""


def parse_metrics(text: str) -> MetricsSample:
    """Sum each series over its labels (engines, finish reasons) into one sample.

    Reads only the lines of the series it needs: a vLLM page has hundreds of histogram lines, and
    the console parses one page per instance twice a second on the loop that serves traffic (the
    generic Prometheus parser spent ~50% of that loop at 64 instances). Lines follow the text
    exposition format: `name{labels} value [timestamp]`; label values may hold spaces and braces."""
    totals: dict[str, float] = {}
    wanted = _SAMPLES
    lora: tuple[float, str] | None = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        end = line.find("{")
        if end < 0:
            end = line.find(" ")
        attr = wanted.get(line[:end])
        if attr is None:
            if line[:end] == LORA_INFO and end > 0 and line[end] == "{":
                at = _value(line, end)
                if lora is None or at >= lora[0]:
                    lora = (at, _label(line, end, "running_lora_adapters") or "")
            continue
        rest = line[line.rfind("}") + 1 :] if line[end] == "{" else line[end:]
        fields = rest.split()
        if not fields:
            raise ValueError(f"metrics line without a value: {line[:200]!r}")
        totals[attr] = totals.get(attr, 0.0) + float(fields[0])
    sample = MetricsSample()
    for attr, total in totals.items():
        setattr(sample, attr, total)
    if lora is not None:
        sample.lora_at = lora[0]
        sample.lora_running = tuple(a for a in lora[1].split(",") if a)
    return sample


# --- histograms and labelled counters, read as deltas between scrapes (the online fitter's input) ---

INF = float("inf")


@dataclass(frozen=True)
class Histogram:
    """One scrape of a histogram family, summed over its series (engines, models): observations,
    their sum, and the cumulative count at each `le` bound (ascending, +inf last)."""

    count: float
    total: float
    buckets: tuple[tuple[float, float], ...]


def _value(line: str, brace: int) -> float:
    rest = line[line.rfind("}") + 1 :] if brace >= 0 else line[line.find(" ") :]
    fields = rest.split()
    if not fields:
        raise ValueError(f"metrics line without a value: {line[:200]!r}")
    return float(fields[0])


def _label(line: str, brace: int, name: str) -> str | None:
    """The value of label `name` on a sample line (an escaped quote inside another value cannot
    end this search: it is preceded by a backslash)."""
    if brace < 0:
        return None
    for sep in ("{", ","):
        at = line.find(f'{sep}{name}="', brace)
        if at >= 0:
            start = at + len(name) + 3
            return line[start : line.find('"', start)]
    return None


def read_histograms(text: str, names: Iterable[str]) -> dict[str, Histogram]:
    """The histograms `names` (family names, e.g. "vllm:request_prefill_time_seconds") of a
    /metrics page, each summed over its series; a family the page lacks is absent from the result.

    Like `parse_metrics`, it reads only the lines of the families it needs (a page has hundreds)."""
    wanted = set(names)
    acc: dict[str, tuple[float, float, dict[float, float]]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        sample = line[:brace] if brace >= 0 else line[: line.find(" ")]
        family, _, suffix = sample.rpartition("_")
        if family not in wanted or suffix not in ("bucket", "sum", "count"):
            continue
        count, total, buckets = acc.get(family, (0.0, 0.0, {}))
        value = _value(line, brace)
        if suffix == "count":
            count += value
        elif suffix == "sum":
            total += value
        else:
            le = _label(line, brace, "le")
            if le is None:
                raise ValueError(f"histogram bucket without an le label: {line[:200]!r}")
            bound = float(le)  # "+Inf" parses as inf
            buckets[bound] = buckets.get(bound, 0.0) + value
        acc[family] = (count, total, buckets)
    return {f: Histogram(c, s, tuple(sorted(b.items()))) for f, (c, s, b) in acc.items()}


def read_counters(text: str, names: Iterable[str], by: str | None = None) -> dict[str, dict[str, float]]:
    """Counter families `names` (without `_total`) summed over their series, split by the value of
    label `by` when given ("" when a series lacks it; everything under "" when `by` is None)."""
    wanted = {f"{n}_total": n for n in names}
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        family = wanted.get(line[:brace] if brace >= 0 else line[: line.find(" ")])
        if family is None:
            continue
        key = (_label(line, brace, by) or "") if by else ""
        split = out.setdefault(family, {})
        split[key] = split.get(key, 0.0) + _value(line, brace)
    return out


def counter_delta(before: float | None, after: float) -> float:
    """A counter's increase between two scrapes; after a reset (engine restart: it went down) the
    increase is what it counted since, its value now. Never negative."""
    if before is None or after < before:
        return max(after, 0.0)
    return after - before


def histogram_delta(before: Histogram | None, after: Histogram) -> HistogramDelta:
    """What a histogram observed between two consecutive scrapes: (count, sum, cumulative bucket)
    deltas. A reset between them (the engine restarted: its count, sum or a bucket went down, or
    its buckets changed) makes the delta the later scrape itself, everything since the restart;
    no delta is ever negative. `before` None (first scrape of the instance): the later scrape."""
    reset = (
        before is None
        or after.count < before.count
        or after.total < before.total
        or [b for b, _ in after.buckets] != [b for b, _ in before.buckets]
        or any(a < b for (_, a), (_, b) in zip(after.buckets, before.buckets, strict=True))
    )
    if reset or before is None:
        buckets = tuple((b, max(c, 0.0)) for b, c in after.buckets)
        return HistogramDelta(max(after.count, 0.0), max(after.total, 0.0), buckets)
    return HistogramDelta(
        after.count - before.count,
        after.total - before.total,
        tuple((b, a - p) for (b, a), (_, p) in zip(after.buckets, before.buckets, strict=True)),
    )

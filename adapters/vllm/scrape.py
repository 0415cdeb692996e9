"""Parse a vLLM (or emulator) `/metrics` page into the numbers the console samples."""

from __future__ import annotations

from dataclasses import dataclass


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
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        end = line.find("{")
        if end < 0:
            end = line.find(" ")
        attr = wanted.get(line[:end])
        if attr is None:
            continue
        rest = line[line.rfind("}") + 1 :] if line[end] == "{" else line[end:]
        fields = rest.split()
        if not fields:
            raise ValueError(f"metrics line without a value: {line[:200]!r}")
        totals[attr] = totals.get(attr, 0.0) + float(fields[0])
    sample = MetricsSample()
    for attr, total in totals.items():
        setattr(sample, attr, total)
    return sample

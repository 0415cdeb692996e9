"""Parse a vLLM (or emulator) `/metrics` page into the numbers the console samples."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


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
}


def parse_metrics(text: str) -> MetricsSample:
    """Sum each series over its labels (engines, finish reasons) into one sample."""
    sample = MetricsSample()
    for family in text_string_to_metric_families(text):
        attr = _GAUGES.get(family.name) or _COUNTERS.get(family.name)
        if attr is None:
            continue
        total = 0.0
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            total += s.value
        setattr(sample, attr, total)
    return sample

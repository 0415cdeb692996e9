"""The fast `/metrics` reader agrees with prometheus_client's own parser on vLLM-shaped pages."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from adapters.vllm.scrape import _COUNTERS, _GAUGES, MetricsSample, parse_metrics


def reference(text: str) -> MetricsSample:
    """What the console read before: every family through prometheus_client's parser, summed over labels."""
    sample = MetricsSample()
    for family in text_string_to_metric_families(text):
        attr = _GAUGES.get(family.name) or _COUNTERS.get(family.name)
        if attr is not None:
            setattr(sample, attr, sum(s.value for s in family.samples if not s.name.endswith("_created")))
    return sample


def vllm_page(seed: int) -> str:
    """A page shaped like vLLM's: labelled gauges and counters, histograms, awkward label values."""
    rng = random.Random(seed)
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    models = ["tiny llama", 'we{ird}"name', "m"]
    for name in _GAUGES:
        g = Gauge(name, "g", labels, registry=reg)
        for m in models[: rng.randint(1, 3)]:
            g.labels(m, str(rng.randint(0, 3))).set(rng.uniform(0, 100))
    for name in _COUNTERS:
        c = Counter(name, "c", [*labels, "finished_reason"], registry=reg)
        for reason in ("stop", "length"):
            c.labels(models[0], "0", reason).inc(rng.randint(0, 10**6))
    h = Histogram("vllm:time_to_first_token_seconds", "h", labels, registry=reg)
    for _ in range(20):
        h.labels(models[1], "0").observe(rng.random())
    Gauge("vllm:num_requests_running_but_not_this", "decoy", registry=reg).set(99)
    Counter("process_cpu_seconds", "other", registry=reg).inc(5)
    return generate_latest(reg).decode()


@pytest.mark.parametrize("seed", range(20))
def test_the_fast_reader_matches_the_prometheus_parser(seed: int) -> None:
    page = vllm_page(seed)
    assert parse_metrics(page) == reference(page)


def test_a_page_without_the_series_reads_as_zero_and_a_line_without_value_is_an_error() -> None:
    assert parse_metrics("# HELP x\nprocess_cpu_seconds_total 5\n") == MetricsSample()
    assert parse_metrics('vllm:num_requests_running{a="b"} 3 1700000000000\n').running == 3
    with pytest.raises(ValueError, match="without a value"):
        parse_metrics('vllm:num_requests_waiting{a="b"}\n')


def test_prefix_cache_counters_are_read() -> None:
    page = (
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 120.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 48.0\n'
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 999.0\n'
    )
    s = parse_metrics(page)
    assert (s.prefix_cache_queries_total, s.prefix_cache_hits_total) == (120.0, 48.0)

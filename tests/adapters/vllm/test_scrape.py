"""The fast `/metrics` readers agree with prometheus_client's parser on vLLM-shaped pages; deltas between scrapes."""

from __future__ import annotations

import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from adapters.emulator.metrics import EngineMetrics
from adapters.vllm.scrape import (
    _COUNTERS,
    _GAUGES,
    MetricsSample,
    counter_delta,
    histogram_delta,
    parse_metrics,
    read_counters,
    read_histograms,
)


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


# --- histogram and counter deltas between scrapes (the online fitter's input) ---


class _Engine:
    """What EngineMetrics reads from a scheduler: an idle engine."""

    running: list[object] = []
    waiting = 0
    kv_usage = 0.0
    block_size = 16
    total_blocks = 64
    on_step = on_finish = on_preempt = None


def _emulator_metrics() -> Any:
    return EngineMetrics("m", _Engine(), max_model_len=1024)  # type: ignore[arg-type]


def _page(m: Any) -> str:
    return generate_latest(m.registry).decode()


PREFILL = "vllm:request_prefill_time_seconds"
PROMPT = "vllm:request_prompt_tokens"
ITERATION = "vllm:iteration_tokens_total"


def test_histograms_read_from_an_emulator_page_match_the_prometheus_parser() -> None:
    m = _emulator_metrics()
    for v in (0.2, 0.4, 0.9, 3.0, 9000.0):
        m.prefill.observe(v)
    for n in (3, 40, 700):
        m.req_prompt.observe(n)
    page = _page(m)
    got = read_histograms(page, [PREFILL, PROMPT, ITERATION, "vllm:not_there"])
    assert set(got) == {PREFILL, PROMPT, ITERATION}
    ref = {f.name: f for f in text_string_to_metric_families(page)}[PREFILL]
    buckets = tuple((float(s.labels["le"]), s.value) for s in ref.samples if s.name.endswith("_bucket"))
    assert got[PREFILL].buckets == tuple(sorted(buckets))
    assert got[PREFILL].count == 5 and got[PREFILL].total == pytest.approx(9004.5)
    assert got[PREFILL].buckets[-1] == (float("inf"), 5.0)
    assert got[PROMPT].total == 743 and got[ITERATION].count == 0


def test_a_histogram_delta_is_what_was_observed_between_two_scrapes() -> None:
    m = _emulator_metrics()
    m.prefill.observe(0.4)
    before = read_histograms(_page(m), [PREFILL])[PREFILL]
    m.prefill.observe(0.7)
    m.prefill.observe(12.0)
    after = read_histograms(_page(m), [PREFILL])[PREFILL]
    d = histogram_delta(before, after)
    assert (d.count, d.total) == (2, pytest.approx(12.7))
    cumulative = dict(d.buckets)
    assert (cumulative[0.5], cumulative[0.8], cumulative[15.0], cumulative[float("inf")]) == (0, 1, 2, 2)
    assert histogram_delta(None, after).count == 3  # the first scrape: everything so far


def test_an_engine_restart_reads_as_a_reset_never_as_a_negative_delta() -> None:
    old = _emulator_metrics()
    for v in (0.4, 0.7, 12.0):
        old.prefill.observe(v)
    before = read_histograms(_page(old), [PREFILL])[PREFILL]
    new = _emulator_metrics()  # the restarted engine counts from zero
    new.prefill.observe(0.9)
    after = read_histograms(_page(new), [PREFILL])[PREFILL]
    d = histogram_delta(before, after)
    assert (d.count, d.total) == (1, pytest.approx(0.9))
    assert all(c >= 0 for _, c in d.buckets) and dict(d.buckets)[1.0] == 1
    assert counter_delta(120.0, 30.0) == 30.0 and counter_delta(30.0, 120.0) == 90.0 and counter_delta(None, 5.0) == 5.0


def test_labelled_counters_are_split_by_label() -> None:
    m = _emulator_metrics()
    m.prompt_local.inc(100)
    m.prompt_external.inc(300)
    m.generation_tokens.inc(7)
    page = _page(m)
    by = read_counters(page, ["vllm:prompt_tokens_by_source"], by="source")["vllm:prompt_tokens_by_source"]
    assert by == {"local_compute": 100, "local_cache_hit": 0, "external_kv_transfer": 300}
    assert read_counters(page, ["vllm:generation_tokens"]) == {"vllm:generation_tokens": {"": 7}}
    with pytest.raises(ValueError, match="without an le label"):
        read_histograms(f"{PREFILL}_bucket{{a=\"b\"}} 3\n", [PREFILL])

"""An instance's prefix hit rate and cached share come from its own counters over a trailing window."""

from __future__ import annotations

from adapters.vllm.instances import CACHE_WINDOW_S, Instance
from adapters.vllm.scrape import MetricsSample
from core.types import Role


def sample(hits: float, queries: float, prompts: float) -> MetricsSample:
    return MetricsSample(prefix_cache_hits_total=hits, prefix_cache_queries_total=queries, prompt_tokens_total=prompts)


def test_rates_follow_the_deltas_of_the_last_window() -> None:
    inst = Instance("p0", Role.PREFILL, "http://127.0.0.1:1")
    assert inst.prefix_hit_rate is None and inst.cached_share is None  # nothing looked up yet
    inst.update(sample(0, 0, 0), now=100.0)
    inst.update(sample(300, 1000, 1000), now=101.0)  # 300 of 1000 tokens hit
    inst.update(sample(500, 1500, 1500), now=102.0)  # then 200 of 500
    assert inst.prefix_hit_rate == 500 / 1500 and inst.cached_share == 500 / 1500
    inst.update(sample(500, 1500, 2500), now=103.0)  # 1000 prompt tokens that were not looked up here (pulled)
    assert inst.prefix_hit_rate == 500 / 1500 and inst.cached_share == 500 / 2500
    inst.update(sample(1500, 2500, 3500), now=103.0 + CACHE_WINDOW_S + 1.5)  # the old deltas left the window
    assert inst.prefix_hit_rate == 1.0 and inst.cached_share == 1.0
    inst.update(sample(1500, 2500, 3500), now=103.0 + 3 * CACHE_WINDOW_S)
    assert inst.prefix_hit_rate is None  # a quiet window says nothing

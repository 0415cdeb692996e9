"""Constructed windows for the advisor's tests: a shared-prefix workload whose prefill pool queues."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from console.advisor.window import RecentArrivals, Window, window_from_rows
from core.perf import PerfProfile, get_profile
from core.slo import SLOClass

BLOCK = 16


def prefix_rows(
    n: int = 300, groups: int = 12, rate: float = 20.0, prefix_blocks: int = 128, seed: int = 1
) -> tuple[list[dict[str, Any]], RecentArrivals]:
    """`n` Poisson arrivals at `rate`/s, each a 2 112-token prompt: one of `groups` shared 2 048-token
    prefixes and a 64-token suffix of its own; rows as the run store holds them, keys as the gateway notes them."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / rate, n))
    rows: list[dict[str, Any]] = []
    keys = RecentArrivals()
    for i, t in enumerate(times.tolist()):
        g = int(rng.integers(groups))
        chain = [10_000 * (g + 1) + b for b in range(prefix_blocks)] + [10_000_000 + 100 * i + b for b in range(4)]
        rows.append(
            {
                "request_id": f"r{i}",
                "arrival": t,
                "prompt_tokens": BLOCK * len(chain),
                "output_tokens": 32,
                "max_tokens": 32,
                "status": "ok",
                "prefill_start": t,
                "first_token": t + 0.1,
                "finish": t + 1.0,
                "ttft": 0.1,
                "tpot": 0.03,
                "slo_met": True,
                "cached_tokens": None,
                "slo_class": "default",
                "tenant": "default",
                "priority": 0,
            }
        )
        keys.note(f"r{i}", chain, f"conversation-{g}")
    return rows, keys


@pytest.fixture(scope="session")
def small_cache_profile() -> PerfProfile:
    """An H100 profile whose KV cache holds ~7 of the 12 prefixes per instance: where a request lands decides
    whether its prefix is computed again."""
    return get_profile("roofline-h100-qwen2.5-7b").model_copy(update={"kv_capacity_tokens": BLOCK * 1000})


@pytest.fixture(scope="session")
def prefix_window() -> Window:
    rows, keys = prefix_rows()
    return window_from_rows(
        rows,
        run_id="r-test",
        end=rows[-1]["arrival"],
        window_s=rows[-1]["arrival"] + 1.0,
        active={"routing": ("least_load", {}), "queue": ("fcfs", {})},
        slos={"default": SLOClass(ttft_s=0.5, tpot_s=0.1)},
        keys=keys,
        cluster="2P2D",
    )

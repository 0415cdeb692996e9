"""Synthetic workloads: the reasoning workloads' length moments, the uniform random workload, seeded traces."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import TraceError
from core.traces import OUTPUT_CAP, WORKLOADS, synthetic_lengths, synthetic_trace


@pytest.mark.parametrize(
    ("workload", "prompt_mean", "prompt_range", "out_mean", "out_std", "capped"),
    [
        ("reasoning-chat", 183.0, (4, 1024), 5657.0, 3317.0, 0.573),
        ("reasoning-code", 345.0, (1, 1700), 6500.0, 2600.0, 0.619),
    ],
)
def test_reasoning_workload_moments(
    workload: str,
    prompt_mean: float,
    prompt_range: tuple[int, int],
    out_mean: float,
    out_std: float,
    capped: float,
) -> None:
    prompts, outputs = synthetic_lengths(workload, 200_000, np.random.default_rng(0))
    assert prompts.dtype == np.int64 and outputs.dtype == np.int64
    assert prompts.mean() == pytest.approx(prompt_mean, rel=0.03)
    assert outputs.mean() == pytest.approx(out_mean, rel=0.03)
    assert outputs.std() == pytest.approx(out_std, rel=0.03)
    assert prompt_range[0] <= prompts.min() and prompts.max() <= prompt_range[1]
    assert outputs.min() >= 1 and outputs.max() == OUTPUT_CAP
    assert float(np.mean(outputs == OUTPUT_CAP)) == pytest.approx(capped, abs=0.01)


def test_random_workload_is_uniform_and_synthetic_trace_is_seeded() -> None:
    prompts, outputs = synthetic_lengths("random", 100_000, np.random.default_rng(1))
    assert (prompts.min(), prompts.max()) == (1, 512)
    assert (outputs.min(), outputs.max()) == (1, 8192)
    assert prompts.mean() == pytest.approx(256.5, rel=0.01)
    assert outputs.mean() == pytest.approx(4096.5, rel=0.01)
    assert set(WORKLOADS) == {"random", "reasoning-chat", "reasoning-code"}

    a = synthetic_trace("reasoning-chat", requests=5_000, rate=10.0, seed=4)
    b = synthetic_trace("reasoning-chat", requests=5_000, rate=10.0, seed=4)
    slower = synthetic_trace("reasoning-chat", requests=5_000, rate=2.0, seed=4, burstiness=0.5)
    c = synthetic_trace("reasoning-chat", requests=5_000, rate=10.0, seed=5)
    assert a.name == "synthetic:reasoning-chat" and "rate=10" in a.source and "seed=4" in a.source
    assert np.array_equal(a.arrivals, b.arrivals) and np.array_equal(a.output_tokens, b.output_tokens)
    assert np.array_equal(a.output_tokens, slower.output_tokens)  # lengths independent of arrivals
    assert not np.array_equal(a.output_tokens, c.output_tokens)
    assert a.arrivals[0] == 0.0 and a.mean_rate() == pytest.approx(10.0, rel=0.05)
    assert slower.mean_rate() == pytest.approx(2.0, rel=0.05)
    with pytest.raises(TraceError, match="unknown synthetic workload"):
        synthetic_trace("sharegpt", requests=1, rate=1.0)

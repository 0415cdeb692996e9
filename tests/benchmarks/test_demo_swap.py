"""The figures benchmarks/demo_swap.py reports: the ideal hit of a lap and a phase's shed share."""

from __future__ import annotations

import numpy as np

from benchmarks.demo_swap import ideal_hit, phase_row
from core.traces import Trace


def test_ideal_hit_counts_leading_blocks_seen_before_capped_as_vllm_caps_a_hit() -> None:
    # 32-token hash blocks: row 1 repeats row 0's two blocks then adds one; row 2 shares only the
    # first; row 3 repeats all of row 1 (its whole prompt: the hit stops at whole blocks of prompt - 1)
    trace = Trace(
        "t",
        arrivals=[0.0, 1.0, 2.0, 3.0],
        prompt_tokens=[64, 96, 64, 96],
        output_tokens=[1, 1, 1, 1],
        hash_ids=[[1, 2], [1, 2, 3], [1, 9], [1, 2, 3]],
    )
    prompts = np.array([64, 96, 64, 96])
    got = ideal_hit(trace, prompts, hash_block_tokens=32)
    assert got.tolist() == [0, 64, 32, 80]  # row 3: 96 cached, capped at (96 - 1) // 16 * 16 = 80


def test_phase_row_takes_the_last_readings_and_the_shed_share_of_the_whole_phase() -> None:
    samples = [
        {
            "t": t,
            "policy": p,
            "prefill_hit_rate": h,
            "ttft_p50": 0.1,
            "replay_ttft_p50": None,
            "attainment": a,
            "finished": f,
            "shed": s,
        }
        for t, p, h, a, f, s in [
            (0.0, "least_load", 0.1, 0.9, 100, 10),
            (30.0, "least_load", 0.2, 0.8, 150, 20),
            (60.0, "least_load", 0.4, 0.6, 200, 30),
            (65.0, "prefix_aware", 0.5, 0.7, 210, 30),
        ]
    ]
    row = phase_row(samples, "least_load", 30.0)
    assert row["policy"] == "least_load"
    assert abs(row["prefill_hit_rate"] - 0.3) < 1e-12 and abs(row["attainment"] - 0.7) < 1e-12  # t >= 30
    assert abs(row["shed_share"] - 20 / 100) < 1e-12  # 20 more shed of 100 more finished
    assert row["replay_ttft_p50"] is None
    assert phase_row(samples, "prefix_aware", 30.0)["shed_share"] is None  # nothing finished in one reading

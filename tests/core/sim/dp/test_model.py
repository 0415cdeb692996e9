"""The DP decode group's model: step time, imbalance, idle share and energy on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from core.sim.dp.model import PAPER_T_TOK_S, DPGroup, PowerModel, idle_fraction, imbalance


def test_imbalance_idle_and_energy_on_a_hand_computed_case() -> None:
    loads = np.array([10, 4, 7])
    assert imbalance(loads) == 3 * 10 - 21 == 9
    assert idle_fraction(loads) == pytest.approx((0 + 0.6 + 0.3) / 3)
    assert idle_fraction(loads) == pytest.approx(imbalance(loads) / (3 * 10))
    assert imbalance(np.array([5, 5])) == 0 and idle_fraction(np.zeros(3)) == 0.0
    watts = PowerModel().rank_power_w(np.array([0, 5, 10]))
    assert watts == pytest.approx([100.0, 100.0 + 300.0 * 0.5**0.7, 400.0])
    assert PowerModel().step_energy_j(np.array([0, 5, 10]), 0.5) == pytest.approx(watts.sum() * 0.5)


def test_step_time_is_overhead_plus_per_token_times_the_straggler() -> None:
    group = DPGroup(ranks=2, slots=4, overhead_s=0.005, t_tok_s=1e-6)
    assert group.step_time(np.array([100, 300])) == pytest.approx(0.005 + 300e-6)
    paper = DPGroup.paper(16, 72)
    assert paper.overhead_s == pytest.approx((0.6e-3 * 72 + 35e-3) / 16)  # 4.89 ms
    assert paper.t_tok_s == PAPER_T_TOK_S == pytest.approx(1.5 * 2 * 576 * 61e-6 / 2**20)
    with pytest.raises(ValueError):
        DPGroup(ranks=0, slots=4, overhead_s=0.0, t_tok_s=0.0)

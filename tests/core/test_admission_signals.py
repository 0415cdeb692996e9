"""What SLO admission learns, on constructed sequences: the TTFT correction follows as far as its samples
back it, in log space; the decode slots grow and shrink by what is measured and reported."""

from __future__ import annotations

import math

import pytest

from core.admission_signals import DecodeSlots, TtftDrift


def test_each_sample_backs_a_factor_of_root_two_until_the_correction_is_free() -> None:
    drift = TtftDrift()
    ratios, settled = [], []
    for _ in range(16):
        drift.observe(0, 1.0, 0.01)  # the engine is 100× faster than projected
        ratios.append(float(drift.of(1)[0]))
        settled.append(drift.settled(0))
    assert ratios[:3] == pytest.approx([2**-0.5, 2**-1.0, 2**-1.5])
    assert settled.index(True) == 13  # 13 samples back 2^6.5 ≈ 91× at most, 14 back 128×
    assert ratios[-1] == pytest.approx(0.01)


def test_one_outlier_moves_the_correction_by_a_factor_not_to_it() -> None:
    drift = TtftDrift()
    for _ in range(40):
        drift.observe(0, 0.5, 0.5)
    drift.observe(0, 0.5, 50.0)  # one request 100× late
    assert float(drift.of(1)[0]) == pytest.approx(math.exp(0.05 * math.log(100)))  # ×1.26
    assert drift.settled(0)


def test_an_instance_with_no_samples_is_projected_as_is_and_not_settled() -> None:
    drift = TtftDrift()
    drift.observe(1, 0.0, 0.3)  # nothing projected: ignored
    assert list(drift.of(3)) == [1.0, 1.0, 1.0] and not drift.settled(1) and not drift.settled(7)


def test_decode_slots_grow_only_while_they_hold_arrivals_back_and_tpot_is_within_target() -> None:
    slots = DecodeSlots(10, 256, fixed=False, grow_below=0.8)
    for k in range(8):
        slots.observe(0.05, 0.1, False, float(k))
    assert slots.value == 10  # not what held anything back
    slots.limited = True
    slots.observe(0.05, 0.1, False, 8.0)
    slots.observe(0.45, 0.1, False, 9.0)  # the recent mean (0.09 s) within target, past 0.8 × it: no growth
    assert slots.value == 11 and slots.tpot_s == pytest.approx(0.09) and not slots.past_target()
    slots.observe(0.5, 0.1, False, 10.0)  # the mean past its target: cut
    assert slots.past_target() and slots.value == pytest.approx(0.8 * 11)


def test_decode_slots_stop_at_max_num_seqs_and_never_move_when_fixed() -> None:
    slots = DecodeSlots(250, 256, fixed=False, grow_below=0.8)
    slots.limited = True
    for k in range(30):
        slots.observe(0.01, 0.1, False, float(k))
    assert slots.value == 256
    slots.observe(0.01, 0.1, True, 31.0)  # an engine reports a queue
    assert slots.value == pytest.approx(0.8 * 256)
    fixed = DecodeSlots(4, 256, fixed=True, grow_below=0.8)
    fixed.limited = True
    for k in range(30):
        fixed.observe(0.01 if k < 20 else 1.0, 0.1, k == 25, float(k))
    assert int(fixed) == 4 and fixed.past_target()

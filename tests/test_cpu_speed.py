"""The CPU speed probe the real-vLLM stage reports beside its fidelity table."""

from __future__ import annotations

import os
import time

import pytest

from tests.cpu_speed import CpuSpeedProbe, relative_speed


def test_relative_speed_compares_window_medians_of_the_loop_time() -> None:
    probe = CpuSpeedProbe(cores=[0, 1])
    probe.samples = [
        (1.0, 0, 0.001),
        (2.0, 1, 0.001),
        (3.0, 0, 0.004),
        (4.0, 0, 0.001),
        (10.0, 0, 0.002),
        (11.0, 1, 0.001),
        (12.0, 0, 0.0021),
        (13.0, 0, 0.002),
    ]
    assert probe.loop_s(0.5, 4.5) == pytest.approx(0.001)
    assert relative_speed(probe, (9.0, 13.5), [(0.0, 4.5)]) == pytest.approx(0.5)  # twice the CPU time: half as fast
    assert relative_speed(probe, (0.0, 4.5), [(9.0, 13.5)]) == pytest.approx(2.0)
    assert relative_speed(probe, (9.0, 13.5), [(0.0, 4.5)], core=1) == pytest.approx(1.0)  # core 1 kept its speed
    assert relative_speed(probe, (20.0, 30.0), [(0.0, 4.5)]) is None  # no sample in the window


def test_the_probe_samples_its_loop_until_stopped() -> None:
    cores = sorted(os.sched_getaffinity(0))
    with CpuSpeedProbe(period_s=0.01) as probe:
        deadline = time.monotonic() + 10
        while len(probe.samples) < 2 * len(cores) and time.monotonic() < deadline:
            time.sleep(0.01)
    count = len(probe.samples)
    assert count >= 2 * len(cores) and all(cpu > 0 for _, _, cpu in probe.samples)
    assert {core for _, core, _ in probe.samples} == set(cores)  # every core in turn
    assert os.sched_getaffinity(0) == set(cores)  # the caller's thread keeps its own affinity
    time.sleep(0.05)
    assert len(probe.samples) == count  # stopped

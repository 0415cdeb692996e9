"""The live advisor's per-instance profiles: each active instance named as the simulator names it, with the
profile the calibration projects it with now (its own, or its calibrated peers'), the rest on the main profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from console.live.advisor import instance_profiles
from core.types import Role
from tests.console.advisor.fakes import controller
from tests.console.live.calibration_fakes import PRIOR, FakeEngine, calibrated_p0


def test_each_instance_gets_what_the_calibration_projects_it_with() -> None:
    """p0 calibrated; p1 added beside it and projected with its peer's terms; d0 never scraped (the shared
    terms): the mapping holds p0's own profile and p1's borrowed one, and counts one calibrated."""
    d, cal, _, _ = calibrated_p0()
    own, peers = cal.projected_profile("p0"), cal.peer_profile(Role.PREFILL)
    assert own is not None and own[1] and peers is not None
    profiles, calibrated = instance_profiles(d, cal)
    assert profiles == {"p0": own[0], "p1": peers} and calibrated == 1
    assert profiles["p0"].prefill_per_token_s == pytest.approx(0.1 * PRIOR.prefill_per_token_s, rel=0.1)
    assert profiles["p0"] != PRIOR  # the engine runs 10× faster than the prior
    # p0 stops: the simulator's p0 is now the live p1, still on its (departed) peer's terms until forgotten
    d.remove_instance("p0")
    assert instance_profiles(d, cal) == ({"p0": peers}, 0)
    cal.forget("p0")
    assert instance_profiles(d, cal) == ({}, 0)


def test_the_consoles_advisor_simulates_its_calibrated_instance_on_its_own_profile(tmp_path: Path) -> None:
    """The controller hands the advisor its pool's calibration: before any scrape the shape carries no profile
    (every instance on the main one); once p0 is calibrated, the shape's p0 runs its calibrated profile."""
    c = controller(tmp_path, advisor=True)  # 1P2D
    shape = c.advisor._shape()
    assert (shape.n_prefill, shape.n_decode, shape.profiles, shape.calibrated) == (1, 2, {}, 0)
    p0, engine = c.instances["p0"], FakeEngine()
    p0.metrics_page = engine.interval(0, 1, 1)
    c.calibration.scraped(p0, 0.0)
    for t in range(1, 4):
        p0.metrics_page = engine.interval(4, 300, 8)
        c.calibration.scraped(p0, float(t))
        c.calibration.tick(float(t) + 0.05)
    projected = c.calibration.projected_profile("p0")
    assert projected is not None and projected[1]
    shape = c.advisor._shape()
    assert shape.profiles == {"p0": projected[0]} and shape.calibrated == 1
    assert shape.profiles_note(c.advisor.profile()) == (
        f"per-instance profiles (1 calibrated; 2 other instances on {c.advisor.profile().name})"
    )
    c.recorder.close()

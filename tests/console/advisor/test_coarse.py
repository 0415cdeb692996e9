"""When the advisor models the prefix cache in coarse blocks: the `[advisor] coarse_*` rule advice after advice on
hand-made costs, the settings it comes from, the advice saying which model it used, and a real worker switching."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from pydantic import ValidationError

from console.advisor.coarse import NO_KEYS, CoarseChooser, CoarseRule
from console.advisor.settings import AdvisorSettings
from console.advisor.simulate import Candidate, Shape, advise
from console.advisor.window import Window
from console.advisor.worker import AdvisorWorker
from core.perf import PerfProfile

PAIR = [Candidate("routing", "prefix_aware")]


def test_an_exact_advice_over_budget_turns_the_next_coarse_until_exact_would_fit_again() -> None:
    rule = CoarseRule(blocks=8, budget_s=24.0)
    c = CoarseChooser(rule)
    assert c.choose(64, True)[0] == 1  # nothing measured yet: exact
    c.record(1, 30.0, True)
    blocks, why = c.choose(64, True)
    assert blocks == 8 and why.startswith("the last exact advice took 30.0 CPU s, more than the budget of 24.0")
    c.record(8, 12.0, True)  # so exact costs 30 / 12 = 2.5 times coarse
    blocks, why = c.choose(64, True)
    assert blocks == 8 and "about 30.0 CPU s (the last coarse advice's 12.0 s × 2.50), more than" in why
    c.record(8, 9.0, True)  # traffic eased: 9 × 2.5 = 22.5 fits
    blocks, why = c.choose(64, True)
    assert blocks == 1 and "about 22.5 CPU s" in why and "within the budget" in why
    c.record(1, 23.0, True)
    assert c.choose(64, True) == (1, "the last exact advice took 23.0 CPU s, within the budget of 24.0 CPU s "
                                     "(coarse_cpu_share × period_s)")


def test_a_window_without_prefix_keys_is_exact_and_leaves_the_record_alone() -> None:
    c = CoarseChooser(CoarseRule(blocks=8, budget_s=1.0))
    c.record(1, 5.0, True)
    assert c.choose(64, False) == (1, NO_KEYS)
    c.record(1, 0.1, False)  # says nothing about the cache model's cost
    assert c.choose(64, True)[0] == 8


def test_a_cluster_above_the_size_limit_is_always_coarse_and_one_block_never() -> None:
    sized = CoarseChooser(CoarseRule(blocks=4, above_instances=32))
    assert sized.choose(64, True) == (4, "64 instances > coarse_above_instances = 32")
    assert sized.choose(32, True)[0] == 1
    never = CoarseChooser(CoarseRule(blocks=1, above_instances=2, budget_s=0.0))
    never.record(1, 100.0, True)
    assert never.choose(64, True) == (1, "coarse_blocks = 1: always exact")


def test_a_coarse_advice_without_an_exact_one_to_compare_tries_exact() -> None:
    c = CoarseChooser(CoarseRule(blocks=8, budget_s=10.0))
    c.record(8, 50.0, True)  # coarse by size before, say: no ratio known
    assert c.choose(64, True) == (1, "no exact advice to compare a coarse one with: trying exact")


def test_settings_make_the_rule_and_refuse_nonsense() -> None:
    assert AdvisorSettings().coarse_rule() == CoarseRule(blocks=8, above_instances=None, budget_s=24.0)
    s = AdvisorSettings.model_validate({"period_s": 10, "coarse_cpu_share": 0.5, "coarse_above_instances": 48})
    assert s.coarse_rule() == CoarseRule(blocks=8, above_instances=48, budget_s=5.0)
    assert AdvisorSettings(coarse_cpu_share=None).coarse_rule().budget_s is None
    for bad in ({"coarse_blocks": 0}, {"coarse_cpu_share": 0}, {"coarse_above_instances": 0}, {"coarse": 8}):
        with pytest.raises(ValidationError):
            AdvisorSettings.model_validate(bad)


def test_the_advice_names_its_cache_model(prefix_window: Window, small_cache_profile: PerfProfile) -> None:
    coarse = advise(prefix_window, Shape(2, 2), small_cache_profile, candidates=PAIR, key_blocks=8, cache_why="why")
    assert (coarse.cache_model, coarse.key_blocks, coarse.cache_why) == ("coarse prefix blocks (×8)", 8, "why")
    assert coarse.to_json()["cache_model"] == "coarse prefix blocks (×8)"
    keyless = dataclasses.replace(prefix_window, prefix_keys=None)
    plain = advise(keyless, Shape(2, 2), small_cache_profile, candidates=PAIR, key_blocks=8)
    assert (plain.cache_model, plain.key_blocks, plain.cache_why) == ("exact prefix blocks", 1, NO_KEYS)


def test_a_worker_goes_coarse_after_an_advice_over_its_budget(
    prefix_window: Window, small_cache_profile: PerfProfile
) -> None:
    rule = CoarseRule(blocks=8, budget_s=1e-6)  # any advice is over it
    worker = AdvisorWorker(Shape(2, 2), small_cache_profile, candidates=PAIR, coarse=rule)
    try:
        models = []
        for _ in range(2):
            worker.submit(prefix_window)
            answer = asyncio.run(worker.next_answer(120.0))
            assert answer is not None and answer.advice is not None, answer
            models.append((answer.advice.cache_model, answer.advice.cache_why))
    finally:
        worker.close()
    assert models[0] == ("exact prefix blocks", "exact unless an advice takes more than its budget")
    assert models[1][0] == "coarse prefix blocks (×8)" and models[1][1].startswith("the last exact advice took")

"""Per-instance step terms of the prefill projection: an instance given its own (calibrated) terms is
projected with them, the others with the shared ones; the dispatcher's `set_instance_profile`."""

from __future__ import annotations

import numpy as np
import pytest

from core.dispatch import Dispatcher
from core.prefill import PrefillQueues, StepTerms, project
from core.prefill_terms import InstanceTerms
from core.types import Role
from tests.core.prefill_profile import profile, step

SLOW = StepTerms.of(profile())
FAST = StepTerms.of(
    profile(decode_step_base_s=0.001, decode_step_per_seq_s=0.0001, prefill_base_s=0.0005, prefill_per_token_s=1e-6)
)


def fast_step(seqs: int, tokens: float) -> float:
    """One prefill step with FAST's terms by hand: 1 ms + 0.1 ms·seqs + 0.5 ms + 1 µs·tokens."""
    return 0.001 + 0.0001 * seqs + 0.0005 + 1e-6 * tokens


def test_vectorised_alone_matches_each_instances_own_terms_chunked_or_not() -> None:
    own = InstanceTerms()
    unchunked = StepTerms.of(profile(prefill_per_token2_s=1e-8), chunked=False)
    hosted = StepTerms.of(profile(prefill_host_per_request_s=0.004))  # each prompt's intake: 4 ms
    own.set(1, FAST)
    own.set(2, unchunked)
    own.set(3, hosted)
    lengths = np.array([512.0, 5000.0, 5000.0, 100.0])
    got = own.alone_s(lengths, SLOW)
    want = [SLOW.alone_s(512), FAST.alone_s(5000), unchunked.alone_s(5000), hosted.alone_s(100)]
    assert got == pytest.approx(want)
    assert got[3] == pytest.approx(0.004 + SLOW.alone_s(100))  # the intake, then the same step
    # by hand: 5000 tokens under a 2048 budget are three chunks, each its own step of one sequence
    assert got[1] == pytest.approx(3 * (0.001 + 0.0001 + 0.0005) + 1e-6 * 5000)
    own.set(1, None)
    assert own.of(1, SLOW) is SLOW and own.alone_s(lengths, SLOW)[1] == pytest.approx(SLOW.alone_s(5000))


def test_an_instance_with_its_own_terms_is_projected_with_them_the_other_with_the_shared() -> None:
    q = PrefillQueues(profile())
    q.add_instance()
    q.add_instance()
    q.set_terms(1, FAST)
    assert q.terms_of(0) == SLOW and q.terms_of(1) is FAST
    idle = q.first_token_at(512, 0.0)
    assert idle == pytest.approx([step(1, 512), fast_step(1, 512)])
    assert q.first_token_at_one(1, 512, 0.0) == pytest.approx(fast_step(1, 512))
    # a burst routed to instance 1 steps with its terms: the first prompt alone in the step that
    # started, the next four together in one step of the budget, the last in a step of its own
    dues = [q.push(1, f"r{k}", 512, 0.0) for k in range(6)]
    assert dues[-1] == pytest.approx(fast_step(1, 512) + fast_step(4, 2048) + fast_step(1, 512))
    assert q.free_at[1] == pytest.approx(dues[-1]) and q.free_at[0] == 0.0
    # the same prompts queued at once are what `project` steps with the same terms
    assert float(project([512] * 5, FAST).first_token[-1]) == pytest.approx(fast_step(4, 2048) + fast_step(1, 512))
    # a new prompt joins the last step (not started) with instance 1's terms, vectorised and alone
    later = q.first_token_at(np.array([512.0, 512.0]), 0.001)
    assert later[1] == pytest.approx(q.first_token_at_one(1, 512, 0.001))
    assert later[1] == pytest.approx(q.free_at[1] + 0.0001 + 1e-6 * 512)
    assert later[0] == pytest.approx(0.001 + step(1, 512))
    q.set_terms(1, None)
    assert q.terms_of(1) == SLOW


def test_the_dispatcher_projects_an_instance_with_its_calibrated_profile_and_forgets_it() -> None:
    slow = profile()
    d = Dispatcher(slow)
    d.add_instance("p0", Role.PREFILL)
    d.add_instance("p1", Role.PREFILL)
    d.add_instance("d0", Role.DECODE)
    fast = profile(decode_step_base_s=0.001, decode_step_per_seq_s=0.0001, prefill_base_s=0.0005)
    d.set_instance_profile("p1", fast)
    d.set_instance_profile("gone", fast)  # unknown ids are ignored
    assert d.instance_terms("p1") == StepTerms.of(fast) and d.instance_terms("p0") == StepTerms.of(slow)
    first = d.view.first_token_at(512)
    assert first[1] < first[0]
    assert first[1] == pytest.approx(StepTerms.of(fast).alone_s(512))
    assert d.prefill_backlog_s("p1", 0.0) == 0.0
    d.view.queues.push(1, "r", 512, 0.0)
    assert d.prefill_backlog_s("p1", 0.0) == pytest.approx(StepTerms.of(fast).alone_s(512))
    d.set_instance_profile("p1", None)
    assert d.instance_terms("p1") == StepTerms.of(slow)
